"""shared_angles: within one reuse prefill, the RoPE angles of a registered position tensor are computed once per
set of inverse frequencies and are bitwise the angles computed without the scope."""
import torch

from runtime.model.config import tiny_reuse
from runtime.model.deepseek_v4 import (Rotary, Transformer, share_positions, shared_angles, shared_arange,
                                       yarn_inv_freq)


def _rotaries():
    cfg = tiny_reuse()
    m = Transformer(cfg)
    kinds = [cfg.layer_kind(i) for i in range(cfg.n_layers)]
    compressed = [m.layers[i].attn.rotary for i, k in enumerate(kinds) if k != "window"]
    window = [m.layers[i].attn.rotary for i, k in enumerate(kinds) if k == "window"]
    return compressed, window


def test_registered_positions_get_their_angles_once_per_frequency_set(monkeypatch):
    (c1, c2, *_), (w1, *_) = _rotaries()
    assert c1 is not c2 and torch.equal(c1.inv_freq, c2.inv_freq) and not torch.equal(c1.inv_freq, w1.inv_freq)
    calls = []
    real = Rotary._cos_sin
    monkeypatch.setattr(Rotary, "_cos_sin", lambda self, p: (calls.append(id(p)), real(self, p))[1])
    pos = torch.tensor([3, 7, 100, 4096])
    ref_c, ref_w = real(c1, pos), real(w1, pos)
    with shared_angles():
        share_positions(pos)
        a, b, w = c1.cos_sin(pos), c2.cos_sin(pos), w1.cos_sin(pos)
        assert a[0] is b[0] and a[1] is b[1]                      # one computation for equal frequencies
        assert w[0] is not a[0] and c1.cos_sin(pos)[0] is a[0]    # another for other frequencies, then kept
        assert len(calls) == 2
        for got, ref in ((a, ref_c), (w, ref_w)):
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        other = pos.clone()                                       # equal values, not registered: computed again
        assert torch.equal(c1.cos_sin(other)[0], ref_c[0]) and len(calls) == 3
        pos.add_(1)                                               # changed in place: its angles are made again
        assert torch.equal(c1.cos_sin(pos)[0], real(c1, pos)[0]) and c1.cos_sin(pos)[0] is not a[0]
    calls.clear()
    c1.cos_sin(pos), c1.cos_sin(pos)                              # outside a scope nothing is kept
    assert len(calls) == 2


def test_shared_arange_is_arange_and_one_tensor_per_range_in_a_scope():
    assert torch.equal(shared_arange(4, 20, 4), torch.arange(4, 20, 4))
    assert shared_arange(0, 5) is not shared_arange(0, 5)
    with shared_angles():
        a = shared_arange(8, 40, 4)
        assert torch.equal(a, torch.arange(8, 40, 4)) and a.dtype == torch.int64
        assert shared_arange(8, 40, 4) is a and shared_arange(8, 40, 8) is not a
        r = Rotary(yarn_inv_freq(8, 10000.0, 1.0, 0, 32, 1))
        assert r.cos_sin(a)[0] is r.cos_sin(shared_arange(8, 40, 4))[0]
    with shared_angles():                                         # a new scope keeps nothing of the last one
        assert shared_arange(8, 40, 4) is not a


def test_inference_tensors_are_shared_too():
    r = Rotary(yarn_inv_freq(8, 10000.0, 1.0, 0, 32, 1))
    with torch.inference_mode(), shared_angles():
        pos = shared_arange(0, 16)
        assert pos.is_inference() and r.cos_sin(pos)[1] is r.cos_sin(pos)[1]
