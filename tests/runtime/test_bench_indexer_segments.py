"""bench/indexer_segments.py stays runnable: a smoke run under Triton's interpreter (float32, tiny shapes; not a
measurement) times both CUDA paths of the online indexer and finds their scores equal bit for bit; without a GPU
or the interpreter it refuses with its message."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_under_the_interpreter_times_both_paths_and_they_agree():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "bench/indexer_segments.py", "--shapes", "8:2:16,20:3:40", "--reps", "1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = re.findall(r"rows +(\d+) segments +(\d+) x +(\d+) entries: by segment +([\d.]+) ms, one launch +([\d.]+) ms"
                      r" \(([\d.]+)x\); max \|diff\| (\S+) of max \|score\| (\S+)", r.stdout)
    assert [(int(a), int(b), int(c)) for a, b, c, *_ in rows] == [(8, 2, 16), (20, 3, 40)], r.stdout
    for *_, ta, tb, ratio, diff, scale in rows:
        assert float(ta) > 0 and float(tb) > 0 and float(diff) == 0.0 and float(scale) > 0


def test_without_a_gpu_or_the_interpreter_it_says_so():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    r = subprocess.run([sys.executable, "bench/indexer_segments.py"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1 and "no GPU here" in r.stderr, r.stderr[-500:]
