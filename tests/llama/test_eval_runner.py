"""The multi-process runner of `redknot eval`: chunks spread over two processes give the answers one process
gives, finished chunks are reused from the chunk directory, a passed deadline leaves chunks pending, and the
command writes the JSON and the markdown table."""
import dataclasses
import itertools
import json

import pytest

from runtime.eval.cli import main as eval_main
from runtime.eval.data import load_task, save_examples
from runtime.eval.runner import Chunk, RunSpec, plan, run_chunks


def test_plan_covers_the_range_once():
    assert plan(10, 7, 3) == [Chunk(10, 3), Chunk(13, 3), Chunk(16, 1)]
    assert plan(0, 2, 5) == [Chunk(0, 2)]


def test_the_chunk_key_names_every_setting(tmp_path):
    a = RunSpec(model_dir=str(tmp_path), task="hotpotqa", data=None, budgets=(0.25,), fences=(3, 3), max_new_tokens=4)
    assert a.key() == dataclasses.replace(a).key()
    assert a.key() == dataclasses.replace(a, device="cpu:0").key()            # the device index does not matter
    for change in ({"budgets": (0.1,)}, {"fences": (2, 3)}, {"max_new_tokens": 5}, {"dtype": "bfloat16"},
                   {"task": "squad"}, {"data": str(tmp_path / "x")}):
        assert dataclasses.replace(a, **change).key() != a.key(), change


def test_a_changed_default_knob_changes_the_chunk_key(tmp_path, monkeypatch):
    """The key holds every arm as it resolves, so chunks run under an older default (the eval's rows were once
    chosen by the shared controller) are not reused when the default changes."""
    import runtime.eval.arms as arms
    a = RunSpec(model_dir=str(tmp_path), task="hotpotqa", data=None, budgets=(0.25,), fences=(3, 3), max_new_tokens=4)
    before = a.key()
    monkeypatch.setitem(arms.DEFAULTS, "select", "mixed")
    assert a.key() != before


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """Two HotpotQA questions cut to three paragraphs each, as an examples file."""
    ex = [dataclasses.replace(e, paragraphs=e.paragraphs[:3]) for e in itertools.islice(load_task("hotpotqa"), 2)]
    f = tmp_path_factory.mktemp("data") / "hq2.examples.jsonl"
    save_examples(ex, f)
    return f


def test_two_processes_equal_one(smollm2_dir, small_data, tmp_path):
    spec = RunSpec(model_dir=str(smollm2_dir), task="hotpotqa", data=str(small_data), budgets=(0.25,),
                   fences=(3, 3), max_new_tokens=3)
    chunks = plan(0, 2, 1)
    seen = []
    two = run_chunks(spec, chunks, procs=2, chunk_dir=tmp_path / "chunks", progress=seen.append)
    one = run_chunks(spec, chunks, procs=1)
    assert [s["ids"] for s in two.summaries] == [s["ids"] for s in one.summaries] and not two.pending
    assert seen[-1] == 2
    for a, b in zip(two.summaries, one.summaries):
        for arm in a["raw"]:
            assert a["raw"][arm]["answers"] == b["raw"][arm]["answers"], arm
            assert a["raw"][arm]["kl"] == pytest.approx(b["raw"][arm]["kl"], abs=1e-4), arm
    # the chunk directory holds both chunks: a second run computes nothing
    again = run_chunks(spec, chunks, procs=2, chunk_dir=tmp_path / "chunks")
    assert again.reused == 2 and again.summaries == two.summaries
    # a passed deadline starts no chunk
    late = run_chunks(dataclasses.replace(spec, max_new_tokens=2), chunks, procs=1, deadline=0.0)
    assert late.summaries == [] and late.pending == chunks


def test_the_command_merges_chunks_and_writes_the_table(smollm2_dir, small_data, tmp_path, capsys):
    out = tmp_path / "hq.json"
    rc = eval_main(["--task", "hotpotqa", "--data", str(small_data), "--model", str(smollm2_dir), "--limit", "2",
                    "--budgets", "0.25", "--max-new-tokens", "2", "--procs", "2", "--device", "cpu",
                    "--chunk-dir", str(tmp_path / "chunks"), "--out", str(out)])
    assert rc == 0
    s = json.loads(out.read_text())
    assert s["n"] == 2 and s["procs"] == 2 and s["pending"] == [] and len(s["ids"]) == 2
    assert set(s["arms"]) == {"recompute", "prefix-only", "naive", "reuse@25%"}
    table = out.with_suffix(".md").read_text()
    assert table.startswith("### hotpotqa (n = 2)") and "| reuse@25% |" in table
    assert table.strip() in capsys.readouterr().out
