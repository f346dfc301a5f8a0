"""Every Triton kernel (fused multi-segment, one-row, key-frame (one row or several) and packed; the stacked per-
segment part, the stacked parts in one launch, and their merge; the N-way merge, the indexer's scores (one key set,
every segment's), the three mHC kernels, the mixing one with both its dots, the post one with and without row maps;
the RoPE slice, also over listed rows; the RMS norm) compiles for the H200 (sm_90) on this CPU-only machine, with
the 16-byte alignment of pointer arguments Triton assumes at a launch: tests/kernels/compile_sm90.py in its own
process (no TRITON_INTERPRET). The interpreter tests check the kernels' logic; this checks what only the compiler
sees, so a kernel change made without a GPU does not first break on the device, nor read its key tiles two bytes at
a time."""
import os
import subprocess
import sys

import pytest

from runtime.kernels._triton import HAVE_TRITON

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_sm90.py")


@pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton")
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    print(run.stdout, run.stderr)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("cubin") == 47, run.stdout       # 11 attention configurations x 3 modes + 14 kernels
    # the kernels reading keys at a table's addresses (fused, stacked parts in one launch, the indexer over every
    # segment: 25 configurations) read them 16 bytes at a time, as the per-part launches do (the script fails any
    # that does not: the table's alignment not told to the compiler)
    wide = [line for line in run.stdout.splitlines()
            if line.startswith(("fused", "stacked parts in one launch", "indexer scores over every segment"))]
    assert len(wide) == 25 and all(not line.endswith("16-byte reads 0") for line in wide), wide
