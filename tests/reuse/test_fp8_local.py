"""The Local contribution stored in FP8 (`ReuseProfile.local_format = "fp8"`): the format's own error bound, a reuse
over FP8 artifacts equal bit for bit to a reuse over native artifacts holding the dequantized values (so the only
approximation is the storage rounding), that rounding measured against the native restore, and the store's round
trip of codes and scales."""
import pytest
import torch

import runtime.kernels.fp8_rows as fp8_rows
import runtime.reuse.deepseek as engine
from runtime.model.config import tiny_reuse
from runtime.model.quant import FP8_MAX, FP8_ROW_BLOCK, dequant_fp8_rows, e8m0_to_float, quant_fp8_rows
from runtime.reuse.artifact import DocumentArtifact
from runtime.reuse.engine import ReuseEngine
from runtime.reuse.packing import map_layer, owned_copies
from runtime.reuse.producer import produce
from runtime.reuse.profile import FLASH_PROFILE, PRO_PROFILE, ProfileError, ReuseProfile
from runtime.reuse.store import load_artifact, save_artifact

from .test_reuse_exactness import model, rel_err, request_tokens  # noqa: F401  (the exactness tests' model and request)

CFG = tiny_reuse()
BASE = dict(first_fences=2, last_fences=2, align=16, budget=0.25, recent_rows=16, join_rows=8)


@pytest.fixture(scope="module")
def artifacts(model, request_tokens):
    docs, _ = request_tokens
    return {fmt: [produce(model, t, ReuseProfile(**BASE, local_format=fmt)) for t in docs] for fmt in ("native", "fp8")}


def dequantized(art: DocumentArtifact, dtype=torch.float32) -> DocumentArtifact:
    """`art` in the native format holding its FP8 Local contribution's dequantized values."""
    layers = []
    for la in art.layers:
        out = map_layer(la, lambda t: t)
        if la.local_s is not None:
            out.local_p, out.local_s = dequant_fp8_rows(la.local_p, la.local_s, dtype), None
        layers.append(out)
    return DocumentArtifact(art.tokens, art.n_content, layers, art.tp_rank, art.tp_size, dict(art.meta))


