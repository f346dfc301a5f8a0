"""DeepSeek-V4 checkpoints on disk: the tensor table of the official format, a strict reader for the official
layout and for what `transformers` writes, a writer of the official layout (for tests and demos), random
weights in the official naming, and the tokenizer file.

Everything in memory uses the official names (bare, as in DeepSeek's `model.safetensors.index.json`) and
logical, dequantized shapes. See /work/shared/V4-CHECKPOINT.md for the format facts this relies on.
"""
from __future__ import annotations

import contextlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import quant
from .config import ConfigError, ModelConfig, load_config, to_official_json

FP8, FP4, BF16, F32, I64 = "fp8", "fp4", "bf16", "f32", "i64"
KINDS = (FP8, FP4, BF16, F32, I64)
FP8_BLOCK = 128
FP4_GROUP = 32

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"

# safetensors dtype strings we understand; anything else in a checkpoint is refused
_FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_INT_DTYPES = {"I64", "I32"}
_FP8_DTYPE, _SCALE_DTYPE, _PACKED_FP4_DTYPES = "F8_E4M3", "F8_E8M0", {"I8", "U8"}
_KNOWN_DTYPES = set(_FLOAT_DTYPES) | _INT_DTYPES | {_FP8_DTYPE, _SCALE_DTYPE} | _PACKED_FP4_DTYPES

_MTP = re.compile(r"(^|\.)mtp\.")


class CheckpointError(ValueError):
    """A checkpoint directory that does not hold exactly the model described by the config. Nothing is
    returned; the message names the file and the tensor (or config field) at fault."""


Shapes = dict[str, tuple[tuple[int, ...], str]]


# ---------------------------------------------------------------- the tensor table


