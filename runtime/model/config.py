"""DeepSeek-V4 model configuration: one frozen dataclass, the official presets, and readers for the
two config.json dialects (DeepSeek's own and the one `transformers` writes)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

WINDOW, CSA, HCA = "window", "csa", "hca"


class ConfigError(ValueError):
    """A config.json that cannot describe a DeepSeek-V4 model. The caller cannot load; nothing is built."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 129280
    dim: int = 4096
    n_layers: int = 43
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    # one entry per layer: 0 = window only, 4 = CSA (overlapping blocks + indexer), 128 = HCA
    compress_ratios: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    # YaRN, applied only in compressed layers
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    n_activated_experts: int = 6
    n_shared_experts: int = 1
    moe_inter_dim: int = 2048
    n_hash_layers: int = 3
    route_scale: float = 1.5
    score_func: str = "sqrtsoftplus"
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    bos_token_id: int = 0
    eos_token_id: int = 1
    # simulate the reference's FP8 activation quantization (1x128 blocks, power-of-two scales)
    quant_sim: bool = False

    def __post_init__(self):
        if not self.compress_ratios:
            object.__setattr__(self, "compress_ratios", default_compress_ratios(self.n_layers, first=0))
        problems = []
        if len(self.compress_ratios) != self.n_layers:
            problems.append(f"compress_ratios has {len(self.compress_ratios)} entries for {self.n_layers} layers")
        if any(r not in (0, 4) and r < 8 for r in self.compress_ratios):
            problems.append(f"compress_ratios {self.compress_ratios}: each must be 0, 4 (CSA) or >= 8 (HCA)")
        if self.n_heads % self.o_groups:
            problems.append(f"n_heads={self.n_heads} is not a multiple of o_groups={self.o_groups}")
        if not 0 < self.rope_head_dim <= self.head_dim or self.rope_head_dim % 2:
            problems.append(f"rope_head_dim={self.rope_head_dim} must be even and <= head_dim={self.head_dim}")
        if self.n_activated_experts > self.n_routed_experts:
            problems.append(f"n_activated_experts={self.n_activated_experts} > n_routed_experts={self.n_routed_experts}")
        if self.n_shared_experts != 1:
            problems.append(f"n_shared_experts={self.n_shared_experts}: DeepSeek-V4 has exactly one")
        if self.score_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            problems.append(f"unknown score_func {self.score_func!r}")
        if problems:
            raise ConfigError("; ".join(problems))

    @property
    def heads_per_group(self) -> int:
        return self.n_heads // self.o_groups

    def layer_kind(self, layer: int) -> str:
        r = self.compress_ratios[layer]
        return WINDOW if r == 0 else CSA if r == 4 else HCA

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.n_hash_layers

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["compress_ratios"] = list(self.compress_ratios)
        return d


def default_compress_ratios(n_layers: int, first: int = 0, n_first: int = 2) -> tuple[int, ...]:
    """Flash: L0-1 window only, then CSA/HCA alternating starting with CSA (L2=4, L3=128, ...)."""
    return tuple(first if i < n_first else (4 if i % 2 == 0 else 128) for i in range(n_layers))


FLASH = ModelConfig()
PRO = ModelConfig(
    dim=7168, n_layers=61, n_heads=128, q_lora_rank=1536, o_groups=16, index_topk=1024,
    n_routed_experts=384, moe_inter_dim=3072,
    compress_ratios=default_compress_ratios(61, first=128),
)


def tiny(n_layers: int = 6, **kw) -> ModelConfig:
    """A small config for tests: every layer kind, hash routing, a short window and short blocks so that
    a few hundred tokens cross the window and several compression blocks. 16 indexer heads keep exact
    score ties (all ReLU terms zero) improbable, so top-k picks do not depend on tie-breaking."""
    base = dict(
        vocab_size=256, dim=64, n_layers=n_layers, n_heads=8, head_dim=64, rope_head_dim=16, q_lora_rank=32,
        o_groups=4, o_lora_rank=32, window_size=16, index_n_heads=16, index_head_dim=16, index_topk=4,
        n_routed_experts=8, n_activated_experts=3, moe_inter_dim=32, n_hash_layers=min(3, n_layers),
        original_seq_len=64,
        compress_ratios=tuple(0 if i < 1 else (4 if i % 2 else 16) for i in range(n_layers)),
    )
    base.update(kw)
    return ModelConfig(**base)


def tiny_reuse() -> ModelConfig:
    """The reuse tests' model (CPU reference, the kernels under the interpreter and on GPU, bench/kernel_path_check.py):
    8 layers (window, then CSA and HCA alternating), room for 2 fences at each end around reusable layers of both
    compressed kinds; hash routing in the first 2."""
    return tiny(n_layers=8, n_hash_layers=2)


def demo(vocab_size: int) -> ModelConfig:
    """Small enough to prefill a few thousand tokens on two CPU cores in seconds, with the real window (128),
    real compression ratios (4 and 128) and every layer kind."""
    return ModelConfig(
        vocab_size=vocab_size, dim=256, n_layers=8, n_heads=8, head_dim=128, rope_head_dim=32, q_lora_rank=128,
        o_groups=4, o_lora_rank=128, index_n_heads=16, index_head_dim=32, index_topk=64, n_routed_experts=16,
        n_activated_experts=6, moe_inter_dim=128, original_seq_len=4096,
    )


PRESETS = {"flash": FLASH, "pro": PRO}

