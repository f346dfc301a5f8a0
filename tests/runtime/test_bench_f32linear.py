"""bench/f32linear.py stays runnable: a CPU smoke run (reference form only, tiny shapes; not a measurement) writes
one row per shape and row count with the float32 GEMM's error against float64; bad arguments are refused."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_f32linear_bench_cpu_smoke(tmp_path):
    out = tmp_path / "f.json"
    subprocess.run([sys.executable, "bench/f32linear.py", "--small", "--rows", "16,40", "--dim", "256", "--reps", "1",
                    "--json", str(out)], cwd=ROOT, check=True, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kind"], r["rows"]) for r in rows] == [(k, t) for k in ("csa", "hca", "indexer") for t in (16, 40)]
    assert all(0 <= r["fp32_rel"] < 1e-5 and r["fp32_s"] > 0 for r in rows)


def test_f32linear_bench_refuses_bad_dim():
    r = subprocess.run([sys.executable, "bench/f32linear.py", "--small", "--dim", "100"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--dim a positive multiple of 8" in r.stderr