def expected_shapes(cfg: ModelConfig) -> Shapes:
    """Every tensor of the main model (no MTP) under its official name -> (logical shape, storage kind),
    in the order of the official index."""
    d, hc, H, hd = cfg.dim, cfg.hc_mult, cfg.n_heads, cfg.head_dim
    qr, G, orank, inter = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank, cfg.moe_inter_dim
    ih, idim, E = cfg.index_n_heads, cfg.index_head_dim, cfg.n_routed_experts
    mix = (2 + hc) * hc  # pre (hc) + post (hc) + residual mixing (hc x hc)
    out: Shapes = {"embed.weight": ((cfg.vocab_size, d), BF16)}
    for L in range(cfg.n_layers):
        p = f"layers.{L}."
        for site in ("attn", "ffn"):
            out[f"{p}hc_{site}_fn"] = ((mix, hc * d), F32)
            out[f"{p}hc_{site}_base"] = ((mix,), F32)
            out[f"{p}hc_{site}_scale"] = ((3,), F32)
        a = p + "attn."
        out[a + "attn_sink"] = ((H,), F32)
        out[a + "wq_a.weight"] = ((qr, d), FP8)
        out[a + "wq_b.weight"] = ((H * hd, qr), FP8)
        out[a + "q_norm.weight"] = ((qr,), BF16)
        out[a + "wo_a.weight"] = ((G * orank, H * hd // G), FP8)
        out[a + "wkv.weight"] = ((hd, d), FP8)
        out[a + "kv_norm.weight"] = ((hd,), BF16)
        r = cfg.compress_ratios[L]
        if r:
            c = 2 if r == 4 else 1  # CSA blocks overlap: two projections per position
            out[a + "compressor.wkv.weight"] = ((c * hd, d), BF16)
            out[a + "compressor.wgate.weight"] = ((c * hd, d), BF16)
            out[a + "compressor.ape"] = ((r, c * hd), F32)
            out[a + "compressor.norm.weight"] = ((hd,), BF16)
        if r == 4:
            out[a + "indexer.wq_b.weight"] = ((ih * idim, qr), FP8)
            out[a + "indexer.weights_proj.weight"] = ((ih, d), BF16)
            out[a + "indexer.compressor.wkv.weight"] = ((2 * idim, d), BF16)
            out[a + "indexer.compressor.wgate.weight"] = ((2 * idim, d), BF16)
            out[a + "indexer.compressor.ape"] = ((4, 2 * idim), F32)
            out[a + "indexer.compressor.norm.weight"] = ((idim,), BF16)
        out[a + "wo_b.weight"] = ((d, G * orank), FP8)
        out[p + "attn_norm.weight"] = ((d,), BF16)
        out[p + "ffn_norm.weight"] = ((d,), BF16)
        f = p + "ffn."
        out[f + "shared_experts.w1.weight"] = ((inter, d), FP8)
        out[f + "shared_experts.w3.weight"] = ((inter, d), FP8)
        out[f + "shared_experts.w2.weight"] = ((d, inter), FP8)
        for e in range(E):
            out[f"{f}experts.{e}.w1.weight"] = ((inter, d), FP4)
            out[f"{f}experts.{e}.w3.weight"] = ((inter, d), FP4)
        for e in range(E):
            out[f"{f}experts.{e}.w2.weight"] = ((d, inter), FP4)
        if cfg.is_hash_layer(L):
            out[f + "gate.tid2eid"] = ((cfg.vocab_size, cfg.n_activated_experts), I64)
        else:
            out[f + "gate.bias"] = ((E,), F32)
        out[f + "gate.weight"] = ((E, d), BF16)
    out["hc_head_base"] = ((hc,), F32)
    out["hc_head_fn"] = ((hc, hc * d), F32)
    out["hc_head_scale"] = ((1,), F32)
    out["norm.weight"] = ((d,), BF16)
    out["head.weight"] = ((cfg.vocab_size, d), BF16)
    return out


def scale_name(weight_name: str) -> str:
    """`X.weight` -> `X.scale`, the sibling that holds a quantized weight's E8M0 scales."""
    assert weight_name.endswith(".weight"), weight_name
    return weight_name[: -len(".weight")] + ".scale"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _fp8_scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    return _ceil_div(shape[0], FP8_BLOCK), _ceil_div(shape[1], FP8_BLOCK)


def _fp4_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, int], tuple[int, int]]:
    """(packed shape, scale shape) of an FP4 expert weight of logical shape [out, in]."""
    return (shape[0], shape[1] // 2), (shape[0], _ceil_div(shape[1], FP4_GROUP))


# ---------------------------------------------------------------- reading


# transformers' save_pretrained names (after its own reverse renaming) that are not official + "model."
_HF_ALIASES = {
    "model.embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "model.lm_head.weight": "head.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}
# transformers renames official `.norm.` to `.kv_norm.` on load, so the attention's kv_norm comes back as
# `attn.norm` on save (the compressors' `norm` round-trips to itself)
_HF_ATTN_NORM = re.compile(r"^(layers\.\d+\.attn)\.norm\.weight$")


def official_name(stored: str) -> str:
    """The official name of a tensor stored under `stored` in either layout."""
    if stored in _HF_ALIASES:
        return _HF_ALIASES[stored]
    if stored.startswith("model."):
        return _HF_ATTN_NORM.sub(r"\1.kv_norm.weight", stored[len("model."):])
    return stored


@dataclass(frozen=True)
class _Stored:
    file: Path
    key: str
    dtype: str
    shape: tuple[int, ...]

    def where(self) -> str:
        name = official_name(self.key)
        alias = "" if name == self.key else f" (official {name!r})"
        return f"{self.file}: tensor {self.key!r}{alias}"


@dataclass(frozen=True)
class _Plan:
    """How to produce one official tensor: its stored weight and, when quantized, its stored scale."""
    name: str
    kind: str
    how: str  # "float" | "int" | "fp8" | "fp4"
    weight: _Stored
    scale: _Stored | None = None


def _shard_files(root: Path) -> tuple[Path, dict[str, Path] | None, list[Path]]:
    """(the file that lists the tensors, the index's name -> file map or None, the files to open)."""
    index = root / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            assert isinstance(weight_map, dict)
        except (json.JSONDecodeError, KeyError, TypeError, AssertionError) as e:
            raise CheckpointError(f"{index}: not a safetensors index with a weight_map ({e!r})") from None
        located: dict[str, Path] = {}
        for name, fname in weight_map.items():
            f = root / str(fname)
            if not f.is_file():
                raise CheckpointError(f"{index}: tensor {name!r} is mapped to shard {fname!r}, which does not "
                                      f"exist in {root}")
            located[name] = f
        # shards holding only MTP tensors are never opened (V4-Flash: the whole last shard)
        files = sorted({f for n, f in located.items() if not _MTP.search(n)})
        return index, located, files
    single = root / SINGLE_FILE
    if single.is_file():
        return single, None, [single]
    raise CheckpointError(f"{root}: neither {INDEX_FILE} nor {SINGLE_FILE} exists")


def _scan(root: Path) -> tuple[Path, dict[str, _Stored]]:
    """Headers only: official name -> where and how it is stored. MTP tensors are left out."""
    listing, located, files = _shard_files(root)
    stored: dict[str, _Stored] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                keys = list(h.keys())
                if located is not None:  # the index decides which tensors exist and where
                    listed = {k for k, g in located.items() if g == f}
                    lacking = sorted(listed - set(keys))
                    if lacking:
                        raise CheckpointError(f"{f}: tensor {lacking[0]!r} is mapped to this shard by {listing} "
                                              f"but the shard lacks it ({len(lacking)} such)")
                    keys = [k for k in keys if k in listed]
                for k in keys:
                    if _MTP.search(k):
                        continue
                    sl = h.get_slice(k)
                    st = _Stored(f, k, sl.get_dtype(), tuple(sl.get_shape()))
                    name = official_name(k)
                    if name in stored:
                        raise CheckpointError(f"{st.where()} is stored twice: also as "
                                              f"{stored[name].key!r} in {stored[name].file}")
                    stored[name] = st
        except CheckpointError:
            raise
        except Exception as e:  # a header safetensors cannot parse
            raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
    return listing, stored


def _plan_one(name: str, shape: tuple[int, ...], kind: str, w: _Stored,
              scale: _Stored | None) -> tuple[_Plan | None, str | None]:
    """Check one stored tensor against the table; returns (plan, None) or (None, problem)."""
    if w.dtype not in _KNOWN_DTYPES:
        return None, f"{w.where()} has unknown dtype {w.dtype}"

    def want_shape(got: tuple[int, ...], want: tuple[int, ...], what: str, st: _Stored) -> str | None:
        return None if got == want else f"{st.where()}: {what} shape {list(got)}, expected {list(want)}"

    def check_scale(want: tuple[int, ...]) -> str | None:
        if scale is None:
            return f"{w.where()} is {w.dtype} but its scale {scale_name(name)!r} is missing from every file"
        if scale.dtype != _SCALE_DTYPE:
            return f"{scale.where()} has dtype {scale.dtype}, expected {_SCALE_DTYPE}"
        return want_shape(scale.shape, want, "scale", scale)

    if kind in (FP8, FP4) and w.dtype == _FP8_DTYPE:
        # FP8 also for FP4 experts: DeepSeek's convert.py --expert-dtype fp8 writes them so
        problem = want_shape(w.shape, shape, "FP8 weight", w) or check_scale(_fp8_scale_shape(shape))
        return (None, problem) if problem else (_Plan(name, kind, "fp8", w, scale), None)
    if kind == FP4 and w.dtype in _PACKED_FP4_DTYPES:
        packed, sshape = _fp4_shapes(shape)
        problem = (None if shape[1] % 2 == 0 else f"{w.where()}: odd input dim {shape[1]} cannot be packed") \
            or want_shape(w.shape, packed, f"packed FP4 weight (logical {list(shape)})", w) or check_scale(sshape)
        return (None, problem) if problem else (_Plan(name, kind, "fp4", w, scale), None)
    if scale is not None:
        return None, f"{scale.where()} is a scale for {name!r}, which is stored unquantized as {w.dtype}"
    if kind == I64:
        if w.dtype not in _INT_DTYPES:
            return None, f"{w.where()} has dtype {w.dtype}; an integer table (I64/I32) is expected"
        problem = want_shape(w.shape, shape, "tensor", w)
        return (None, problem) if problem else (_Plan(name, kind, "int", w), None)
    if w.dtype not in _FLOAT_DTYPES:
        return None, f"{w.where()} has dtype {w.dtype}, which cannot hold a {kind} tensor"
    problem = want_shape(w.shape, shape, "tensor", w)
    return (None, problem) if problem else (_Plan(name, kind, "float", w), None)


def _check_config(root: Path, cfg: ModelConfig | None) -> ModelConfig:
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file}: missing; a checkpoint directory needs its config.json")
    try:
        on_disk = load_config(cfg_file)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    if cfg is None:
        return on_disk
    # quant_sim is a runtime switch, not a property of the weights
    diffs = [f"{k}: config.json has {v!r}, the model {getattr(cfg, k)!r}" for k, v in on_disk.to_dict().items()
             if k != "quant_sim" and v != cfg.to_dict()[k]]
    if diffs:
        raise CheckpointError(f"{cfg_file}: disagrees with the model config on " + "; ".join(diffs))
    return cfg


