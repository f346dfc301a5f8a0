"""Synthetic multi-document tasks, RULER-style, generated from a seed (no download), that a 135M model can do
with plain recomputation, so the arms' answers carry signal. Every example is a `QAExample` like the loaded
ones: short documents that stand alone (each makes sense, and tokenizes, without the others: reusable units),
a question, the gold answers, the indices of the documents holding the evidence. Example i of a task depends
only on (task, seed, i): a generator seeded by that string draws it, so it does not depend on `limit`.

- kv_retrieval: each document holds a few "The code for KEY is VALUE." sentences (keys distinct across the
  request, values 4-digit numbers); the question asks one key's code.
- var_tracking: one document gives a variable's value ("The password of A is V."), later documents copy it
  along a chain ("The password of B is the password of A."); other chains carry other values as
  distractors; the question asks the value of the chain's last variable.
- aggregation: each document is one short note naming the animal seen that day; one animal appears in most
  notes, the others once each; the question asks which animal was seen most often.

Gold answers: the bare value, and the sentence that states it in the documents' own wording ("The code for
apple is 4821"), because a 135M instruct model answers in that sentence far more often than with the bare
value. The formats were measured on SmolLM2-135M-Instruct's recompute arm (docs/QUALITY.md, "Synthetic tasks"):
kv_retrieval is easy for it, var_tracking (one hop) is hard, aggregation it cannot do (it copies a document).
"""
from __future__ import annotations

import random
import string
from typing import Callable, Iterator

from .example import QAExample

SIZE = 1000                             # examples per task unless `limit` says otherwise

# one-token-ish common nouns, distinct, so a key is never a substring of another
KEYS = ("apple", "river", "candle", "tiger", "piano", "garden", "rocket", "silver", "window", "forest",
        "pencil", "island", "dragon", "mirror", "jacket", "planet", "bottle", "castle", "flower", "hammer",
        "ladder", "monkey", "orange", "pepper", "rabbit", "saddle", "tomato", "violin", "wallet", "yogurt",
        "anchor", "basket", "cactus", "donkey", "engine", "falcon", "guitar", "helmet", "igloo", "jungle",
        "kettle", "lemon", "magnet", "needle", "oyster", "parrot", "quartz", "ribbon", "spider", "turtle")
ANIMALS = ("cat", "dog", "horse", "goat", "duck", "owl", "fox", "bear", "frog", "sheep", "cow", "deer", "wolf",
           "mouse", "pig", "crow")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def _rng(task: str, seed: int, index: int) -> random.Random:
    return random.Random(f"{task}:{seed}:{index}")


def kv_retrieval(rng: random.Random, docs: int = 4, pairs: int = 2) -> QAExample:
    """`docs` documents of `pairs` sentences each; one key asked."""
    keys = rng.sample(KEYS, docs * pairs)
    values = rng.sample(range(1000, 10000), docs * pairs)
    paragraphs = tuple(" ".join(f"The code for {keys[d * pairs + j]} is {values[d * pairs + j]}."
                                for j in range(pairs)) for d in range(docs))
    ask = rng.randrange(docs * pairs)
    return QAExample(id="", question=f"What is the code for {keys[ask]}?",
                     answers=(str(values[ask]), f"The code for {keys[ask]} is {values[ask]}"),
                     paragraphs=paragraphs, task="kv_retrieval", gold=(ask // pairs,))


def _var_name(rng: random.Random, taken: set[str]) -> str:
    while True:
        name = "".join(rng.choices(string.ascii_uppercase, k=3))
        if name not in taken:
            taken.add(name)
            return name


def var_tracking(rng: random.Random, hops: int = 1, chains: int = 2) -> QAExample:
    """`chains` chains of hops + 1 variables; chain c's assignment is document c, its hop h is document
    chains * h + c, so every document holds one statement and the asked chain's documents are spread."""
    taken: set[str] = set()
    names = [[_var_name(rng, taken) for _ in range(hops + 1)] for _ in range(chains)]
    values = rng.sample(range(10000, 100000), chains)
    order = rng.sample(range(chains), chains)                    # which chain is in which document column
    paragraphs = []
    for h in range(hops + 1):
        for c in order:
            v = names[c]
            paragraphs.append(f"The password of {v[0]} is {values[c]}." if h == 0 else
                              f"The password of {v[h]} is the password of {v[h - 1]}.")
    ask = rng.randrange(chains)
    col = order.index(ask)
    last = names[ask][-1]
    return QAExample(id="", question=f"What is the password of {last}?",
                     answers=(str(values[ask]), f"The password of {last} is {values[ask]}"),
                     paragraphs=tuple(paragraphs), task="var_tracking",
                     gold=tuple(chains * h + col for h in range(hops + 1)))


def aggregation(rng: random.Random, docs: int = 5, majority: int = 3) -> QAExample:
    """`docs` notes, `majority` of them naming the same animal, every other note a different animal."""
    assert majority > docs - majority, f"majority {majority} of {docs} notes is not a strict plurality"
    animals = rng.sample(ANIMALS, docs - majority + 1)
    seen = [animals[0]] * majority + animals[1:]
    rng.shuffle(seen)
    days = rng.sample(DAYS, docs)
    paragraphs = tuple(f"On {d}, I saw a {a}." for d, a in zip(days, seen))
    return QAExample(id="", question="Which animal did I see most often?",
                     answers=(animals[0], f"I saw a {animals[0]} most often"),
                     paragraphs=paragraphs, task="aggregation",
                     gold=tuple(i for i, a in enumerate(seen) if a == animals[0]))


GENERATORS: dict[str, Callable[..., QAExample]] = {"kv_retrieval": kv_retrieval, "var_tracking": var_tracking,
                                                   "aggregation": aggregation}
SYNTHETIC_TASKS = tuple(GENERATORS)


def example(task: str, seed: int, index: int, **kw) -> QAExample:
    ex = GENERATORS[task](_rng(task, seed, index), **kw)
    return QAExample(id=f"{task}-{seed}-{index}", question=ex.question, answers=ex.answers,
                     paragraphs=ex.paragraphs, task=task, gold=ex.gold)


def load_synthetic(task: str, limit: int | None = None, seed: int = 0, **kw) -> Iterator[QAExample]:
    """Examples 0.. of `task` (SIZE of them unless `limit`); `kw` are the generator's knobs."""
    assert task in GENERATORS, f"unknown synthetic task {task!r}"
    for i in range(SIZE if limit is None else limit):
        yield example(task, seed, i, **kw)
