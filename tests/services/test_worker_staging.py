"""The worker's reuse forward consumes layer groups as they arrive (runtime.reuse.stager.GroupStager through
request.answer_staged), proven by the order of events, never by timing: a source that holds group g+1 back until
the forward consumed group g still yields the reuse arm, with the same logits, ledger and tokens as `answer` over
whole directories. A late group that fails verification on any rank restarts the request in the recompute arm
(counted, the recompute answer), in process, through a real store process, and across two gloo ranks."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from runtime.model.checkpoint import build_demo_tokenizer, load_tokenizer, random_state, write_official_checkpoint
from runtime.model.config import tiny
from runtime.model.parallel import Parallel
from runtime.reuse.certificate import FallbackCounter, FallbackReason
from runtime.reuse.stager import SourceError, StagedSource, Trace
from runtime.reuse.producer import pad_document
from runtime.reuse.profile import ReuseProfile
from runtime.reuse.request import ServingIdentity, answer, answer_staged, build
from runtime.reuse.roles import channel_range
from runtime.reuse.store import CERTIFICATE_FILE, MANIFEST_FILE
from services.common.failpoints import Failpoints
from services.common.serving import Binding
from services.common.tenants import Tenants
from services.common.tp import RankGroup, launch
from runtime.reuse.greedy import greedy
from tests.tiny import tiny_model
from services.worker.engine import Job, RankEngine
from services.worker.prefetch import Prefetcher
from services.worker.protocol import WorkerDocument, WorkerRequest
from services.worker.tier import PinnedTier

from .conftest import TOKENS

CFG = tiny(n_layers=6, compress_ratios=(0, 4, 16, 4, 16, 4), n_hash_layers=2)
PROF = ReuseProfile(first_fences=2, last_fences=2, align=16, budget=0.25, recent_rows=16, join_rows=8)
IDENT = ServingIdentity("f" * 64, "tok-v1")
GROUPS = (range(0, 2), range(2, 4), range(4, 6))
GATE_S = 60.0          # a deadlock guard only: a pipeline that waited for every group would never get past it


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    m = tiny_model(CFG, seed=11)
    g = torch.Generator().manual_seed(12)
    docs = [torch.randint(2, CFG.vocab_size, (n,), generator=g).tolist() for n in (40, 70)]
    question = torch.randint(2, CFG.vocab_size, (10,), generator=g).tolist()
    root = tmp_path_factory.mktemp("arts")
    dirs = [build(m, d, PROF, IDENT, root / f"doc{i}", generation=1) for i, d in enumerate(docs)]
    return m, docs, question, dirs


def whole(setup):
    """`answer` over whole directories: the reference (fresh each time: decoding advances its state)."""
    m, docs, question, dirs = setup
    ref = answer(m, PROF, docs, dirs, question, IDENT, current_generation=1)
    assert ref.arm == "reuse"
    return ref


def _layer(name: str) -> int | None:
    return int(name.split(".")[0][5:]) if name.startswith("layer") else None


def dir_sources(dirs, trace: Trace, pool: ThreadPoolExecutor, gate: bool) -> list[StagedSource]:
    """Each directory read group by group; with `gate`, group g+1's bytes appear only once the forward consumed
    group g (the first document's reads note fetch_start / fetch_done)."""
    out = []
    for j, d in enumerate(dirs):
        names = sorted(os.listdir(d))

        def read(d=d, names=names, layers=None, g=-1, j=j):
            if j == 0:
                trace.add("fetch_start", g)
            if gate and g > 0 and not trace.wait("consume", g - 1, GATE_S):
                raise SourceError(FallbackReason.STORE_UNAVAILABLE, f"group {g} held back: group {g - 1} never consumed")
            pick = [n for n in names if n in (CERTIFICATE_FILE, MANIFEST_FILE)] if layers is None else \
                [n for n in names if _layer(n) in layers]
            files = {n: (Path(d) / n).read_bytes() for n in pick}
            if j == 0:
                trace.add("fetch_done", g)
            return files
        head = pool.submit(read)
        out.append(StagedSource(head, tuple((r, pool.submit(read, layers=r, g=g)) for g, r in enumerate(GROUPS))))
    return out


def test_the_forward_consumes_group_g_while_group_g_plus_1_is_still_arriving(setup):
    m, docs, question, dirs = setup
    ref = whole(setup)
    trace = Trace()
    with ThreadPoolExecutor(8) as pool:
        out = answer_staged(m, PROF, docs, dir_sources(dirs, trace, pool, gate=True), question, IDENT, 1,
                            trace=trace)
    assert out.arm == "reuse" and out.verdict.ok
    assert torch.equal(out.logits, ref.logits)                        # the same numbers as whole directories
    assert out.ledger.summary() == ref.ledger.summary()
    assert greedy(out.logits, out.step, 6, {CFG.eos_token_id}, True) == \
        greedy(ref.logits, ref.step, 6, {CFG.eos_token_id}, True)
    for g in range(len(GROUPS)):
        # never read before it was verified and staged (its event recorded), then waited on
        assert trace.index("staged", g) < trace.index("ready", g) <= trace.index("consume", g)
        if g + 1 < len(GROUPS):
            # group g+1 started arriving before, and finished after, the forward took group g
            assert trace.index("fetch_start", g + 1) < trace.index("consume", g) < trace.index("fetch_done", g + 1)


def _corrupt_last_group(src: Path, dst: Path) -> str:
    shutil.copytree(src, dst)
    name = sorted(n for n in os.listdir(dst) if _layer(n) in GROUPS[-1])[-1]
    data = bytearray((dst / name).read_bytes())
    data[len(data) // 2] ^= 0x5A
    (dst / name).write_bytes(bytes(data))
    return name


def test_a_corrupted_late_group_restarts_the_request_in_the_recompute_arm(setup, tmp_path):
    m, docs, question, dirs = setup
    bad = [dirs[0], tmp_path / "doc1"]
    _corrupt_last_group(dirs[1], bad[1])
    full = torch.tensor([t for d in docs for t in pad_document(d, PROF.align, CFG.eos_token_id)] + question)
    rec = m(full, cache := m.new_cache())
    trace, counter = Trace(), FallbackCounter()
    with ThreadPoolExecutor(8) as pool:
        out = answer_staged(m, PROF, docs, dir_sources(bad, trace, pool, gate=True), question, IDENT, 1,
                            counter=counter, trace=trace)
    assert out.arm == "recompute" and out.ledger is None
    assert out.verdict.reason is FallbackReason.DIGEST_MISMATCH and "layer05" in out.verdict.detail
    assert out.document == 1                                              # the document at fault, for a rebuild
    assert counter.snapshot()["digest_mismatch"] == 1 and sum(counter.snapshot().values()) == 1
    assert torch.equal(out.logits, rec)
    nxt = int(rec.argmax())
    assert torch.equal(out.step(nxt), m(torch.tensor([nxt]), cache))     # decoding continues in the recompute arm
    # the reuse forward had started (groups 0 and 1 consumed) and never read the rejected group
    assert ("consume", 1) in trace.events and ("consume", 2) not in trace.events


# ------------------------------------------------------------------------------------------- through a store

def _engine(model, store_target, tier_root, trace=None) -> RankEngine:
    group = RankGroup(0, 1, torch.device("cpu"), Parallel())
    tier = PinnedTier(1 << 30)
    pf = Prefetcher(tier, Tenants(TOKENS), store_target, 0, channel_range(CFG, 0, 1), CFG.n_layers, 2, 4, trace)
    return RankEngine(group, model, Binding(IDENT, PROF, 1, CFG.eos_token_id), pf, Failpoints(""), trace)


def _request(docs, question, arm="reuse") -> Job:
    return Job(WorkerRequest(tenant="acme", documents=[WorkerDocument(id=f"d{i}", tokens=d, generation=1)
                                                      for i, d in enumerate(docs)],
                             question=question, max_new_tokens=5, arm=arm))


def test_the_worker_streams_groups_from_the_store_then_the_tier_and_falls_back_on_a_late_group(
        setup, store, client, tmp_path):
    m, docs, question, dirs = setup
    ref = whole(setup)
    for d in dirs:
        client.put_artifact([d])
    want = greedy(ref.logits, ref.step, 5, {CFG.eos_token_id}, True)   # what the worker decodes at temperature 0
    trace = Trace()
    eng = _engine(m, store.target, tmp_path / "tier", trace)
    try:
        cold, _ = eng.run(_request(docs, question))
        assert cold.arm == "reuse" and cold.fallback is None and cold.tokens == want
        assert cold.ledger["rows"] == ref.ledger.summary()["rows"]
        assert len(eng.tier.keys()) == 2                              # both published whole into the tier
        n_events = len(trace.events)
        hot, reports = eng.run(_request(docs, question))
        # both documents from the pinned tier: no fetch, no group staged (the all-hot path: answer's layer-ahead
        # copies of pinned, already verified layers), the same answer
        assert hot.arm == "reuse" and hot.tokens == want and reports[0].tier.hits == 2
        assert trace.events[n_events:] == []
        assert reports[0].tier_bytes == eng.tier.used > 0
        rec, _ = eng.run(_request(docs, question, "recompute"))

        # one document leaves the tier: the next request stages that one from the store, group by group, beside
        # the other's tier layers (the mixed path), and publishes it again
        tkey = (eng.tier.keys()[0])
        eng.tier.drop(tkey)
        n_events = len(trace.events)
        mixed, reports = eng.run(_request(docs, question))
        assert mixed.arm == "reuse" and mixed.fallback is None and mixed.tokens == want
        assert reports[0].tier.hits == 1 and reports[0].tier.misses["dropped"] == 1
        assert [g for e, g in trace.events[n_events:] if e == "consume"] == [0, 1, 2]
        assert tkey in eng.tier.keys()

        # documents that lost their current generation (0): the tier's copies are handed to the certificate check,
        # which alone refuses them (stale), and the request answers as the recompute arm
        stale = Job(WorkerRequest(tenant="acme", documents=[WorkerDocument(id=f"d{i}", tokens=d, generation=0)
                                                           for i, d in enumerate(docs)],
                                  question=question, max_new_tokens=5, arm="reuse"))
        n_events = len(trace.events)
        old, _ = eng.run(stale)
        assert old.arm == "recompute" and old.fallback.reason == "stale_generation" and old.tokens == rec.tokens
        assert trace.events[n_events:] == [] and len(eng.tier.keys()) == 2
    finally:
        eng.prefetcher.close()

    # the store's blob of a late group is corrupt (a fresh worker: nothing in its tier)
    key = eng.key(docs[1])
    spec = next(s for s in client.manifest(key).manifest.select(0) if s.name.startswith("layer05."))
    blob = next(store.blob_root.rglob(spec.digest))
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x5A
    blob.write_bytes(bytes(data))
    fresh = _engine(m, store.target, tmp_path / "tier2")
    try:
        out, _ = fresh.run(_request(docs, question))
        assert out.arm == "recompute" and out.fallback.reason == "digest_mismatch" and out.tokens == rec.tokens
        assert out.fallback.document == "d1"                          # the worker names the document at fault
        assert len(fresh.tier.keys()) <= 1                            # the corrupt fetch was never published
    finally:
        fresh.prefetcher.close()


# ------------------------------------------------------------------------------------------- two gloo ranks

def _rank(group: RankGroup, ckpt: str, out: str) -> None:
    from runtime.model.loader import load_model
    model = load_model(ckpt, par=group.par)
    cfg = model.cfg
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in (40, 70)]
    question = torch.randint(2, cfg.vocab_size, (10,), generator=g).tolist()
    root = Path(out) / f"rank{group.rank}"
    dirs = [build(model, d, PROF, IDENT, root / f"doc{i}", generation=1) for i, d in enumerate(docs)]
    result = {}
    for case in ("clean", "late"):
        use = list(dirs)
        if case == "late" and group.rank == 1:                       # only rank 1's copy is corrupt
            use[1] = root / "bad"
            _corrupt_last_group(dirs[1], use[1])
        trace = Trace()
        with ThreadPoolExecutor(8) as pool:
            o = answer_staged(model, PROF, docs, dir_sources(use, trace, pool, gate=True), question, IDENT, 1,
                              control=group.control, trace=trace)
        full = torch.tensor([t for d in docs for t in pad_document(d, PROF.align, cfg.eos_token_id)] + question)
        result[case] = dict(arm=o.arm, reason=o.verdict.reason.value if o.verdict.reason else None,
                            equals_recompute=bool(torch.equal(o.logits, model(full))),
                            consumed=[g for e, g in trace.events if e == "consume"])
    (Path(out) / f"rank{group.rank}.json").write_text(json.dumps(result))


def test_two_ranks_agree_per_group_and_restart_together_when_one_rank_rejects_a_late_group(tmp_path):
    ckpt, tok = tmp_path / "ckpt", tmp_path / "tokenizer.json"
    build_demo_tokenizer(300, tok)
    cfg = tiny(vocab_size=load_tokenizer(tok).get_vocab_size(), n_layers=6, compress_ratios=(0, 4, 16, 4, 16, 4),
               n_hash_layers=2)
    write_official_checkpoint(ckpt, cfg, random_state(cfg, seed=7), quantize=False, tokenizer_json=tok)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert launch(2, _rank, (str(ckpt), str(tmp_path)), device="cpu") == 0
    finally:
        for s, h in handlers.items():      # launch() forwards these to rank 0 while it supervises
            signal.signal(s, h)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["clean"]["arm"] == r1["clean"]["arm"] == "reuse"
    assert r0["clean"]["consumed"] == r1["clean"]["consumed"] == [0, 1, 2]
    # rank 1 rejects group 2 on its own; rank 0 follows (rank_disagreement); both after consuming groups 0 and 1
    assert (r0["late"]["arm"], r1["late"]["arm"]) == ("recompute", "recompute")
    assert (r0["late"]["reason"], r1["late"]["reason"]) == ("rank_disagreement", "digest_mismatch")
    assert r0["late"]["consumed"] == r1["late"]["consumed"] == [0, 1]
    assert r0["late"]["equals_recompute"] and r1["late"]["equals_recompute"]


def test_a_shadow_recompute_measures_the_served_answer_against_the_recompute_arm(setup, store, client, tmp_path):
    """A reuse request drawn for a shadow keeps its logits per position; the shadow runs the recompute arm
    teacher-forced on the served tokens and compares. Checked against the same numbers computed independently:
    the reference reuse path's logits step by step, and one forward of the plain model over the whole sequence."""
    m, docs, question, dirs = setup
    for d in dirs:
        client.put_artifact([d])
    eng = _engine(m, store.target, tmp_path / "tier")
    try:
        req = _request(docs, question)
        resp, _ = eng.run(Job(req.request, shadow=True))
        assert resp.arm == "reuse" and eng.shadow_pending
        got = eng.shadow()
        assert not eng.shadow_pending
        rec_only, _ = eng.run(Job(_request(docs, question, "recompute").request, shadow=True))
        assert not eng.shadow_pending                  # the recompute arm has nothing to compare
    finally:
        eng.prefetcher.close()
    toks = resp.tokens
    ref = whole(setup)
    reuse = [ref.logits]
    for t in toks[:-1]:
        reuse.append(ref.step(t))
    padded = [t for d in docs for t in pad_document(d, PROF.align, CFG.eos_token_id)] + question
    full = m(torch.tensor(padded + toks[:-1]), m.new_cache(), all_logits=True)[len(padded) - 1:]
    r, q = full.float(), torch.stack(reuse).float()
    agree = float((r.argmax(-1) == q.argmax(-1)).float().mean())
    kl = float((r.softmax(-1) * (r.log_softmax(-1) - q.log_softmax(-1))).sum(-1).mean())
    assert got.positions == len(toks) == 5
    assert got.agreement == pytest.approx(agree, abs=1e-6) and got.kl == pytest.approx(kl, rel=1e-3, abs=1e-6)
    assert got.kl > 1e-4 and 0 < got.agreement <= 1      # the 25% budget approximates: a measurable divergence


def test_decoding_at_temperature_0_is_the_shared_greedy_loop_and_sampling_repeats_with_its_seed(setup):
    """The worker's step-wise decoding (decode.Decoding) gives the engines' greedy answer at temperature 0, tells
    why it ended, and draws the same tokens again from the same seed (others differ)."""
    from services.worker.decode import Decoding, Sampler, Sampling

    def run(sampling: Sampling, n: int = 8, cancel_after: int | None = None) -> Decoding:
        ref = whole(setup)
        d = Decoding(ref.logits, n, CFG.eos_token_id, Sampler(sampling, ref.logits.device))
        while not d.done:
            if cancel_after is not None and len(d.tokens) >= cancel_after:
                d.cancel()
            else:
                d.draw(ref.step(d.last))
        return d
    ref = whole(setup)
    g = run(Sampling())
    assert g.tokens == greedy(ref.logits, ref.step, 8, {CFG.eos_token_id}, True)
    assert g.finish == ("stop" if g.tokens[-1] == CFG.eos_token_id else "length")
    assert run(Sampling(), cancel_after=3).tokens == g.tokens[:3] and run(Sampling(), cancel_after=3).finish == \
        "cancelled"
    a = run(Sampling(1.2, 1.0, 7))
    assert run(Sampling(1.2, 1.0, 7)).tokens == a.tokens
    assert any(run(Sampling(1.2, 1.0, s)).tokens != a.tokens for s in (8, 9, 10))
    assert run(Sampling(1.2, 1e-9, 3)).tokens == g.tokens          # top_p this small keeps only the argmax
    with pytest.raises(ValueError):
        Sampler(Sampling(-1.0), ref.logits.device)
    with pytest.raises(ValueError, match="already ended"):     # an ended decoding draws no more tokens
        g.draw(ref.logits)


def test_a_reuse_request_the_calibration_gate_closed_recomputes_with_the_reason_uncalibrated(setup, store, client,
                                                                                             tmp_path):
    """Rank 0's gate closed (`Job.uncalibrated`): the reuse request runs the recompute arm, fetches nothing, and
    reports the fallback `uncalibrated` with the gate's reason; the answer is the recompute arm's."""
    m, docs, question, dirs = setup
    for d in dirs:
        client.put_artifact([d])
    eng = _engine(m, store.target, tmp_path / "tier")
    try:
        rec, _ = eng.run(_request(docs, question, "recompute"))
        job = dataclasses.replace(_request(docs, question), uncalibrated="the calibration record did not pass: tf_top1")
        got, reports = eng.run(job)
        assert got.arm == "recompute" and got.tokens == rec.tokens
        assert got.fallback.reason == "uncalibrated" and got.fallback.detail == "rank 0: " + job.uncalibrated
        assert reports[0].tier.hits == 0 and sum(reports[0].tier.misses.values()) == 0     # nothing looked up
        assert eng.tier.keys() == []
    finally:
        eng.prefetcher.close()
