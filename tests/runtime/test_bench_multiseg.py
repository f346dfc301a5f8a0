"""bench/multiseg.py's --grid (the sweep's values per key): parsed for both call kinds, and a bad grid or --policy
refused with its message before any work (the benchmark itself needs a GPU)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def test_grid_replaces_only_the_keys_it_names():
    from bench.multiseg import sweep_grid
    assert sweep_grid(None, 8) == [[1, 2, 4, 8], [16, 32, 64], [4, 8], [1, 3]]
    assert sweep_grid(None, 64) == [[32, 64], [16, 32, 64], [4, 8], [1, 3]]
    spec = "ROWS=1,2; BLOCK_N=32 ;num_stages=2"
    assert sweep_grid(spec, 8) == [[1, 2], [32], [4, 8], [2]]
    assert sweep_grid(spec, 64) == [[32, 64], [32], [4, 8], [2]]      # ROWS is for calls of few heads only


@pytest.mark.parametrize("grid,message", [("FOO=1", "unknown key 'FOO'"), ("ROWS=a", "is not KEY=int"),
                                          ("ROWS=", "needs positive values"), ("BLOCK_N=0", "needs positive values"),
                                          (None, "--policy: ")])
def test_bad_grid_or_policy_is_refused_before_any_work(grid, message):
    flags = ["--grid", grid] if grid else ["--policy", "key_frame_min_segments=2"]      # not a field
    r = subprocess.run([sys.executable, "bench/multiseg.py", *flags], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1 and message in r.stderr, r.stderr[-500:]