def test_row_block_quantization_keeps_e4m3s_bound_and_round_trips():
    """Scales cover each block's amax (no code saturates); every value is within e4m3's half step: 2^-4 of itself
    for normals, 2^-10 of its block's scale for subnormals; quantizing the dequantized values gives them back."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 200, generator=g) * torch.logspace(-6, 4, 300)[:, None]
    x[7] = 0.0
    codes, scales = quant_fp8_rows(x, chunk=64)
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.uint8
    assert scales.shape == (300, -(-200 // FP8_ROW_BLOCK))
    assert codes.float().abs().max() <= FP8_MAX and not torch.isnan(codes.float()).any()
    dq = dequant_fp8_rows(codes, scales, torch.float32)
    s = e8m0_to_float(scales).repeat_interleave(FP8_ROW_BLOCK, dim=1)[:, :200]
    err = (dq - x).abs()
    assert (err <= torch.maximum(x.abs() * 2.0 ** -4, s * 2.0 ** -10)).all()
    assert torch.equal(dq[7], torch.zeros(200)) and err.max() > 0
    assert torch.equal(dequant_fp8_rows(*quant_fp8_rows(dq), torch.float32), dq)
    assert torch.equal(dequant_fp8_rows(codes, scales, torch.bfloat16).float(), dq)    # exact in bf16 too


def test_profile_refuses_an_unknown_local_format_and_the_presets_store_fp8():
    with pytest.raises(ProfileError, match="local_format"):
        ReuseProfile(local_format="fp4")
    assert ReuseProfile().local_format == "native"
    assert FLASH_PROFILE.local_format == PRO_PROFILE.local_format == "fp8"


def test_fp8_artifacts_hold_half_the_local_bytes_of_bf16(artifacts):
    native, fp8 = artifacts["native"][1], artifacts["fp8"][1]
    for a, b in zip(native.layers, fp8.layers):
        assert (a.local_p is None) == (b.local_p is None) and a.local_s is None
        if b.local_p is not None:
            C = a.local_p.shape[1]
            assert b.local_p.dtype == torch.float8_e4m3fn and b.local_p.shape == a.local_p.shape
            assert b.local_s.shape == (a.local_p.shape[0], -(-C // FP8_ROW_BLOCK))
            assert torch.equal(b.latent, a.latent)                 # nothing else changes
    assert any(la.local_s is not None for la in fp8.layers)


@torch.no_grad()
def test_reuse_over_fp8_equals_reuse_over_the_dequantized_values(model, request_tokens, artifacts, monkeypatch):
    """The restore dequantizes exactly (power-of-two scales): a reuse over FP8 artifacts equals, bit for bit, a reuse
    over native artifacts holding the dequantized values, document by document and through one staged buffer
    (`owned_copies`: one gather-dequantize for all documents), and really went through the FP8 restore."""
    _, question = request_tokens
    prof = ReuseProfile(**BASE, local_format="fp8")
    calls = []
    real = fp8_rows.gather_dequant_rows
    monkeypatch.setattr(engine, "gather_dequant_rows", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    want = ReuseEngine(model, prof).prefill([dequantized(a) for a in artifacts["fp8"]], question)
    assert not calls
    got = ReuseEngine(model, prof).prefill(artifacts["fp8"], question)
    assert torch.equal(got.logits, want.logits)
    n_docs_restored = len(calls)
    assert n_docs_restored >= len(prof.reusable_layers(CFG)) * 2     # one per relocated document and layer
    calls.clear()
    one = ReuseEngine(model, prof).prefill(owned_copies(artifacts["fp8"]), question)
    assert torch.equal(one.logits, want.logits)
    assert len(calls) == len(prof.reusable_layers(CFG))             # one launch per layer for all documents


@torch.no_grad()
def test_fp8_storage_deviation_is_active_and_small_beside_reuse_own(model, request_tokens, artifacts):
    """What FP8 storage costs, measured: the logits move (the approximation is active) by far less than reuse itself
    moves them from full recomputation (tiny model: about 1e-3 against 0.2 relative, KL 7e-7 against 0.03)."""
    docs, question = request_tokens
    prof = ReuseProfile(**BASE)
    native = ReuseEngine(model, prof).prefill(artifacts["native"], question).logits
    fp8 = ReuseEngine(model, prof.replace(local_format="fp8")).prefill(artifacts["fp8"], question).logits
    full = model(torch.tensor([t for a in artifacts["native"] for t in a.tokens] + question))
    storage, reuse = rel_err(fp8, native), rel_err(native, full)
    print(f"fp8 storage: logit rel err {storage:.2e} (reuse itself {reuse:.2e})")
    assert 0 < storage < 0.02 * reuse, (storage, reuse)
    kl = torch.nn.functional.kl_div(fp8.log_softmax(-1), native.log_softmax(-1), log_target=True, reduction="sum")
    kl_reuse = torch.nn.functional.kl_div(native.log_softmax(-1), full.log_softmax(-1), log_target=True,
                                          reduction="sum")
    print(f"fp8 storage: KL {kl.item():.2e} (reuse itself {kl_reuse.item():.2e})")
    assert 0 < kl < 1e-3 * kl_reuse, (kl.item(), kl_reuse.item())


def test_store_round_trips_codes_and_scales_and_checks_their_shape(tmp_path, artifacts):
    from runtime.reuse.certificate import token_hash
    art = artifacts["fp8"][0]
    prof = ReuseProfile(**BASE, local_format="fp8")
    C = next(la.local_p.shape[1] for la in art.layers if la.local_p is not None)
    fields = dict(fingerprint="fp", token_hash=token_hash(art.tokens, "tok"), profile=prof, channel_range=(0, C),
                  dtype="float32", producer_version="v", generation=1)
    save_artifact(art, tmp_path / "a", fields)
    got, verdict = load_artifact(tmp_path / "a", dict(fingerprint="fp", tokens_hash=token_hash(art.tokens, "tok"),
                                             profile=prof.to_dict(), tp_size=1, tp_rank=0, channel_range=(0, C),
                                             layers_needed=set(range(CFG.n_layers)), current_generation=1,
                                             dtype="float32", producer_version="v"))
    assert verdict.ok, verdict
    for a, b in zip(art.layers, got.layers):
        assert (a.local_s is None) == (b.local_s is None)
        if a.local_s is not None:
            assert torch.equal(a.local_s, b.local_s) and b.local_p.dtype == torch.float8_e4m3fn
            assert torch.equal(a.local_p.view(torch.uint8), b.local_p.view(torch.uint8))
    bad = DocumentArtifact(art.tokens, art.n_content, [map_layer(la, lambda t: t) for la in art.layers], 0, 1,
                           dict(art.meta))
    i = next(i for i, la in enumerate(bad.layers) if la.local_s is not None)
    bad.layers[i].local_s = bad.layers[i].local_s[:, :-1] if bad.layers[i].local_s.shape[1] > 1 else \
        bad.layers[i].local_s[:-1]
    with pytest.raises(ValueError, match="local_s"):
        save_artifact(bad, tmp_path / "b", fields)
    assert not (tmp_path / "b" / "certificate.msgpack").exists()


def test_bench_fp8_local_small_measures_cost_and_bytes(tmp_path):
    """bench/fp8_local.py stays runnable (its --small CPU run, not a measurement): FP8 storage moves the logits,
    by a small share of the reuse arm's own deviation, and the Local tensors take a byte per channel plus a scale
    per 128 channels."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "fp8.json"
    r = subprocess.run([sys.executable, "bench/fp8_local.py", "--small", "--json", str(out)], cwd=root,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert 0 < row["kl_storage_mean"] < 0.1 * row["kl_reuse_mean"] and row["rel_err_median"] > 0
    native, fp8 = row["bytes_tp1"]["native"], row["bytes_tp1"]["fp8"]
    assert native["local_s"] == 0 and fp8["local_p"] * 4 == native["local_p"]       # float32 on CPU
    assert fp8["local_s"] == fp8["local_p"] / FP8_ROW_BLOCK
    assert row["bytes_tp8_rank"]["fp8"]["local_p"] * 8 == fp8["local_p"] and fp8["latent"] == native["latent"]
