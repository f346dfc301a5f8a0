"""What differs between the model families the services serve (DeepSeek-V4, `runtime/model`; the Llama family,
`runtime/llama`) at the edges of a request: loading a checkpoint, what its artifacts must be certified for, how a
document's artifact is built into a store directory, and the facts a worker sizes itself by. The reuse math
behind one engine is the adapters' (`runtime/reuse/engine.py`); everything here is a dispatch on the model."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from runtime.model.parallel import Parallel
from runtime.reuse.profile import ProfileError, ReuseProfile


class FamilyError(ValueError):
    """A checkpoint or a setting this family cannot serve (e.g. the Llama family under TP > 1)."""


def checkpoint_family(path: str | os.PathLike) -> str:
    """The family of a checkpoint directory: config.json's model_type "deepseek_v4", else the Llama family."""
    try:
        model_type = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as e:
        raise FamilyError(f"{path}: no readable config.json ({e})") from None
    return "deepseek_v4" if model_type == "deepseek_v4" else "llama"


def load_checkpoint(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    par: Parallel | None = None):
    """The checkpoint in `path`, of either family, in `dtype` on `device` (`par`: this rank's TP shard; the Llama
    family is served at TP1 only)."""
    if checkpoint_family(path) == "deepseek_v4":
        from runtime.model.loader import load_model
        return load_model(path, par=par, dtype=dtype, device=device).eval()
    if par is not None and par.size > 1:
        raise FamilyError(f"{path}: a Llama-family checkpoint is served at TP1 (asked for TP{par.size})")
    from runtime.llama.loader import load_llama
    return load_llama(path, dtype=dtype, device=device)


def family(model) -> str:
    from runtime.model.deepseek_v4 import Transformer
    return "deepseek_v4" if isinstance(model, Transformer) else "llama"


def device_of(model) -> torch.device:
    return next(model.parameters()).device


def prefill(model, tokens: torch.Tensor, cache) -> torch.Tensor:
    """A request's own forward over its whole prompt into `cache` (the recompute arm): DeepSeek-V4 in chunks of its
    policy's `prefill_chunk` (one forward when 0), the Llama family in one forward."""
    return model.prefill(tokens, cache) if family(model) == "deepseek_v4" else model(tokens, cache)


def channel_range(model, rank: int = 0, size: int = 1) -> tuple[int, int]:
    """The channels of the stored Local contribution this rank holds (the Llama family: all, at TP1)."""
    if family(model) == "deepseek_v4":
        from runtime.reuse.roles import channel_range as v4_range
        return v4_range(model.cfg, rank, size)
    return 0, model.cfg.hidden_size


def check_profile(profile: ReuseProfile, model) -> None:
    """`profile` can run on `model` (raises ProfileError otherwise). A preamble runs on the Llama family only
    (`ReuseProfile.check` refuses it on DeepSeek-V4); its token ids must be the model's."""
    if family(model) == "deepseek_v4":
        profile.check(model.cfg)
        return
    if profile.align != 1:
        raise ProfileError(f"profile {profile.name!r}: align={profile.align}; the Llama family has no compression "
                           "blocks to align documents to (align=1)")
    bad = sorted({t for t in profile.preamble if not 0 <= t < model.cfg.vocab_size})
    if bad:
        raise ProfileError(f"profile {profile.name!r}: preamble token ids {bad[:8]} are outside the vocabulary "
                           f"[0, {model.cfg.vocab_size})")
    from runtime.llama.adapter import LlamaAdapter
    LlamaAdapter(model, profile)                # its own checks: fences, FFN mode, Global heads per group


def expectations(model, profile: ReuseProfile, fingerprint: str) -> dict:
    """What this rank requires of every artifact certificate (`certificate.validate`'s keywords but the tokens hash
    and generation): the model's fingerprint, TP geometry, layers, dtype, producer, and `profile`."""
    if family(model) == "deepseek_v4":
        from runtime.reuse.deepseek import expectations as v4
        return v4(model, profile, fingerprint)
    from runtime.llama.artifacts import expectations as llama
    return dict(llama(model, fingerprint), profile=profile.to_dict())


def build(model, tokens: list[int], profile: ReuseProfile, fingerprint: str, tokenizer_fp: str,
          directory: str | os.PathLike, generation: int = 1) -> Path:
    """One document's artifact for this rank, produced and certified in `directory` (the builder's job)."""
    if family(model) == "deepseek_v4":
        from runtime.reuse.certificate import token_hash
        from runtime.reuse.producer import PRODUCER_VERSION, produce
        from runtime.reuse.store import save_artifact
        art = produce(model, tokens, profile)
        save_artifact(art, directory, dict(
            fingerprint=fingerprint, token_hash=token_hash(art.tokens, tokenizer_fp), profile=profile.to_dict(),
            channel_range=channel_range(model, model.par.rank, model.par.size), dtype=art.meta["dtype"],
            producer_version=PRODUCER_VERSION, generation=generation))
        return Path(directory)
    from runtime.llama.artifacts import build as llama_build
    return llama_build(model, tokens, profile, fingerprint, tokenizer_fp, directory, generation)
