"""Checkpoints: the official tensor table, round trips through the official layout (quantized and not) and
through what transformers' save_pretrained writes, partial reads for tensor-parallel ranks, and one test
per refusal, each checking that the message names the file and the tensor."""
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from runtime.model import checkpoint as ckpt
from runtime.model import config as C
from runtime.model.checkpoint import (
    BOS_TOKEN, EOS_TOKEN, CheckpointError, build_demo_tokenizer, expected_shapes, load_tokenizer, random_state,
    read_checkpoint, write_official_checkpoint,
)
from tests.runtime.hf_oracle import (
    hf_config_for, hf_model_from_state, hf_module_state, official_from_hf_module_state,
)

CFG = C.tiny(n_layers=3)  # layer 0 window only, 1 CSA (+ indexer), 2 HCA; hash routing in all three
INDEX = "model.safetensors.index.json"


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    return torch.equal(a, b)


def assert_state_equal(got: dict, want: dict):
    assert list(got) == list(want)
    bad = [k for k in want if not bits_equal(got[k], want[k])]
    assert not bad, f"{len(bad)} tensors differ, first {bad[:3]}"


def refused(fn, *fragments: str) -> str:
    with pytest.raises(CheckpointError) as e:
        fn()
    msg = str(e.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    return msg


def shard_of(root: Path, name: str) -> str:
    return json.loads((root / INDEX).read_text())["weight_map"][name]


def edit_shard(root: Path, fname: str, edit) -> None:
    """Rewrite one shard with edit(tensors) applied, and point the index at what it now holds."""
    tensors = load_file(str(root / fname))
    edit(tensors)
    save_file(tensors, str(root / fname))
    index = json.loads((root / INDEX).read_text())
    wm = {k: v for k, v in index["weight_map"].items() if v != fname}
    wm.update({k: fname for k in tensors})
    index["weight_map"] = wm
    (root / INDEX).write_text(json.dumps(index))


@pytest.fixture(scope="module")
def exact_state():
    return random_state(CFG, seed=7, exact_quant=True)


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory, exact_state):
    root = tmp_path_factory.mktemp("quantized")
    write_official_checkpoint(root, CFG, exact_state, quantize=True)
    return root


@pytest.fixture
def broken(quantized_dir, tmp_path):
    """A private copy of the quantized checkpoint for a test to damage."""
    root = tmp_path / "ckpt"
    shutil.copytree(quantized_dir, root)
    return root


# ---------------------------------------------------------------- the table


def test_expected_shapes_reproduce_the_flash_index():
    """Summed over the table, storage bytes and tensor count (weights + scales) equal V4-Flash's index
    (total_size 159,609,485,896 B and 69,187 tensors) minus its MTP shard (3,593,787,756 B, 1,575 tensors)."""
    total, count = 0, 0
    for name, (shape, kind) in expected_shapes(C.FLASH).items():
        n = math.prod(shape)
        if kind == "fp8":
            total += n + math.ceil(shape[0] / 128) * math.ceil(shape[1] / 128)
            count += 2
        elif kind == "fp4":
            total += n // 2 + shape[0] * shape[1] // 32
            count += 2
        else:
            total += {"bf16": 2, "f32": 4, "i64": 8}[kind] * n
            count += 1
    assert total == 159_609_485_896 - 3_593_787_756
    assert count == 69_187 - 1_575


def test_expected_shapes_follow_layer_kinds():
    ex = expected_shapes(CFG)
    assert all(k in ("fp8", "fp4", "bf16", "f32", "i64") for _, k in ex.values())
    assert not any(n.startswith("layers.0.attn.compressor") for n in ex)
    assert ex["layers.1.attn.compressor.wkv.weight"] == ((128, 64), "bf16")  # CSA: 2 x head_dim
    assert ex["layers.1.attn.compressor.ape"] == ((4, 128), "f32")
    ih, idim = CFG.index_n_heads, CFG.index_head_dim
    assert ex["layers.1.attn.indexer.wq_b.weight"] == ((ih * idim, 32), "fp8")
    assert ex["layers.1.attn.indexer.weights_proj.weight"] == ((ih, 64), "bf16")
    assert ex["layers.1.attn.indexer.compressor.ape"] == ((4, 2 * idim), "f32")
    assert ex["layers.2.attn.compressor.ape"] == ((16, 64), "f32")  # HCA ratio 16: 1 x head_dim
    assert not any(n.startswith("layers.2.attn.indexer") for n in ex)
    assert ex["layers.0.attn.wo_a.weight"] == ((128, 128), "fp8")
    assert ex["layers.0.ffn.experts.7.w2.weight"] == ((64, 32), "fp4")
    assert ex["layers.2.ffn.gate.tid2eid"] == ((256, 3), "i64")
    five = expected_shapes(C.tiny(n_layers=5))  # n_hash_layers 3: layers 3 and 4 are scored
    assert "layers.3.ffn.gate.bias" in five and "layers.3.ffn.gate.tid2eid" not in five
    assert five["hc_head_fn"] == ((4, 256), "f32") and five["layers.4.hc_ffn_fn"] == ((24, 256), "f32")


