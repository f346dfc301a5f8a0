"""Eight producers commit the same document at once: each commit is all-or-nothing, and readers polling the
current generation never see shards of two generations in one response."""
from __future__ import annotations

import threading

from services.store.errors import AlreadyExists, NotFound

from .conftest import doc_key, make_generation

PRODUCERS = 8


def tag_of(data: bytes) -> str:
    return data.split(b"|", 1)[0].decode()


def test_eight_concurrent_committers(store):
    key = doc_key("race")
    gens = {f"p{i}": make_generation(key, tag=f"p{i}", layers=3, size=64 << 10) for i in range(PRODUCERS)}
    barrier = threading.Barrier(PRODUCERS)
    committed: dict[str, int] = {}
    errors: list[BaseException] = []
    done = threading.Event()
    seen: list[tuple[int, set[str]]] = []

    def produce(tag: str):
        try:
            with store.client() as c:
                b = c.begin(key, [s for s, _ in gens[tag]])
                c.put(b.upload_id, gens[tag])
                barrier.wait(30)
                committed[tag] = c.commit(b.upload_id).manifest.generation
        except BaseException as e:          # noqa: BLE001 - reported below
            errors.append(e)

    def read():
        with store.client() as c:
            while not done.is_set():
                for rank in range(key.tp_size):
                    try:
                        shards = list(c.fetch(key, rank))
                    except NotFound:
                        continue
                    seen.append(({s.generation for s in shards}.pop(), {tag_of(s.data) for s in shards}))

    readers = [threading.Thread(target=read) for _ in range(2)]
    producers = [threading.Thread(target=produce, args=(t,)) for t in gens]
    for t in readers + producers:
        t.start()
    for t in producers:
        t.join(120)
    done.set()
    for t in readers:
        t.join(60)
    assert not errors, errors
    assert sorted(committed.values()) == list(range(1, PRODUCERS + 1))
    by_gen = {g: tag for tag, g in committed.items()}
    assert seen, "readers saw nothing"
    for gen, tags in seen:
        assert tags == {by_gen[gen]}, f"a response mixed generations: generation {gen} had {tags}"
    with store.client() as c:
        m = c.manifest(key)
        assert m.current_generation == PRODUCERS and m.generations == tuple(range(1, PRODUCERS + 1))
        for g, tag in by_gen.items():
            got = {s.spec.name: s.data for s in c.fetch(key, 1, generation=g)}
            assert got == {s.name: d for s, d in gens[tag] if s.rank == 1}


def test_eight_producers_race_for_one_generation_number(store):
    key = doc_key("race-same-number")
    gens = {f"q{i}": make_generation(key, tag=f"q{i}", layers=2, size=32 << 10) for i in range(PRODUCERS)}
    barrier = threading.Barrier(PRODUCERS)
    outcome: dict[str, str] = {}

    def produce(tag: str):
        with store.client() as c:
            try:
                b = c.begin(key, [s for s, _ in gens[tag]], generation=42)
                c.put(b.upload_id, gens[tag])
                barrier.wait(30)
                c.commit(b.upload_id)
                outcome[tag] = "won"
            except AlreadyExists:
                outcome[tag] = "already_exists"

    threads = [threading.Thread(target=produce, args=(t,)) for t in gens]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    winners = [t for t, o in outcome.items() if o == "won"]
    assert len(outcome) == PRODUCERS and len(winners) == 1, outcome
    with store.client() as c:
        assert c.manifest(key).generations == (42,)
        for rank in range(key.tp_size):
            shards = list(c.fetch(key, rank))
            assert {tag_of(s.data) for s in shards} == {winners[0]}
            assert {s.spec.name: s.data for s in shards} == {s.name: d for s, d in gens[winners[0]] if s.rank == rank}
