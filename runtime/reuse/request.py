"""One request end to end on one TP rank: load and verify each document's artifact, agree across ranks with one
collective, then run the reuse path, or fall back, explicitly and counted, to full recomputation of the same
(padded) tokens. A reuse-arm result always says which arm really ran."""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime.model.deepseek_v4 import Transformer
from .certificate import Certificate, FallbackCounter, FallbackReason, Verdict, agree, digest_bytes, token_hash
from .consumer import ReuseEngine
from .ledger import Ledger
from .producer import PRODUCER_VERSION, pad_document, produce
from .profile import ReuseProfile
from .roles import channel_range
from .store import CERTIFICATE_FILE, load_artifact, save_artifact


@dataclass(frozen=True)
class ServingIdentity:
    """What every artifact must be bound to: the checkpoint fingerprint and the tokenizer's."""
    fingerprint: str
    tokenizer_fingerprint: str


@dataclass
class Outcome:
    logits: torch.Tensor
    arm: str                                  # "reuse" or "recompute": what really ran
    verdict: Verdict
    ledger: Ledger | None
    # continues this request by one token in the arm that ran (reuse: ReuseEngine.decode over the kept request
    # state; recompute: the native cache of the full prefill) and returns the next logits; no second prefill
    step: Callable[[int], torch.Tensor] | None = field(default=None, repr=False)

    @property
    def fell_back(self) -> bool:
        return self.arm != "reuse"


def build(model: Transformer, tokens: list[int], profile: ReuseProfile, ident: ServingIdentity,
          directory: str | os.PathLike, generation: int = 1) -> Path:
    """Producer + store: one document's artifact for this rank, certified."""
    art = produce(model, tokens, profile)
    par = model.par
    save_artifact(art, directory, dict(
        fingerprint=ident.fingerprint, token_hash=token_hash(art.tokens, ident.tokenizer_fingerprint),
        profile=profile.to_dict(), channel_range=channel_range(model.cfg, par.rank, par.size),
        dtype=art.meta["dtype"], producer_version=PRODUCER_VERSION, generation=generation))
    return Path(directory)


@torch.inference_mode()
def answer(model: Transformer, profile: ReuseProfile, docs: list[list[int]], artifact_dirs: list[str | os.PathLike],
           question: list[int], ident: ServingIdentity, current_generation: int | Sequence[int],
           counter: FallbackCounter | None = None) -> Outcome:
    """`current_generation`: one for every document, or one per document (documents are rebuilt independently)."""
    cfg, par = model.cfg, model.par
    padded = [pad_document(d, profile.align, cfg.eos_token_id) for d in docs]
    gens = [current_generation] * len(docs) if isinstance(current_generation, int) else list(current_generation)
    assert len(gens) == len(docs), f"{len(gens)} current generations for {len(docs)} documents"
    expect = dict(fingerprint=ident.fingerprint, profile=profile.to_dict(), tp_size=par.size, tp_rank=par.rank,
                  channel_range=channel_range(cfg, par.rank, par.size), layers_needed=list(range(cfg.n_layers)))
    arts, bindings, verdict = [], [], Verdict.accept()
    for toks, d, gen in zip(padded, artifact_dirs, gens):
        art, v = load_artifact(d, dict(expect, current_generation=gen,
                                       tokens_hash=token_hash(toks, ident.tokenizer_fingerprint)))
        if not v.ok:
            verdict = v
            break
        arts.append(art)
        bindings.append(Certificate.from_bytes((Path(d) / CERTIFICATE_FILE).read_bytes()).binding_digest())
    # the one agreement collective, before any reuse-specific collective: all ranks reuse or none does, and
    # ranks that accept must have accepted the same artifacts (same binding digest)
    verdict = agree(verdict, par, binding=digest_bytes("|".join(bindings).encode()) if verdict.ok else None)
    if verdict.ok:
        engine = ReuseEngine(model, profile)
        res = engine.prefill(arts, question)
        return Outcome(res.logits, "reuse", verdict, res.ledger, step=lambda t: engine.decode(res.state, t))
    if counter is not None:
        counter.observe(verdict)
    dev = model.embed.weight.device
    full = torch.tensor([t for p in padded for t in p] + list(question), device=dev)
    cache = model.new_cache()
    return Outcome(model(full, cache), "recompute", verdict, None,
                   step=lambda t: model(torch.tensor([t], device=dev), cache))