def test_random_state_is_sane():
    s = random_state(CFG, seed=3)
    assert list(s) == list(expected_shapes(CFG))
    for name, (shape, kind) in expected_shapes(CFG).items():
        t = s[name]
        assert tuple(t.shape) == shape
        assert t.dtype == (torch.int64 if kind == "i64" else torch.float32)
    for L in range(CFG.n_layers):
        t = s[f"layers.{L}.ffn.gate.tid2eid"]
        assert t.min() >= 0 and t.max() < CFG.n_routed_experts
        assert all(len(set(row)) == CFG.n_activated_experts for row in t.tolist())
        assert torch.all(s[f"layers.{L}.attn.attn_sink"] != 0)
    assert abs(s["layers.1.attn.wq_b.weight"].std().item() - 1 / math.sqrt(CFG.q_lora_rank)) < 0.02
    assert abs(s["norm.weight"].mean().item() - 1) < 0.1
    assert s["layers.1.attn.compressor.ape"].abs().max() > 0
    assert torch.equal(s["head.weight"], random_state(CFG, seed=3)["head.weight"])  # seeded
    assert not torch.equal(s["head.weight"], random_state(CFG, seed=4)["head.weight"])


def test_exact_quant_state_is_a_fixed_point_of_storage(exact_state):
    again = {}
    for name, (_, kind) in expected_shapes(CFG).items():
        again[name] = ckpt._round_trip(exact_state[name], kind)
    assert_state_equal(again, exact_state)


# ---------------------------------------------------------------- official layout


def test_official_round_trip_unquantized(tmp_path):
    state = random_state(CFG, seed=1)
    write_official_checkpoint(tmp_path, CFG, state, quantize=False)
    assert_state_equal(read_checkpoint(tmp_path, CFG), state)
    assert_state_equal(read_checkpoint(tmp_path), state)  # config from config.json
    with safe_open(str(tmp_path / shard_of(tmp_path, "layers.0.attn.wq_a.weight")), "pt") as f:
        assert f.get_slice("layers.0.attn.wq_a.weight").get_dtype() == "F32"
        assert "layers.0.attn.wq_a.scale" not in f.keys()