def read_checkpoint(path: str | Path, cfg: ModelConfig | None = None, keep: Callable[[str], bool] | None = None,
                    dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Official name -> dequantized tensor for every tensor of `expected_shapes(cfg)` that `keep` accepts
    (all when keep is None), cast to `dtype`; f32-kind tensors stay float32 and integer tables int64.

    Reads DeepSeek's layout (sharded or single file, FP8/FP4 with `.scale` siblings, `mtp.*` ignored) and
    the one `transformers` save_pretrained writes. The whole checkpoint is validated from the headers before
    any tensor bytes are read, and tensors `keep` rejects are never read. `cfg` None means config.json's.
    Raises CheckpointError on any mismatch; never returns a partial result."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a checkpoint directory")
    cfg = _check_config(root, cfg)
    listing, stored = _scan(root)
    expected = expected_shapes(cfg)

    problems: list[str] = []
    plans: list[_Plan] = []
    used: set[str] = set()
    for name, (shape, kind) in expected.items():
        w = stored.get(name)
        if w is None:
            problems.append(f"{listing}: tensor {name!r} (expected {list(shape)} {kind}) is missing from every file")
            continue
        sname = scale_name(name) if kind in (FP8, FP4) else None
        scale = stored.get(sname) if sname else None
        used.add(name)
        if scale is not None:
            used.add(sname)
        plan, problem = _plan_one(name, shape, kind, w, scale)
        if problem:
            problems.append(problem)
        else:
            plans.append(plan)
    for name in sorted(set(stored) - used):
        problems.append(f"{stored[name].where()} is not a tensor of this model "
                        f"({cfg.n_layers} layers, {cfg.n_routed_experts} experts)")
    if problems:
        more = f" (and {len(problems) - 8} more problems)" if len(problems) > 8 else ""
        raise CheckpointError("; ".join(problems[:8]) + more)

    out: dict[str, torch.Tensor] = {}
    with contextlib.ExitStack() as stack:
        handles: dict[Path, object] = {}

        def load(st: _Stored) -> torch.Tensor:
            if st.file not in handles:
                handles[st.file] = stack.enter_context(safe_open(str(st.file), framework="pt"))
            return handles[st.file].get_tensor(st.key)

        for p in plans:
            if keep is not None and not keep(p.name):
                continue
            if p.how == "fp8":
                t = quant.dequant_fp8_block(load(p.weight), load(p.scale), FP8_BLOCK)
            elif p.how == "fp4":
                t = quant.dequant_fp4(load(p.weight), load(p.scale), FP4_GROUP)
            elif p.how == "int":
                t = load(p.weight).to(torch.int64)
                if p.name.endswith("gate.tid2eid") and t.numel() and not (
                        0 <= int(t.min()) and int(t.max()) < cfg.n_routed_experts):
                    raise CheckpointError(f"{p.weight.where()} names experts outside 0..{cfg.n_routed_experts - 1}")
            else:
                t = load(p.weight)
            if p.how != "int":
                t = t.to(torch.float32 if p.kind == F32 else dtype)
            out[p.name] = t.contiguous()
    return out


