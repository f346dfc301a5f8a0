"""bench/serve_ttft.py stays runnable: its --small CPU run (not a measurement) starts the real stack as separate
processes on a random-init checkpoint, uploads and builds documents through the API, and times every case through
`POST /v1/generate`. The script stops on any reuse request that fell back; here its JSON is checked. The documents
are built with the Local contribution in FP8 (the builder quantizes, the store keeps codes and scales, the worker
dequantizes in the restore); the native format is what every other service test serves."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_serve_ttft_small_runs_every_case_through_the_http_api_without_a_fallback(tmp_path):
    out = tmp_path / "serve.json"
    r = subprocess.run([sys.executable, "bench/serve_ttft.py", "--small", "--workdir", str(tmp_path / "work"),
                        "--local-format", "fp8", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["device"] == "cpu" and run["small"] and all(c == 0 for c in run["exit_codes"].values())
    assert run["profile"]["local_format"] == "fp8"
    (row,) = run["rows"]
    assert row["docs"] == 2 and row["tokens"] == 512 + run["question_tokens"]
    for case in ("recompute", "hot", "empty"):
        assert len(row[case]["reps_client_s"]) == 2 and row[case]["client_s"] >= row[case]["server_ttft_s"] > 0
    assert row["cold"]["client_s"] > row["cold"]["build_s"] > 0
    assert row["speedup_hot"] > 0 and row["speedup_empty"] > 0
    assert row["ledger"]["rows"]["active"] > 0 and row["ledger"]["rows"]["relocated"] > 0
    assert run["tier_bytes"] > 0 and row["store_bytes"] > 0           # the hot case's documents were in the tier
    # the disk check's estimate is what the store holds, to its files' headers
    assert 0 < row["store_bytes"] - row["store_bytes_estimate"] < 0.05 * row["store_bytes"]
    # the tier-empty fetches went through the store's local socket straight into slabs (the heads alone as bytes)
    assert run["empty_placed_share"] > 0.9
    assert f"| {row['tokens']} | 2 | " in r.stdout             # the results table


def test_a_run_whose_documents_do_not_fit_the_disk_stops_before_any_service_starts(tmp_path):
    """128 documents of 2^22 tokens at Flash dimensions need tens of TB: the run stops at once with the sizes and
    what to change, and starts nothing (the work folder is not even created)."""
    work = tmp_path / "work"
    r = subprocess.run([sys.executable, "bench/serve_ttft.py", "--lengths", str(1 << 29), "--docs", "128",
                        "--device", "cpu", "--workdir", str(work)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "need" in r.stderr and "GiB are free" in r.stderr and "--workdir" in r.stderr
    assert not work.exists()