def test_official_layout_shards_and_dtypes(quantized_dir):
    index = json.loads((quantized_dir / INDEX).read_text())
    wm = index["weight_map"]
    n = CFG.n_layers + 2
    assert wm["embed.weight"] == f"model-00001-of-{n:05d}.safetensors"
    assert {k for k, v in wm.items() if v == wm["embed.weight"]} == {"embed.weight"}
    for name in ("layers.0.attn.wq_a.weight", "layers.0.ffn.experts.3.w2.scale"):
        assert wm[name] == f"model-00002-of-{n:05d}.safetensors"
    assert wm["layers.2.ffn.gate.weight"] == f"model-00004-of-{n:05d}.safetensors"
    last = {k for k, v in wm.items() if v == f"model-{n:05d}-of-{n:05d}.safetensors"}
    assert last == {"norm.weight", "head.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"}
    want_dtype = {"fp8": "F8_E4M3", "fp4": "I8", "bf16": "BF16", "f32": "F32", "i64": "I64"}
    total = 0
    for fname in sorted(set(wm.values())):
        with safe_open(str(quantized_dir / fname), "pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                total += math.prod(sl.get_shape()) * f.get_tensor(k).element_size()
                if k.endswith(".scale"):
                    assert sl.get_dtype() == "F8_E8M0"
                    continue
                shape, kind = expected_shapes(CFG)[k]
                assert sl.get_dtype() == want_dtype[kind], k
                if kind == "fp4":
                    assert sl.get_shape() == [shape[0], shape[1] // 2]
                    assert f.get_slice(k[:-6] + "scale").get_shape() == [shape[0], shape[1] // 32]
                if kind == "fp8":
                    assert f.get_slice(k[:-6] + "scale").get_shape() == [math.ceil(s / 128) for s in shape]
    assert index["metadata"]["total_size"] == total
    assert C.load_config(quantized_dir) == CFG


def test_official_round_trip_quantized(quantized_dir, exact_state):
    assert_state_equal(read_checkpoint(quantized_dir, CFG), exact_state)


def test_read_casts_to_dtype_but_keeps_f32_and_i64(quantized_dir, exact_state):
    got = read_checkpoint(quantized_dir, CFG, dtype=torch.bfloat16)
    for name, (_, kind) in expected_shapes(CFG).items():
        want = exact_state[name]
        if kind in ("fp8", "fp4", "bf16"):
            want = want.to(torch.bfloat16)
        assert bits_equal(got[name], want), name


def test_single_file_with_lm_head_alias_and_mtp(quantized_dir, exact_state, tmp_path):
    tensors = {}
    for fname in sorted(set(json.loads((quantized_dir / INDEX).read_text())["weight_map"].values())):
        tensors.update(load_file(str(quantized_dir / fname)))
    tensors["lm_head.weight"] = tensors.pop("head.weight")
    tensors["mtp.0.e_proj.weight"] = torch.zeros(4, 4)  # MTP is ignored, whatever it holds
    tensors["mtp.0.e_proj.scale"] = torch.zeros(1, 1, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    shutil.copy(quantized_dir / "config.json", tmp_path)
    assert_state_equal(read_checkpoint(tmp_path, CFG), exact_state)


def test_keep_reads_only_what_it_keeps(quantized_dir, exact_state, monkeypatch):
    reads = []
    real = ckpt.safe_open

    class Spy:
        """safe_open that records which tensors' bytes are read."""

        def __init__(self, *a, **k):
            self.cm = real(*a, **k)

        def __enter__(self):
            self.h = self.cm.__enter__()
            return self

        def __exit__(self, *exc):
            return self.cm.__exit__(*exc)

        def keys(self):
            return self.h.keys()

        def get_slice(self, k):
            return self.h.get_slice(k)

        def get_tensor(self, k):
            reads.append(k)
            return self.h.get_tensor(k)

    monkeypatch.setattr(ckpt, "safe_open", Spy)
    # e.g. an expert-parallel rank holding experts 0..3 of layer 1 and nothing else
    keep = lambda n: n.startswith("layers.1.ffn.experts.") and int(n.split(".")[4]) < 4  # noqa: E731
    got = read_checkpoint(quantized_dir, CFG, keep=keep)
    want = [n for n in expected_shapes(CFG) if keep(n)]
    assert list(got) == want and len(want) == 12
    for n in want:
        assert bits_equal(got[n], exact_state[n])
    assert sorted(reads) == sorted(want + [n[:-6] + "scale" for n in want])


# ---------------------------------------------------------------- transformers layout


@pytest.fixture(scope="module")
def hf_case(tmp_path_factory):
    state = random_state(CFG, seed=11)
    model = hf_model_from_state(CFG, state)
    root = tmp_path_factory.mktemp("hf")
    model.save_pretrained(root / "f32")
    model.to(torch.bfloat16).save_pretrained(root / "bf16", max_shard_size="100KB")
    sd_bf16 = {k: v.clone() for k, v in model.state_dict().items()}
    return state, root, sd_bf16


def test_hf_module_mapping_is_exact():
    state = random_state(CFG, seed=2)
    model = hf_model_from_state(CFG, state)  # strict load: every module tensor is covered, shapes match
    sd = model.state_dict()
    assert set(hf_module_state(CFG, state)) == set(sd)
    assert_state_equal(official_from_hf_module_state(CFG, sd), state)
    up = sd["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(up[5, :CFG.moe_inter_dim], state["layers.1.ffn.experts.5.w1.weight"])
    assert torch.equal(up[5, CFG.moe_inter_dim:], state["layers.1.ffn.experts.5.w3.weight"])
    assert torch.equal(sd["model.layers.2.mlp.experts.down_proj"][6], state["layers.2.ffn.experts.6.w2.weight"])


def test_hf_save_pretrained_layout(hf_case):
    _, root, _ = hf_case
    with safe_open(str(root / "f32" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    for k in ("head.weight", "model.embed_tokens.weight", "model.norm.weight", "model.hc_head.hc_fn",
              "model.layers.0.attn.norm.weight", "model.layers.1.attn.compressor.norm.weight",
              "model.layers.1.attn.indexer.compressor.ape", "model.layers.2.ffn.experts.7.w3.weight",
              "model.layers.0.ffn.gate.tid2eid", "model.layers.0.hc_attn_fn"):
        assert k in keys, k
    assert not any("kv_norm" in k or "gate_up_proj" in k or k.startswith("lm_head") for k in keys)
    assert (root / "bf16" / INDEX).exists()


def test_hf_layout_round_trip(hf_case):
    state, root, _ = hf_case
    assert_state_equal(read_checkpoint(root / "f32", CFG), state)
    assert_state_equal(read_checkpoint(root / "f32"), state)  # config read from transformers' config.json


def test_hf_sharded_bf16_layout_matches_hf_state(hf_case):
    _, root, sd = hf_case
    got = read_checkpoint(root / "bf16", CFG)
    want = official_from_hf_module_state(CFG, sd)
    for name in expected_shapes(CFG):
        w = want[name]
        assert bits_equal(got[name], w.float() if w.is_floating_point() else w), name


@pytest.mark.parametrize("cfg", [
    CFG, C.tiny(), C.tiny(n_layers=2), C.tiny(n_layers=3, compress_ratios=(0, 0, 0)),
    C.tiny(n_layers=4, window_size=128, compress_ratios=(0, 4, 128, 4), n_hash_layers=1, index_topk=16),
    C.tiny(n_layers=3, compress_ratios=(4, 16, 4), n_hash_layers=0, score_func="sigmoid", rope_factor=4.0,
           original_seq_len=128, rope_theta=5000.0, compress_rope_theta=40000.0, norm_eps=1e-5, hc_mult=2),
    C.FLASH, C.PRO,
], ids=lambda c: f"L{c.n_layers}-{''.join(map(str, c.compress_ratios))[:12]}")
def test_config_json_of_transformers_reads_back_equal(cfg, tmp_path):
    hf_config_for(cfg).save_pretrained(tmp_path)
    assert C.load_config(tmp_path) == cfg
    assert C.from_json_dict(C.to_official_json(cfg)) == cfg


# ---------------------------------------------------------------- refusals


def test_refuses_missing_config(broken):
    (broken / "config.json").unlink()
    refused(lambda: read_checkpoint(broken, CFG), str(broken / "config.json"))


def test_refuses_config_that_disagrees_with_model(broken):
    d = json.loads((broken / "config.json").read_text())
    d["vocab_size"] = 300
    (broken / "config.json").write_text(json.dumps(d))
    refused(lambda: read_checkpoint(broken, CFG), "config.json", "vocab_size")
    # trusting config.json instead, the weights contradict it
    refused(lambda: read_checkpoint(broken), shard_of(broken, "embed.weight"), "'embed.weight'", "[300, 64]")


def test_refuses_index_naming_absent_shard(broken):
    fname = shard_of(broken, "layers.1.attn.wq_a.weight")
    (broken / fname).unlink()
    refused(lambda: read_checkpoint(broken, CFG), INDEX, fname, "layers.1.")


def test_refuses_shard_lacking_what_index_maps_to_it(broken):
    fname = shard_of(broken, "layers.0.attn.attn_sink")
    tensors = load_file(str(broken / fname))
    del tensors["layers.0.attn.attn_sink"]
    save_file(tensors, str(broken / fname))  # index left as is
    refused(lambda: read_checkpoint(broken, CFG), fname, "'layers.0.attn.attn_sink'")


def test_refuses_tensor_missing_from_every_file(broken):
    edit_shard(broken, shard_of(broken, "layers.2.attn.compressor.ape"),
               lambda t: t.pop("layers.2.attn.compressor.ape"))
    refused(lambda: read_checkpoint(broken, CFG), INDEX, "'layers.2.attn.compressor.ape'", "missing")


def test_refuses_missing_tensor_single_file(tmp_path, exact_state):
    write_official_checkpoint(tmp_path / "w", CFG, exact_state)
    tensors = {}
    for f in sorted((tmp_path / "w").glob("model-*.safetensors")):
        tensors.update(load_file(str(f)))
    del tensors["hc_head_scale"]
    root = tmp_path / "single"
    root.mkdir()
    save_file(tensors, str(root / "model.safetensors"))
    shutil.copy(tmp_path / "w" / "config.json", root)
    refused(lambda: read_checkpoint(root, CFG), str(root / "model.safetensors"), "'hc_head_scale'")


def test_refuses_unexpected_tensor(broken):
    fname = shard_of(broken, "layers.1.attn.wq_a.weight")
    edit_shard(broken, fname, lambda t: t.update({"layers.1.attn.bogus.weight": torch.zeros(2, 2)}))
    refused(lambda: read_checkpoint(broken, CFG), fname, "'layers.1.attn.bogus.weight'", "not a tensor")


def test_refuses_extra_layer(broken):
    fname = shard_of(broken, "norm.weight")
    edit_shard(broken, fname, lambda t: t.update({"layers.3.attn_norm.weight": torch.ones(64)}))
    refused(lambda: read_checkpoint(broken, CFG), fname, "'layers.3.attn_norm.weight'")


def test_refuses_wrong_logical_shape(broken):
    fname = shard_of(broken, "layers.0.attn.q_norm.weight")
    edit_shard(broken, fname, lambda t: t.update({"layers.0.attn.q_norm.weight": torch.ones(33)}))
    refused(lambda: read_checkpoint(broken, CFG), fname, "'layers.0.attn.q_norm.weight'", "[33]", "[32]")


def test_refuses_wrong_fp8_weight_shape(broken):
    name = "layers.1.attn.wq_b.weight"
    fname = shard_of(broken, name)
    edit_shard(broken, fname, lambda t: t.update({name: t[name][:256].contiguous()}))
    refused(lambda: read_checkpoint(broken, CFG), fname, f"'{name}'", "[256, 32]")


def test_refuses_wrong_fp8_scale_shape(broken):
    name = "layers.1.attn.wq_b.scale"
    fname = shard_of(broken, name)
    edit_shard(broken, fname, lambda t: t.update({name: torch.cat([t[name], t[name]])}))
    refused(lambda: read_checkpoint(broken, CFG), fname, f"'{name}'", "scale shape [8, 1], expected [4, 1]")


def test_refuses_fp8_without_scale(broken):
    name = "layers.0.attn.wkv.scale"
    fname = shard_of(broken, name)
    edit_shard(broken, fname, lambda t: t.pop(name))
    refused(lambda: read_checkpoint(broken, CFG), fname, "'layers.0.attn.wkv.weight'", "'layers.0.attn.wkv.scale'")


def test_refuses_fp4_stored_unpacked_size(broken):
    name = "layers.2.ffn.experts.1.w1.weight"
    fname = shard_of(broken, name)
    edit_shard(broken, fname, lambda t: t.update({name: torch.zeros(32, 64, dtype=torch.int8)}))
    refused(lambda: read_checkpoint(broken, CFG), fname, f"'{name}'", "packed FP4", "[32, 32]")


def test_refuses_fp4_scale_of_wrong_dtype(broken):
    name = "layers.2.ffn.experts.1.w2.scale"
    fname = shard_of(broken, name)
    edit_shard(broken, fname, lambda t: t.update({name: t[name].view(torch.uint8)}))
    refused(lambda: read_checkpoint(broken, CFG), fname, f"'{name}'", "U8")


def test_refuses_scale_beside_unquantized_weight(broken):
    name = "layers.0.attn.wo_b.weight"
    fname = shard_of(broken, name)
    edit_shard(broken, fname, lambda t: t.update({name: t[name].float()}))
    refused(lambda: read_checkpoint(broken, CFG), fname, "'layers.0.attn.wo_b.scale'", "unquantized")


def test_refuses_unknown_dtype(broken):
    name = "layers.1.ffn_norm.weight"
    fname = shard_of(broken, name)
    edit_shard(broken, fname, lambda t: t.update({name: torch.ones(64, dtype=torch.int16)}))
    refused(lambda: read_checkpoint(broken, CFG), fname, f"'{name}'", "unknown dtype I16")


def test_refuses_dtype_that_cannot_hold_kind(broken):
    name = "layers.1.ffn.gate.tid2eid"
    fname = shard_of(broken, name)
    edit_shard(broken, fname, lambda t: t.update({name: t[name].float()}))
    refused(lambda: read_checkpoint(broken, CFG), fname, f"'{name}'", "F32")


def test_refuses_tid2eid_out_of_range(broken):
    name = "layers.0.ffn.gate.tid2eid"
    fname = shard_of(broken, name)
    edit_shard(broken, fname, lambda t: t[name].__setitem__((5, 0), CFG.n_routed_experts))
    refused(lambda: read_checkpoint(broken, CFG), fname, f"'{name}'", "experts outside")


def test_refuses_tensor_stored_twice(broken):
    fname = shard_of(broken, "head.weight")
    edit_shard(broken, fname, lambda t: t.update({"lm_head.weight": t["head.weight"].clone()}))
    refused(lambda: read_checkpoint(broken, CFG), fname, "'lm_head.weight'", "'head.weight'", "twice")


def test_refuses_directory_without_weights(tmp_path):
    write_official_checkpoint(tmp_path, CFG, random_state(CFG))
    for f in tmp_path.glob("model*"):
        f.unlink()
    refused(lambda: read_checkpoint(tmp_path, CFG), str(tmp_path), "model.safetensors")
    refused(lambda: read_checkpoint(tmp_path / "nope", CFG), "nope")


def test_writer_refuses_wrong_state(tmp_path):
    state = random_state(CFG)
    state.pop("norm.weight")
    refused(lambda: write_official_checkpoint(tmp_path, CFG, state), "'norm.weight'")
    state = random_state(CFG)
    state["layers.0.attn.wkv.weight"] = torch.zeros(3, 3)
    refused(lambda: write_official_checkpoint(tmp_path, CFG, state), "'layers.0.attn.wkv.weight'")


# ---------------------------------------------------------------- tokenizer


def test_demo_tokenizer_tiny_vocab(tmp_path):
    tok = build_demo_tokenizer(CFG.vocab_size, tmp_path)
    assert tok.get_vocab_size() <= CFG.vocab_size
    loaded = load_tokenizer(tmp_path)
    assert loaded.token_to_id(BOS_TOKEN) == 0 and loaded.token_to_id(EOS_TOKEN) == 1
    text = "The bridge over the river is 300 years old, isn't it?"
    ids = loaded.encode(text).ids
    assert max(ids) < CFG.vocab_size and len(ids) < len(text)  # merges were learned
    assert loaded.decode(ids) == text
    assert loaded.encode(BOS_TOKEN + "Hi").ids[0] == 0


def test_demo_tokenizer_full_bytes_and_checkpoint_copy(tmp_path):
    build_demo_tokenizer(1000, tmp_path / "tok.json")
    tok = load_tokenizer(tmp_path / "tok.json")
    text = "naïve café – ünïcode ✓"
    assert tok.decode(tok.encode(text).ids) == text  # every byte has a symbol
    write_official_checkpoint(tmp_path / "ck", CFG, random_state(CFG), quantize=False,
                              tokenizer_json=tmp_path / "tok.json")
    assert load_tokenizer(tmp_path / "ck").get_vocab() == tok.get_vocab()


def test_load_tokenizer_missing(tmp_path):
    refused(lambda: load_tokenizer(tmp_path), str(tmp_path / "tokenizer.json"))


@pytest.mark.parametrize("per_name", [True, False])
def test_random_init_routes_the_hash_layers_alike_in_every_process(per_name):
    """init_random's hash-layer routing (tid2eid) comes from its own seeded generator whatever the global one holds:
    without `per_name` (bench/ttft.py's models) it once drew from the global generator, so the same seed routed
    tokens differently in every process (bench/fp8_local.py --small's figures moved by 10x between runs)."""
    from runtime.model.deepseek_v4 import Transformer
    from runtime.model.random_init import init_random
    cfg = C.tiny_reuse()
    tables = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        m = Transformer(cfg)
        init_random(m, 0, per_name=per_name)
        hashed = [b.ffn.gate.tid2eid.clone() for b in m.layers if b.ffn.gate.hash]
        assert hashed and all(t.any() for t in hashed)
        tables.append(hashed)
    assert all(torch.equal(a, b) for a, b in zip(*tables))