# ---------------------------------------------------------------- writing


def _validate_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> Shapes:
    expected = expected_shapes(cfg)
    missing = [n for n in expected if n not in state]
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise CheckpointError(f"state does not match the model: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, (shape, kind) in expected.items():
        t = state[name]
        if tuple(t.shape) != shape:
            raise CheckpointError(f"state: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
        if (kind == I64) != (not t.is_floating_point()):
            raise CheckpointError(f"state: tensor {name!r} has dtype {t.dtype}, which cannot hold a {kind} tensor")
    return expected


def _shard_of(name: str, n_layers: int) -> int:
    """0 = embed, 1 + L = layer L, n_layers + 1 = final norm / head / hc_head (the official grouping)."""
    if name == "embed.weight":
        return 0
    if name.startswith("layers."):
        return 1 + int(name.split(".")[1])
    return n_layers + 1


def write_official_checkpoint(path: str | Path, cfg: ModelConfig, state: dict[str, torch.Tensor],
                              quantize: bool = True, tokenizer_json: str | Path | None = None) -> None:
    """Write `state` (official names, logical shapes) in DeepSeek's layout: config.json, one shard per block
    and model.safetensors.index.json. With `quantize`, tensors are stored as the official checkpoint stores
    them (FP8 e4m3 + E8M0 block scales, packed FP4 experts + E8M0 scales, BF16, F32, I64); without, every
    tensor is stored with the dtype it has in `state`."""
    expected = _validate_state(cfg, state)
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    n_shards = cfg.n_layers + 2
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(n_shards)]
    for name, (_, kind) in expected.items():
        t = state[name].detach().cpu()
        group = shards[_shard_of(name, cfg.n_layers)]
        if not quantize:
            group[name] = t.contiguous()
        elif kind == FP8:
            group[name], group[scale_name(name)] = quant.quant_fp8_block(t, FP8_BLOCK)
        elif kind == FP4:
            group[name], group[scale_name(name)] = quant.quant_fp4(t, FP4_GROUP)
        elif kind == BF16:
            group[name] = t.to(torch.bfloat16).contiguous()
        elif kind == F32:
            group[name] = t.to(torch.float32).contiguous()
        else:
            group[name] = t.to(torch.int64).contiguous()
    weight_map: dict[str, str] = {}
    total = 0
    for i, tensors in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file(tensors, str(root / fname))
        for k, t in tensors.items():
            weight_map[k] = fname
            total += t.numel() * t.element_size()
    (root / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                              indent=2))
    (root / "config.json").write_text(json.dumps(to_official_json(cfg), indent=2))
    if tokenizer_json is not None:
        copy_tokenizer(tokenizer_json, root)


