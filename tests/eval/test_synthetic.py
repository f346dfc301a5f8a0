"""The synthetic tasks: deterministic in (seed, index), the answer held by the gold documents, every document
a standalone unit, reachable through `load_task` like the loaded tasks."""
import pytest

from runtime.eval.data import SYNTHETIC_TASKS, TASKS, DataError, QAExample, load_task
from runtime.eval.synthetic import GENERATORS, example, load_synthetic


@pytest.mark.parametrize("task", SYNTHETIC_TASKS)
def test_deterministic_for_a_seed(task):
    a = list(load_synthetic(task, limit=20))
    assert a == list(load_synthetic(task, limit=20)) and a[:5] == list(load_synthetic(task, limit=5))
    assert a[7] == example(task, 0, 7) and a[7].id == f"{task}-0-7"
    assert [e.paragraphs for e in load_synthetic(task, limit=5, seed=1)] != [e.paragraphs for e in a[:5]]
    assert len({e.paragraphs for e in a}) == 20                          # examples differ from each other
    assert all(isinstance(e, QAExample) and e.task == task for e in a)


@pytest.mark.parametrize("task", SYNTHETIC_TASKS)
def test_documents_are_standalone_units(task):
    for e in load_synthetic(task, limit=30):
        assert len(e.paragraphs) >= 3 and len(set(e.paragraphs)) == len(e.paragraphs)
        for p in e.paragraphs:
            # one short statement or two, naming no other document: it means the same reused anywhere
            assert p == p.strip() and p.endswith(".") and "Document" not in p and "\n" not in p and len(p) < 120
        assert e.gold and all(0 <= g < len(e.paragraphs) for g in e.gold)


def test_kv_retrieval_answer_is_in_its_document():
    for e in load_synthetic("kv_retrieval", limit=50):
        key = e.question.removeprefix("What is the code for ").removesuffix("?")
        (g,) = e.gold
        assert f"{e.answers[1]}." in e.paragraphs[g] and e.answers[1].endswith(e.answers[0])
        assert sum(f"for {key} " in p for p in e.paragraphs) == 1          # keys are distinct in a request


def test_var_tracking_chain_leads_to_the_answer():
    for e in load_synthetic("var_tracking", limit=50):
        value = e.answers[0]
        first, *hops = [e.paragraphs[g] for g in e.gold]
        assert value in first and sum(value in p for p in e.paragraphs) == 1
        # each hop copies the variable the previous statement defined; the last one is the one asked
        names = [first.split()[3]] + [h.split()[3] for h in hops]
        for prev, h in zip(names, hops):
            assert h.endswith(f"the password of {prev}.")
        assert e.question == f"What is the password of {names[-1]}?"
        assert e.answers[1] == f"The password of {names[-1]} is {value}"


def test_aggregation_answer_is_the_strict_plurality():
    for e in load_synthetic("aggregation", limit=50):
        seen = [p.removesuffix(".").split()[-1] for p in e.paragraphs]
        counts = {a: seen.count(a) for a in seen}
        best = max(counts.values())
        assert counts[e.answers[0]] == best and list(counts.values()).count(best) == 1
        assert [i for i, a in enumerate(seen) if a == e.answers[0]] == list(e.gold)


def test_load_task_names_the_synthetic_tasks():
    assert set(SYNTHETIC_TASKS) <= set(TASKS) and tuple(GENERATORS) == SYNTHETIC_TASKS
    assert list(load_task("kv_retrieval", limit=3)) == list(load_synthetic("kv_retrieval", limit=3))
    assert sum(1 for _ in load_task("aggregation")) == 1000
    with pytest.raises(DataError, match="generated"):
        load_task("var_tracking", "/nonexistent.jsonl")
