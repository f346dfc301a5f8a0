"""`make demo` runs `redknot demo`: on a machine with nothing configured it starts its own redis-server, the
store, the API, the builder and a worker, builds the documents, runs both arms, prints the tables and stops every
service cleanly. By default SmolLM2-135M-Instruct at TP1 answers HotpotQA questions over their paragraphs; with
`--v4` the random DeepSeek-V4 demo model at TP2 runs over the bundled texts. Small sizes; a fresh work directory
(so the checkpoint is converted or built too)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _demo(tmp_path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}      # nothing configured: its own Redis
    env.update(PYTHONUNBUFFERED="1", COLUMNS="160")
    p = subprocess.run([sys.executable, "-m", "services.cli", "demo", "--workdir", str(tmp_path), *args], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=540)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-5000:]
    return out


def test_make_demo_answers_hotpotqa_with_smollm2_in_both_arms(tmp_path):
    from runtime.eval.data import load_hotpotqa
    ex = next(load_hotpotqa(limit=1))
    out = _demo(tmp_path, "--questions", "1", "--new-tokens", "6")
    assert "model smollm2-135m-instruct, profile llama-preamble, TP=1" in out
    for row in ("HotpotQA through /v1/chat/completions", "gold", "recompute arm", "reuse arm",
                "TTFT recompute arm", "TTFT reuse arm (median; ran: reuse)", "1. logical head-row saving",
                "2. physical token-row", "3. analytic FLOP saving", "4. measured TTFT ratio", "fallbacks by reason",
                "F1 against the gold answer, reuse arm", "reuse answer equal to the recompute answer"):
        assert row in out, (row, out[-5000:])
    assert f" {ex.answers[0]} " in out and ex.question.split()[0] in out          # the gold answer, the question
    assert "{}" in out.split("fallbacks by reason", 1)[1].splitlines()[0]          # no fallback
    assert "stopped: api exit 0, worker exit 0, builder exit 0, store exit 0, redis exit 0" in out


def test_make_demo_v4_runs_the_random_deepseek_model_at_tp2(tmp_path):
    out = _demo(tmp_path, "--v4", "--repeat", "1", "--requests", "1", "--new-tokens", "2")
    for row in ("TTFT recompute arm", "TTFT reuse arm", "1. logical head-row saving", "2. physical token-row",
                "3. analytic FLOP saving", "4. measured TTFT ratio", "fallbacks by reason"):
        assert row in out, (row, out[-5000:])
    assert "ran: reuse" in out and "/metrics of worker: http://127.0.0.1:" in out
    assert "stopped: api exit 0, worker exit 0, builder exit 0, store exit 0, redis exit 0" in out
    assert not (tmp_path / "run" / "tier").exists() or not any((tmp_path / "run" / "tier").rglob("*.partial"))