# ---------------------------------------------------------------- random weights


def _round_trip(t: torch.Tensor, kind: str) -> torch.Tensor:
    """t as it comes back after storage of its kind (dequantized), so the stored form is exact."""
    if kind == FP8:
        return quant.dequant_fp8_block(*quant.quant_fp8_block(t, FP8_BLOCK), FP8_BLOCK)
    if kind == FP4:
        return quant.dequant_fp4(*quant.quant_fp4(t, FP4_GROUP), FP4_GROUP)
    if kind == BF16:
        return t.to(torch.bfloat16).to(torch.float32)
    return t


def random_state(cfg: ModelConfig, seed: int = 0, exact_quant: bool = False) -> dict[str, torch.Tensor]:
    """Random float32 weights (int64 tid2eid) under the official names, scaled like a trained model so a
    forward pass stays well conditioned: linears ~ N(0, 1/fan_in), norms near 1, hyper-connection fns
    std 0.02 with random base and scale, nonzero sinks, random compressor position biases and router
    biases, and hash tables naming n_activated distinct experts per token. With `exact_quant`, every
    tensor is replaced by its value after storage in the official dtype, so the quantized checkpoint
    holds it exactly."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=g, dtype=torch.float32)

    state: dict[str, torch.Tensor] = {}
    for name, (shape, kind) in expected_shapes(cfg).items():
        leaf = name.rsplit(".", 1)[-1] if not name.endswith(".weight") else name.rsplit(".", 2)[-2]
        if kind == I64:  # tid2eid: a random k-subset of the experts per token
            t = torch.argsort(rand(shape[0], cfg.n_routed_experts), dim=1)[:, : shape[1]].contiguous()
        elif name == "embed.weight":
            t = randn(*shape)
        elif leaf.endswith("norm"):
            t = 1.0 + 0.1 * randn(*shape)
        elif re.search(r"hc_\w*fn$", name):
            t = 0.02 * randn(*shape)
        elif re.search(r"hc_\w*base$", name):
            t = 0.1 * randn(*shape)
        elif re.search(r"hc_\w*scale$", name):
            t = 0.5 + rand(*shape)
        elif leaf == "attn_sink":
            t = randn(*shape)
        elif leaf == "ape":
            t = 0.5 * randn(*shape)
        elif leaf == "bias":
            t = 0.1 * randn(*shape)
        else:
            assert len(shape) == 2, name  # every remaining tensor is a linear [out, in]
            t = randn(*shape) / shape[1] ** 0.5
        state[name] = _round_trip(t, kind) if exact_quant else t
    return state


# ---------------------------------------------------------------- tokenizer


def load_tokenizer(path: str | Path):
    """The `tokenizers.Tokenizer` in `path`/tokenizer.json (or `path` itself when it is the file)."""
    from tokenizers import Tokenizer

    p = Path(path)
    f = p if p.is_file() else p / "tokenizer.json"
    if not f.is_file():
        raise CheckpointError(f"{f}: no tokenizer.json")
    try:
        return Tokenizer.from_file(str(f))
    except Exception as e:  # tokenizers raises plain Exception subclasses on bad JSON
        raise CheckpointError(f"{f}: not a tokenizers file ({e})") from None


_DEMO_TEXT = """\
The river runs past the old mill and under the stone bridge before it reaches the sea. In the morning the \
fishermen check their nets, the baker opens her shop, and the children walk to school along the water. \
Nobody in the town remembers when the bridge was built, but everyone knows that it has survived every \
flood for three hundred years. Travelers who stop here often ask the same questions: where does the \
river begin, how deep is it, and why is the water so clear? The answers are simple. It begins in the \
mountains to the north, it is deeper than it looks, and it is clear because it moves quickly over sand \
and stone. A model that reads this paragraph learns how English words are built from smaller pieces: \
the, and, ing, tion, ed, er, re, th, and many others. Numbers such as 1, 2, 3, 10, 42 and 2024 appear \
too, along with punctuation like commas, periods, questions? and answers! "Quotes" (parentheses) and \
a colon: all help the tokenizer see common symbols.
"""

# the chat-format specials of encoding_dsv4 after BOS/EOS, so rendered prompts tokenize like the real model
_DEMO_SPECIALS = (BOS_TOKEN, EOS_TOKEN, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>")
# DeepSeek's chat turn markers, without the BOS (documents come first in a request: the question's chat follows them)
DEMO_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")
TOKENIZER_CONFIG = "tokenizer_config.json"


def copy_tokenizer(tokenizer_json: str | Path, directory: Path) -> None:
    """tokenizer.json into a checkpoint directory, with the tokenizer_config.json (chat template, special tokens)
    that sits beside it, where one does."""
    src = Path(tokenizer_json)
    if not src.is_file():
        raise CheckpointError(f"{src}: tokenizer file not found")
    shutil.copyfile(src, directory / "tokenizer.json")
    if (src.parent / TOKENIZER_CONFIG).is_file():
        shutil.copyfile(src.parent / TOKENIZER_CONFIG, directory / TOKENIZER_CONFIG)


def build_demo_tokenizer(vocab_size: int, path: str | Path):
    """Train a small byte-level BPE on a built-in English paragraph and write it as tokenizer.json under
    `path` (a directory, or the .json file itself), with a tokenizer_config.json beside it (DeepSeek's chat turn
    markers as its chat template); returns the Tokenizer. BOS has id 0 and EOS id 1, as
    in DeepSeek-V4. With room for all 256 byte symbols any text encodes; below that (tiny test vocabs)
    the alphabet is printable ASCII plus tab and newline, and other bytes are dropped."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    p = Path(path)
    out = p if p.suffix == ".json" else p / "tokenizer.json"
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    full = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size >= len(_DEMO_SPECIALS) + len(full):
        alphabet = full
    else:
        ascii_chars = "".join(chr(b) for b in range(32, 127)) + "\t\n"
        mapped = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(ascii_chars)
        alphabet = sorted(set("".join(s for s, _ in mapped)))
    if vocab_size < len(_DEMO_SPECIALS) + len(alphabet):
        raise ValueError(f"vocab_size={vocab_size} cannot hold {len(_DEMO_SPECIALS)} special tokens and an "
                         f"alphabet of {len(alphabet)} symbols")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(_DEMO_SPECIALS),
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator([_DEMO_TEXT], trainer)
    assert tok.token_to_id(BOS_TOKEN) == 0 and tok.token_to_id(EOS_TOKEN) == 1
    assert tok.get_vocab_size() <= vocab_size
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    (out.parent / TOKENIZER_CONFIG).write_text(json.dumps(
        {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "chat_template": DEMO_CHAT_TEMPLATE}, ensure_ascii=False))
    return tok
