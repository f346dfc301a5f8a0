"""grouped_projection (W_a per group as one batched GEMM over strided views, result written in place) equals the
einsum form it replaced; with `out` it adds the products to out (the reuse consumer's restored W_a,L O_L) in the
same GEMM; the consumer's gather_rows places every part's rows; bench/projection.py stays runnable."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.model.deepseek_v4 import grouped_projection
from runtime.reuse.views import gather_rows

ROOT = Path(__file__).resolve().parents[2]


def _einsum(o, w):
    return torch.einsum("tgi,gri->tgr", o, w).reshape(o.shape[0], w.shape[0] * w.shape[1])


@pytest.mark.parametrize("T", [0, 1, 37])
def test_grouped_projection_equals_einsum(T):
    g = torch.Generator().manual_seed(T)
    o, w = torch.randn(T, 3, 20, generator=g), torch.randn(3, 12, 20, generator=g)
    got = grouped_projection(o, w)
    assert got.shape == (T, 36) and got.is_contiguous()
    torch.testing.assert_close(got, _einsum(o, w), rtol=1e-6, atol=1e-6)
    base = torch.randn(T, 36, generator=g)
    acc = base.clone()
    assert grouped_projection(o, w, acc) is acc
    torch.testing.assert_close(acc, base + _einsum(o, w), rtol=1e-6, atol=1e-5)


def test_grouped_projection_strided_weight_view():
    """The consumer passes the Global heads' columns as a strided view of W_a (no copy of the weight)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(4, 8, 3, 16, generator=g)                  # [G, R, heads per group, D]
    view = w[:, :, :1].reshape(4, 8, 16)
    assert view.data_ptr() == w.data_ptr() and not view.is_contiguous()
    o = torch.randn(9, 4, 16, generator=g)
    torch.testing.assert_close(grouped_projection(o, view), _einsum(o, view.contiguous()), rtol=1e-6, atol=1e-6)


def test_grouped_projection_refuses_a_strided_out():
    o, w = torch.randn(5, 2, 4), torch.randn(2, 3, 4)
    out = torch.zeros(5, 12)[:, ::2]
    with pytest.raises(AssertionError):
        grouped_projection(o, w, out)


def test_gather_rows_places_every_part():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(10, 4, generator=g), torch.randn(6, 4, generator=g)
    ia, ib = torch.tensor([0, 3, 9]), torch.tensor([1, 2, 5, 4])
    got = gather_rows([(a, ia, 0), (b.double(), ib, 3)], 7, 4, torch.float32, "cpu")   # the second part converted
    assert torch.equal(got, torch.cat([a[ia], b[ib]]))
    with pytest.raises(ValueError, match="must tile rows 0..7 exactly"):          # a row left unwritten
        gather_rows([(a, ia, 0), (b, ib, 3)], 8, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="must tile"):                            # rows written twice
        gather_rows([(a, ia, 0), (b, ib, 2)], 6, 4, torch.float32, "cpu")


def test_projection_bench_cpu_smoke(tmp_path):
    out = tmp_path / "p.json"
    subprocess.run([sys.executable, "bench/projection.py", "--small", "--rows", "64,96", "--reps", "1", "--json",
                    str(out)], cwd=ROOT, check=True, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [r["rows"] for r in rows] == [64, 96]
    for r in rows:
        assert r["all_heads_max_abs_diff"] == 0.0 and r["rest_rows"] > 0
        # one rounding of the sum instead of two: never further from float64 than the previous form, and close
        assert r["restore_rel_err_after"] <= r["restore_rel_err_before"] + 1e-9 and r["restore_rel_err_after"] < 1e-2


def test_projection_bench_refuses_bad_rest():
    r = subprocess.run([sys.executable, "bench/projection.py", "--small", "--rest", "0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--rest in (0, 1]" in r.stderr
