"""Offline producer: run a document alone at positions 0..n-1 and keep, per layer, what the consumer reuses."""
from __future__ import annotations

import torch

from runtime.model.deepseek_v4 import Transformer
from runtime.model.quant import quant_fp8_rows
from .artifact import DocumentArtifact, LayerArtifact
from .profile import ReuseProfile
from .roles import local_mask

PRODUCER_VERSION = "redknot-producer/1"


def padded_length(n: int, align: int) -> int:
    """A document of n tokens after `pad_document`: the next multiple of `align`."""
    return n + (-n) % align


def pad_document(tokens: list[int], align: int, pad_id: int) -> list[int]:
    """Documents are padded at the end with the pad token up to a multiple of `align`, so every segment
    start in a request stays aligned to compression blocks. The padding is part of the document's tokens
    and is identical in both arms."""
    return list(tokens) + [pad_id] * (padded_length(len(tokens), align) - len(tokens))


@torch.inference_mode()
def produce(model: Transformer, tokens: list[int], profile: ReuseProfile, pad_id: int | None = None) -> DocumentArtifact:
    cfg = model.cfg
    profile.check(cfg)
    pad_id = cfg.eos_token_id if pad_id is None else pad_id
    padded = pad_document(tokens, profile.align, pad_id)
    dev = model.embed.weight.device
    ids = torch.tensor(padded, device=dev)
    cache = model.new_cache()
    keep_local = local_mask(cfg, profile, model.layers[0].attn.n_heads, model.par.rank).to(dev)
    for i, lc in enumerate(cache.layers):
        lc.capture = {} if profile.is_fence(cfg, i) else {"local_mask": keep_local}
    model(ids, cache)
    layers = []
    for i, (block, lc) in enumerate(zip(model.layers, cache.layers)):
        cap = lc.capture
        art = LayerArtifact(latent=cap["latent"].clone())
        if block.attn.compressor is not None:
            st = lc.compressor
            art.entries = st.entries.clone()
            if st.prev_kv is not None:
                art.comp_prev = (st.prev_kv.clone(), st.prev_gate.clone())
        if block.attn.indexer is not None:
            st = lc.indexer
            art.index_keys = st.entries.clone()
            if st.prev_kv is not None:
                art.index_prev = (st.prev_kv.clone(), st.prev_gate.clone())
            if profile.global_picks == "artifact" and not profile.is_fence(cfg, i):
                art.picks = cap["topk"].to(torch.int32).clone()
        if not profile.is_fence(cfg, i):
            art.local_p = cap["local_p"]
            if profile.local_format == "fp8":
                art.local_p, art.local_s = quant_fp8_rows(art.local_p)
        layers.append(art)
        lc.capture = None
    return DocumentArtifact(tokens=padded, n_content=len(tokens), layers=layers, tp_rank=model.par.rank,
                            tp_size=model.par.size, meta={"profile": profile.to_dict(),
                                                          "producer_version": PRODUCER_VERSION,
                                                          "dtype": str(model.dtype).replace("torch.", "")})
