"""`make demo` runs `redknot demo`: on a machine with nothing configured it starts its own redis-server, the
store, the API, the builder and a TP=2 worker, builds the bundled documents, runs both arms, prints the table and
stops every service cleanly. Small sizes; a fresh work directory (so the demo checkpoint is built too)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_make_demo_runs_the_whole_service_and_stops_cleanly(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}      # nothing configured: its own Redis
    env.update(PYTHONUNBUFFERED="1", COLUMNS="140")
    p = subprocess.run([sys.executable, "-m", "services.cli", "demo", "--workdir", str(tmp_path), "--repeat", "1",
                        "--requests", "1", "--new-tokens", "2"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=540)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-5000:]
    for row in ("TTFT recompute arm", "TTFT reuse arm", "1. logical head-row saving", "2. physical token-row",
                "3. analytic FLOP saving", "4. measured TTFT ratio", "fallbacks by reason"):
        assert row in out, (row, out[-5000:])
    assert "ran: reuse" in out and "/metrics of worker: http://127.0.0.1:" in out
    assert "stopped: api exit 0, worker exit 0, builder exit 0, store exit 0, redis exit 0" in out
    assert not (tmp_path / "run" / "tier").exists() or not any((tmp_path / "run" / "tier").rglob("*.partial"))
