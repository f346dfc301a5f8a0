"""transformers' DeepseekV4ForCausalLM as a test oracle: our ModelConfig as a DeepseekV4Config, and our
official-named weights loaded into (and read back out of) its modules."""
from __future__ import annotations

import re

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from runtime.model.checkpoint import expected_shapes
from runtime.model.config import CSA, HCA, WINDOW, ModelConfig

_LAYER_TYPE = {WINDOW: "sliding_attention", CSA: "compressed_sparse_attention", HCA: "heavily_compressed_attention"}


def hf_config_for(cfg: ModelConfig) -> DeepseekV4Config:
    """The DeepseekV4Config of the same model. transformers has one HCA ratio per model, so every HCA layer
    of `cfg` must share one (128 when there is none)."""
    hca = sorted({r for r in cfg.compress_ratios if r not in (0, 4)})
    if len(hca) > 1:
        raise ValueError(f"transformers supports one HCA ratio per model, cfg has {hca}")
    n_hash = min(cfg.n_hash_layers, cfg.n_layers)
    return DeepseekV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, moe_intermediate_size=cfg.moe_inter_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, head_dim=cfg.head_dim,
        q_lora_rank=cfg.q_lora_rank, o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank,
        index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
        n_routed_experts=cfg.n_routed_experts, num_experts_per_tok=cfg.n_activated_experts,
        n_shared_experts=cfg.n_shared_experts, scoring_func=cfg.score_func, sliding_window=cfg.window_size,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": hca[0] if hca else 128},
        layer_types=[_LAYER_TYPE[cfg.layer_kind(i)] for i in range(cfg.n_layers)],
        mlp_layer_types=["hash_moe"] * n_hash + ["moe"] * (cfg.n_layers - n_hash),
        partial_rotary_factor=cfg.rope_head_dim / cfg.head_dim, rope_theta=cfg.rope_theta,
        compress_rope_theta=cfg.compress_rope_theta,
        rope_parameters={"rope_type": "yarn", "factor": cfg.rope_factor,
                         "original_max_position_embeddings": cfg.original_seq_len,
                         "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow},
        routed_scaling_factor=cfg.route_scale, swiglu_limit=cfg.swiglu_limit, hc_mult=cfg.hc_mult,
        hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, rms_norm_eps=cfg.norm_eps,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, num_nextn_predict_layers=0,
    )


# official name (after `layers.L.`) -> transformers module name (after `model.layers.L.`)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn", "hc_attn_base": "attn_hc.base", "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn", "hc_ffn_base": "ffn_hc.base", "hc_ffn_scale": "ffn_hc.scale",
    "attn.attn_sink": "self_attn.sinks",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    # transformers nests the indexer inside the CSA compressor
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_TOP_NAMES = {
    "embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight", "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")


def hf_module_name(name: str) -> str:
    """The transformers parameter/buffer holding official tensor `name` (routed experts excluded: they are
    slices of the packed `mlp.experts.gate_up_proj` / `down_proj`)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _LAYER.match(name)
    assert m and m.group(2) in _LAYER_NAMES, f"no transformers name for {name!r}"
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"


def hf_module_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Official-named weights -> the state dict of DeepseekV4ForCausalLM. Experts pack as
    gate_up_proj[e] = cat(w1, w3) (transformers chunks gate first) and down_proj[e] = w2."""
    out: dict[str, torch.Tensor] = {}
    for name in expected_shapes(cfg):
        m = _LAYER.match(name)
        if m and _EXPERT.match(m.group(2)):
            continue
        out[hf_module_name(name)] = state[name]
    E = cfg.n_routed_experts
    for L in range(cfg.n_layers):
        p = f"layers.{L}.ffn.experts."
        out[f"model.layers.{L}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([state[f"{p}{e}.w1.weight"], state[f"{p}{e}.w3.weight"]], dim=0) for e in range(E)])
        out[f"model.layers.{L}.mlp.experts.down_proj"] = torch.stack([state[f"{p}{e}.w2.weight"] for e in range(E)])
    return out


def official_from_hf_module_state(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of hf_module_state: a DeepseekV4ForCausalLM state dict under official names."""
    inter = cfg.moe_inter_dim
    out: dict[str, torch.Tensor] = {}
    for name in expected_shapes(cfg):
        m = _LAYER.match(name)
        e = _EXPERT.match(m.group(2)) if m else None
        if e is None:
            out[name] = sd[hf_module_name(name)]
            continue
        L, idx, w = m.group(1), int(e.group(1)), e.group(2)
        if w == "w2":
            out[name] = sd[f"model.layers.{L}.mlp.experts.down_proj"][idx]
        else:
            gate_up = sd[f"model.layers.{L}.mlp.experts.gate_up_proj"][idx]
            out[name] = gate_up[:inter] if w == "w1" else gate_up[inter:]
    return out


def hf_model_from_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> DeepseekV4ForCausalLM:
    """A float32, eval-mode DeepseekV4ForCausalLM holding exactly `state` (strict: every module tensor set)."""
    model = DeepseekV4ForCausalLM(hf_config_for(cfg)).float().eval()
    sd = {k: (v.float() if v.is_floating_point() else v) for k, v in hf_module_state(cfg, state).items()}
    model.load_state_dict(sd, strict=True)
    return model