# ---------------------------------------------------------------- config.json dialects

_TYPE_TO_RATIO_KEY = {
    "sliding_attention": None,
    "compressed_sparse_attention": "compressed_sparse_attention",
    "heavily_compressed_attention": "heavily_compressed_attention",
}


def from_json_dict(d: dict) -> ModelConfig:
    """Read DeepSeek's official config.json or a transformers `DeepseekV4Config` dump."""
    try:
        n_layers = int(d["num_hidden_layers"])
        if "layer_types" in d and d["layer_types"]:
            rates = d.get("compress_rates") or {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
            ratios = tuple(0 if t == "sliding_attention" else int(rates[_TYPE_TO_RATIO_KEY[t]]) for t in d["layer_types"])
        else:
            ratios = tuple(int(r) for r in d["compress_ratios"][:n_layers])
        if "mlp_layer_types" in d and d["mlp_layer_types"]:
            n_hash = sum(1 for t in d["mlp_layer_types"] if t == "hash_moe")
        else:
            n_hash = int(d.get("num_hash_layers", 3))
        head_dim = int(d.get("head_dim", 512))
        if "qk_rope_head_dim" in d:
            rope_dim = int(d["qk_rope_head_dim"])
        else:
            rope_dim = int(round(head_dim * float(d.get("partial_rotary_factor", 64 / 512))))
        rp = d.get("rope_parameters") or {}
        yarn = rp.get("compress") if isinstance(rp.get("compress"), dict) else (d.get("rope_scaling") or {})
        compress_theta = float(yarn.get("rope_theta", d.get("compress_rope_theta", 160000.0)))
        main_theta = float((rp.get("main") or {}).get("rope_theta", d.get("rope_theta", 10000.0)))
        is_yarn = (yarn.get("rope_type") or yarn.get("type")) == "yarn"
        return ModelConfig(
            vocab_size=int(d["vocab_size"]), dim=int(d["hidden_size"]), n_layers=n_layers,
            n_heads=int(d["num_attention_heads"]), head_dim=head_dim, rope_head_dim=rope_dim,
            q_lora_rank=int(d["q_lora_rank"]), o_groups=int(d["o_groups"]), o_lora_rank=int(d["o_lora_rank"]),
            window_size=int(d["sliding_window"]), compress_ratios=ratios,
            rope_theta=main_theta, compress_rope_theta=compress_theta,
            rope_factor=float(yarn.get("factor", 1.0)) if is_yarn else 1.0,
            original_seq_len=int(yarn.get("original_max_position_embeddings", 0)) if is_yarn else 0,
            beta_fast=float(yarn.get("beta_fast") or 32), beta_slow=float(yarn.get("beta_slow") or 1),
            index_n_heads=int(d["index_n_heads"]), index_head_dim=int(d["index_head_dim"]),
            index_topk=int(d["index_topk"]),
            n_routed_experts=int(d["n_routed_experts"]), n_activated_experts=int(d["num_experts_per_tok"]),
            n_shared_experts=int(d.get("n_shared_experts", 1)), moe_inter_dim=int(d["moe_intermediate_size"]),
            n_hash_layers=n_hash, route_scale=float(d.get("routed_scaling_factor", 1.5)),
            score_func=str(d.get("scoring_func", "sqrtsoftplus")), swiglu_limit=float(d.get("swiglu_limit", 10.0)),
            hc_mult=int(d.get("hc_mult", 4)), hc_sinkhorn_iters=int(d.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(d.get("hc_eps", 1e-6)), norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            bos_token_id=int(d.get("bos_token_id") or 0), eos_token_id=_first(d.get("eos_token_id", 1)),
        )
    except KeyError as e:
        raise ConfigError(f"config.json lacks the key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"config.json has a bad value: {e}") from None


def _first(v) -> int:
    return int(v[0] if isinstance(v, (list, tuple)) else v)


def to_official_json(cfg: ModelConfig) -> dict:
    """The config.json DeepSeek ships (the subset our reader and the reference use)."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": 1, "head_dim": cfg.head_dim,
        "qk_rope_head_dim": cfg.rope_head_dim, "q_lora_rank": cfg.q_lora_rank, "o_groups": cfg.o_groups,
        "o_lora_rank": cfg.o_lora_rank, "sliding_window": cfg.window_size,
        "compress_ratios": list(cfg.compress_ratios) + [0], "rope_theta": cfg.rope_theta,
        "compress_rope_theta": cfg.compress_rope_theta,
        "rope_scaling": {"type": "yarn", "factor": cfg.rope_factor, "original_max_position_embeddings":
                         cfg.original_seq_len, "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow},
        "index_n_heads": cfg.index_n_heads, "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk,
        "n_routed_experts": cfg.n_routed_experts, "num_experts_per_tok": cfg.n_activated_experts,
        "n_shared_experts": 1, "moe_intermediate_size": cfg.moe_inter_dim, "num_hash_layers": cfg.n_hash_layers,
        "routed_scaling_factor": cfg.route_scale, "scoring_func": cfg.score_func, "swiglu_limit": cfg.swiglu_limit,
        "hc_mult": cfg.hc_mult, "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps,
        "rms_norm_eps": cfg.norm_eps, "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        "num_nextn_predict_layers": 0, "expert_dtype": "fp4",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    }


def load_config(path: str | Path) -> ModelConfig:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise ConfigError(f"{p}: no config.json")
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not JSON ({e})") from None
    try:
        return from_json_dict(d)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
