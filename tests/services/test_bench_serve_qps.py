"""bench/serve_qps.py stays runnable: its --small CPU run (not a measurement) starts the real stack, builds the
documents, and drives both arms at concurrency 1 and 2 through streamed `POST /v1/completions` with a fixed output
length. The script stops on a reuse request that fell back or a request of another length; here its JSON is
checked."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_serve_qps_small_drives_both_arms_at_each_concurrency(tmp_path):
    out = tmp_path / "qps.json"
    r = subprocess.run([sys.executable, "bench/serve_qps.py", "--small", "--workdir", str(tmp_path / "work"),
                        "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["device"] == "cpu" and run["fallbacks"] == 0 and all(c == 0 for c in run["exit_codes"].values())
    assert {(row["arm"], row["concurrency"]) for row in run["rows"]} == {(a, c) for a in ("recompute", "reuse")
                                                                         for c in (1, 2)}
    for row in run["rows"]:
        assert row["requests"] >= 3 and len(row["windows_req_s"]) >= 3, row     # windows added until 3 completed
        lo, hi = row["req_s_ci"]
        assert lo - 1e-9 <= row["req_s"] <= hi + 1e-9, row       # the mean inside its bootstrap interval
        assert row["tok_s"] == pytest.approx(row["req_s"] * run["output_tokens"]), row
        assert 0 < row["first_chunk_p50_s"] <= row["e2e_p50_s"], row
        if row["arm"] == "reuse":           # the ratio to the recompute arm, with its bootstrap interval
            lo, hi = row["ratio_req_s_ci"]     # (no upper end where a resampled recompute arm completed nothing)
            assert lo - 1e-9 <= row["ratio_req_s"] <= (float("inf") if hi is None else hi + 1e-9), row
    # the disk check's estimate of the store's bytes for the length's document set, on every row of that length
    assert len({row["store_bytes_estimate"] for row in run["rows"]}) == 1 and run["rows"][0]["store_bytes_estimate"] > 0
    assert "| 512 | 2 | reuse |" in r.stdout                 # the results table
