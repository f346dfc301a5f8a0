"""runtime.kernels.f32linear on CPU: the three bf16 pieces of a float32 weight sum back to it exactly (so the split
GEMM's products are exact), and bad input is refused with a clear error. The GEMM itself runs on CUDA only
(torch.mm with out_dtype): tests/kernels/test_f32linear_gpu.py."""
import pytest
import torch

from runtime.kernels.f32linear import linear_f32, split3, stacked_pieces, supported


def test_pieces_sum_back_exactly():
    g = torch.Generator().manual_seed(0)
    w = torch.cat([torch.randn(64, 256, generator=g) * s for s in (1e-3, 1.0, 1e3)])
    w[0, :4] = torch.tensor([0.0, -0.0, 1.0, 3.0e-30])
    p = split3(w)
    assert p.dtype == torch.bfloat16 and p.shape == (3, *w.shape)
    assert torch.equal((p[0].float() + p[1].float()) + p[2].float(), w)
    assert (p[2].float().abs() <= p[1].float().abs() * 2 ** -7 + 1e-38).all()   # each piece below the last's ulp
    assert (p[1].float().abs() <= p[0].float().abs() * 2 ** -7 + 1e-38).all()


def test_refuses_what_it_cannot_run():
    x = torch.randn(4, 64).bfloat16()
    w = torch.randn(8, 64)
    assert not supported(x, w)                                        # CPU
    with pytest.raises(ValueError, match="bf16 x \\[T, K\\] and float32 weights"):
        linear_f32(x, w)
    assert not supported(x.float(), w) and not supported(x, w.bfloat16()) and not supported(x, torch.randn(8, 32))


def test_stacked_pieces_are_split_once_and_again_after_a_weight_changes():
    g = torch.Generator().manual_seed(1)
    wkv = torch.nn.Parameter(torch.randn(16, 64, generator=g))
    wgate = torch.nn.Parameter(torch.randn(8, 64, generator=g))
    p = stacked_pieces(wkv, wgate)
    assert p.shape == (3 * 24, 64) and p.dtype == torch.bfloat16
    want = torch.cat([split3(wkv.detach()), split3(wgate.detach())], dim=1).flatten(0, 1)
    assert torch.equal(p, want)
    assert stacked_pieces(wkv, wgate) is p                            # kept: no second split
    assert not torch.equal(stacked_pieces(wgate, wkv), p)             # other weights (or order): their own pieces
    with torch.no_grad():
        wgate[0, 0] += 1.0                                            # an in-place change, as loading a checkpoint
    q = stacked_pieces(wkv, wgate)
    assert q is not p and torch.equal(q, torch.cat([split3(wkv.detach()), split3(wgate.detach())], 1).flatten(0, 1))


@pytest.mark.parametrize("rows", [16, 64])
def test_sums_of_the_pieces_are_assembled_for_every_weight_at_once(rows, monkeypatch):
    """_linear_f32's assembly (every weight's (lo + mid) + hi in two launches, the outputs column views of one
    buffer), run on CPU with the GEMM stood in by a float32 mm (CUDA's out_dtype GEMM has no CPU kernel): each
    output equals the same sum taken weight by weight, in row chunks, bit for bit."""
    from runtime.kernels.f32linear import _linear_f32
    g = torch.Generator().manual_seed(2)
    x = torch.randn(50, 64, generator=g).bfloat16()
    ws = (torch.randn(24, 64, generator=g), torch.randn(40, 64, generator=g))
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b, out_dtype=None: real_mm(a.float(), b.float()))
    got = _linear_f32(x, ws, rows)
    y = torch.cat([real_mm(x[a:a + rows].float(), stacked_pieces(*ws).float().t()) for a in range(0, 50, rows)])
    S, c = 64, 0
    for out, w in zip(got, ws):
        n = w.shape[0]
        assert out.shape == (50, n) and out.dtype == torch.float32
        assert torch.equal(out, (y[:, 2 * S + c:2 * S + c + n] + y[:, S + c:S + c + n]) + y[:, c:c + n])
        c += n
    assert torch.allclose(got[0], x.float() @ ws[0].t(), rtol=1e-2, atol=1e-2)    # and it is x @ w^T
