"""bench/moe.py stays runnable: a CPU smoke run at tiny dims (not a measurement) with dropped slots (adaptive fanout)
and without, the grouped form's output equal to the loop's."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("fanout", ["adaptive", "native"])
def test_moe_bench_grouped_equals_the_per_expert_loop(tmp_path, fanout):
    out = tmp_path / "moe.json"
    subprocess.run([sys.executable, "bench/moe.py", "--small", "--rows", "37,130", "--experts", "8", "--reps", "1",
                    "--fanout", fanout, "--json", str(out)], cwd=ROOT, check=True, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [r["rows"] for r in rows] == [37, 130]
    for r in rows:
        assert r["rel_diff"] < 1e-6 and r["loop_s"] > 0 and r["grouped_s"] > 0
        assert (r["slots"] == 6 * r["rows"]) == (fanout == "native")      # adaptive fanout dropped some slots


def test_moe_bench_refuses_bad_rows():
    r = subprocess.run([sys.executable, "bench/moe.py", "--small", "--rows", "0"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "--rows and --experts must be positive" in r.stderr
