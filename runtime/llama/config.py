"""Llama-family configuration: one frozen dataclass read from (and written to) the config.json that
transformers writes for LlamaForCausalLM and Qwen2ForCausalLM, in both rope dialects (`rope_theta` +
`rope_scaling`, and transformers 5's `rope_parameters`)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ROPE_TYPES = ("default", "linear", "llama3")


class LlamaConfigError(ValueError):
    """A config.json that does not describe a model this runtime can build. Nothing is built; the caller
    reports the message (it names every problem found)."""


@dataclass(frozen=True)
class LlamaConfig:
    model_type: str = "llama"                   # "llama" or "qwen2"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 0                           # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_type: str = "default"                  # "default", "linear" or "llama3"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0           # llama3 only
    rope_high_freq_factor: float = 4.0          # llama3 only
    rope_original_max_position: int = 8192      # llama3 only
    qkv_bias: bool = False                      # Qwen2: always; Llama: attention_bias
    o_bias: bool = False                        # Llama's attention_bias also biases o_proj
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    pad_token_id: int | None = None

    @property
    def n_layers(self) -> int:
        return self.num_hidden_layers

    def __post_init__(self):
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // max(self.num_attention_heads, 1))
        problems = []
        if self.model_type not in ("llama", "qwen2"):
            problems.append(f"model_type={self.model_type!r}: only 'llama' and 'qwen2' are supported")
        if self.num_key_value_heads <= 0 or self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                            f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even for rotate-half RoPE")
        if self.rope_type not in ROPE_TYPES:
            problems.append(f"rope_type={self.rope_type!r}: supported are {ROPE_TYPES}")
        if self.model_type == "qwen2" and (not self.qkv_bias or self.o_bias):
            problems.append("Qwen2 has q/k/v biases and no o_proj bias (qkv_bias=True, o_bias=False)")
        if self.model_type == "llama" and self.qkv_bias != self.o_bias:
            problems.append("Llama's attention_bias biases q, k, v and o together (qkv_bias == o_bias)")
        if self.rope_type != "default" and self.rope_factor <= 0:
            problems.append(f"rope_factor={self.rope_factor} must be positive")
        if problems:
            raise LlamaConfigError("; ".join(problems))

    @property
    def heads_per_kv(self) -> int:
        """Query heads sharing one KV head (the GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    # -- config.json ---------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, d: dict) -> "LlamaConfig":
        mt = d.get("model_type", "llama")
        problems = []
        if d.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act={d['hidden_act']!r}: only SwiGLU (silu) is supported")
        if d.get("use_sliding_window"):
            problems.append("use_sliding_window=true is not supported")
        if d.get("pretraining_tp", 1) not in (1, None):
            problems.append(f"pretraining_tp={d['pretraining_tp']} is not supported")
        rope = _rope_fields(d, problems)
        if problems:
            raise LlamaConfigError("; ".join(problems))
        eos = d.get("eos_token_id", 2)
        eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        attention_bias = bool(d.get("attention_bias", False))
        heads = d.get("num_attention_heads", 32)
        return cls(
            model_type=mt, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or 0, rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            max_position_embeddings=d.get("max_position_embeddings", 2048), **rope,
            qkv_bias=True if mt == "qwen2" else attention_bias, o_bias=mt == "llama" and attention_bias,
            mlp_bias=bool(d.get("mlp_bias", False)), tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"), eos_token_ids=eos, pad_token_id=d.get("pad_token_id"))

    def to_hf(self) -> dict:
        """The config.json transformers reads for LlamaForCausalLM / Qwen2ForCausalLM."""
        scaling = None
        if self.rope_type == "linear":
            scaling = {"rope_type": "linear", "factor": self.rope_factor}
        elif self.rope_type == "llama3":
            scaling = {"rope_type": "llama3", "factor": self.rope_factor,
                       "low_freq_factor": self.rope_low_freq_factor, "high_freq_factor": self.rope_high_freq_factor,
                       "original_max_position_embeddings": self.rope_original_max_position}
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[self.model_type]
        d = {"architectures": [arch], "model_type": self.model_type, "vocab_size": self.vocab_size,
             "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
             "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
             "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim, "hidden_act": "silu",
             "rms_norm_eps": self.rms_norm_eps, "max_position_embeddings": self.max_position_embeddings,
             "rope_theta": self.rope_theta, "rope_scaling": scaling, "tie_word_embeddings": self.tie_word_embeddings,
             "bos_token_id": self.bos_token_id,
             "eos_token_id": self.eos_token_id if len(self.eos_token_ids) <= 1 else list(self.eos_token_ids),
             "pad_token_id": self.pad_token_id, "torch_dtype": "float32"}
        if self.model_type == "llama":
            d.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
        return d

    @classmethod
    def from_file(cls, path: str | Path) -> "LlamaConfig":
        """`path` is a config.json or a checkpoint directory holding one."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise LlamaConfigError(f"no config.json at {p}")
        return cls.from_hf(json.loads(p.read_text()))


def _rope_fields(d: dict, problems: list[str]) -> dict:
    """rope_theta and scaling from either dialect; unknown scaling types are a problem, not ignored."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    src = params if params.get("rope_type", "default") != "default" else scaling
    rtype = src.get("rope_type", src.get("type", "default"))
    if rtype not in ROPE_TYPES:
        problems.append(f"rope scaling type {rtype!r} is not supported (supported: {ROPE_TYPES})")
        return {}
    out = {"rope_theta": float(theta), "rope_type": rtype}
    if rtype != "default":
        out["rope_factor"] = float(src["factor"])
    if rtype == "llama3":
        out.update(rope_low_freq_factor=float(src["low_freq_factor"]),
                   rope_high_freq_factor=float(src["high_freq_factor"]),
                   rope_original_max_position=int(src["original_max_position_embeddings"]))
    return out
