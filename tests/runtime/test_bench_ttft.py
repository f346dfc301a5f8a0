"""bench/ttft.py stays runnable: a CPU smoke run at tiny dims (not a measurement) writes one row per length
with every budget's reuse arm, each of which really reused (the script asserts it; here the JSON is checked)."""
import json
import subprocess
import sys
import threading
from pathlib import Path

from runtime.reuse.profile import FLASH_PROFILE

ROOT = Path(__file__).resolve().parents[2]


def test_ttft_cpu_smoke_run_with_a_second_budget_and_the_cold_arm(tmp_path):
    out = tmp_path / "ttft.json"
    r = subprocess.run([sys.executable, "bench/ttft.py", "--small", "--device", "cpu", "--layers", "8", "--experts", "8",
                    "--lengths", "1024", "--cold-at", "1024", "--reps", "1", "--warmup", "2", "--extra-budgets", "0.1",
                    "--policy", "fused_min_heads=4", "--policy", "moe_grouped_slots=0",
                    "--hostprof-at", "1024", "--prefill-chunk", "256", "--json",
                    str(out)], cwd=ROOT, check=True, capture_output=True, text=True, timeout=600)
    run = json.loads(out.read_text())
    # --hostprof-at: one reuse prefill under cProfile, our functions by their own time and with callees
    prof = r.stdout[r.stdout.index("## host profile of one reuse prefill at 1024"):]
    assert "Ordered by: internal time" in prof and "Ordered by: cumulative time" in prof
    assert "runtime/reuse/deepseek.py" in prof and "(_reusable_layer)" in prof
    assert run["device"] == "cpu"             # the arms timed beside the run's own do not rename the device
    # with no --global-picks the run times what the flash preset serves (its Global rows' picks, online)
    assert run["profile"]["global_picks"] == FLASH_PROFILE.global_picks == "online"
    assert run["args"]["prefill_chunk"] == 256                  # the recompute arm as a chunked prefill
    (row,) = run["rows"]
    assert row["budget"] == 0.25 and row["cold_s"] > 0 and row["recompute_s"] > 0
    (extra,) = row["extra"]
    assert extra["budget"] == 0.1 and 0 < extra["active"] < row["active"] < row["relocated"]
    assert extra["flop_ratio"] > row["flop_ratio"] > 1          # a smaller budget skips more work
    assert len(row["reuse_all"]) == len(extra["reuse_all"]) == len(row["policy_all"]) == 1 and row["policy_s"] > 0
    assert row["policy"] == {"fused_min_heads": 4, "moe_grouped_slots": 0}     # the fields the other arm changed
    # --warmup 2: two untimed runs of each arm, each one's time kept
    assert [len(row["warmup_s"][a]) for a in ("recompute", "reuse")] == [2, 2] and min(row["warmup_s"]["reuse"]) > 0
    assert "warm-up runs: recompute" in r.stdout
    assert row["staged_loose"] == 0 and set(row["allocator"]) >= {"num_alloc_retries", "num_sync_all_streams"}


def test_plot_from_earlier_runs_takes_the_cold_arm_from_another_run(tmp_path):
    """The committed H200 runs redraw the plot (matplotlib from the bench extra; without it the script says how to
    get it and still exits 0)."""
    out = tmp_path / "ttft.png"
    r = subprocess.run([sys.executable, "bench/ttft.py", "--plot-from", "bench/results/ttft_h200_run14_16k_32k.json",
                        "bench/results/ttft_h200_run14_64k.json", "--cold-from", "bench/results/ttft_h200_run13_64k.json", "--plot",
                        str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-1000:]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no plot: matplotlib is not installed" in r.stdout and not out.exists()
    else:
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ttft_refuses_a_budget_outside_0_1():
    r = subprocess.run([sys.executable, "bench/ttft.py", "--small", "--device", "cpu", "--extra-budgets", "1.5"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--extra-budgets must lie in (0, 1]" in r.stderr


def test_ttft_and_ttft_tp_refuse_fewer_than_one_warm_up_run():
    """--warmup counts untimed runs that must happen (the first compiles): 0, negative or not a number is refused
    by argparse before any model is built, in both scripts (they share the option)."""
    for script in ("bench/ttft.py", "bench/ttft_tp.py"):
        for bad in ("0", "-1", "two"):
            r = subprocess.run([sys.executable, script, "--small", "--device", "cpu", "--warmup", bad],
                               cwd=ROOT, capture_output=True, text=True, timeout=120)
            assert r.returncode == 2 and "--warmup: must be an integer >= 1" in r.stderr, (script, bad, r.stderr)


def test_ttft_refuses_a_length_shorter_than_one_block_per_document():
    r = subprocess.run([sys.executable, "bench/ttft.py", "--small", "--device", "cpu", "--lengths", "512",
                        "--cold-at", "0"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "length 512 leaves 8 documents under 128 tokens each" in r.stderr, r.stderr[-500:]


def test_ttft_refuses_an_unknown_policy_field_before_any_work():
    r = subprocess.run([sys.executable, "bench/ttft.py", "--small", "--device", "cpu", "--policy", "fused=1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "policy item 'fused=1' must be key=value with key one of" in r.stderr, r.stderr


def test_a_run_stopped_after_its_first_row_keeps_that_row(tmp_path):
    """Device runs are cut by time limits: after each row but the last the JSON holds every finished row, marked
    partial, so a stopped run still reports them; the finished run's record is whole (no mark)."""
    out = tmp_path / "ttft.json"
    cmd = [sys.executable, "bench/ttft.py", "--small", "--device", "cpu", "--layers", "8", "--experts", "8",
           "--lengths", "512", "--docs", "2,3", "--reps", "1", "--warmup", "1", "--json", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    guard = threading.Timer(600, proc.kill)      # bounded: a run that hangs is killed, and the asserts fail
    guard.start()
    try:
        for line in proc.stdout:
            if line.startswith("T="):
                proc.kill()
                break
    finally:
        guard.cancel()
        proc.kill()
        proc.wait(timeout=60)
    run = json.loads(out.read_text())
    assert run["partial"] is True and [r["docs"] for r in run["rows"]] == [2]
    assert run["rows"][0]["recompute_s"] > 0 and run["rows"][0]["reuse_s"] > 0
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=600)
    run = json.loads(out.read_text())
    assert "partial" not in run and [r["docs"] for r in run["rows"]] == [2, 3]
