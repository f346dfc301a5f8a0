"""One reuse engine for every model family: DeepSeek-V4 (`runtime/reuse/deepseek.py`) and the Llama family
(Llama, Qwen2, SmolLM2: `runtime/llama/adapter.py`) share the request loop (`loop.run_pass`), the controller and
its rules (`controller.choose`), the certificate check (`certificate.validate`), greedy decoding and the ledger's
row namespaces; what differs per model (attention shape, output projection, FFN, what an artifact holds, the FLOP
model) sits behind the family's adapter.

Arms: `reuse` (SPEC §5) and, on the Llama family, `naive` (every document row's K/V from its artifact, relocated,
only the new rows computed: what position-independent caches without recomputation do); the recompute arm is the
model's own forward."""
from __future__ import annotations

import torch

from .certificate import Verdict, token_hash, validate
from .greedy import greedy
from .loop import ReuseResult, run_pass
from .profile import ReuseProfile

MODES = ("reuse", "naive")


def adapter_for(model, profile: ReuseProfile, mode: str, **kw):
    """The model family's adapter: DeepSeek-V4 (`Transformer`) or the Llama family (`Llama`)."""
    from runtime.model.deepseek_v4 import Transformer
    if isinstance(model, Transformer):
        from .deepseek import DeepSeekAdapter
        return DeepSeekAdapter(model, profile, mode, **kw)
    from runtime.llama.model import Llama
    if isinstance(model, Llama):
        from runtime.llama.adapter import LlamaAdapter
        return LlamaAdapter(model, profile, mode, **kw)
    raise TypeError(f"no reuse adapter for a {type(model).__name__} (DeepSeek-V4 Transformer, Llama)")


class ReuseEngine:
    """The reuse path over one model and profile. It holds only what every request shares (the adapter: the
    model, the profile, the roles of its heads); each call's state is its own, so concurrent requests may share
    one engine. `tokenizer_fp`, `fingerprint`: what `verify` binds artifacts to besides their tokens and the
    profile ("" where the caller has none). Adapter keywords (`split_heads` on the Llama family) pass through."""

    def __init__(self, model, profile: ReuseProfile, mode: str = "reuse", tokenizer_fp: str = "",
                 fingerprint: str = "", **adapter_kw):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} not in {MODES}")
        self.model, self.profile, self.mode = model, profile, mode
        self.tokenizer_fp, self.fingerprint = tokenizer_fp, fingerprint
        self.adapter = adapter_for(model, profile, mode, **adapter_kw)

    @property
    def cfg(self):
        return self.model.cfg

    def verify(self, docs) -> Verdict:
        """Each artifact's certificate, checked by the shared `certificate.validate`: this model's fingerprint,
        dtype, geometry and producer, its own tokens, this profile, every layer; the first reject. (The serving
        path checks stored artifacts against their store generation: `runtime/reuse/request.py`.)"""
        expect = self.adapter.expectations(self.fingerprint)
        expect.setdefault("profile", self.profile)
        for d in docs:
            v = validate(d.cert, **expect, tokens_hash=token_hash(d.tokens, self.tokenizer_fp), current_generation=0)
            if not v.ok:
                return v
        return Verdict.accept()

    # ------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, docs, question: list[int], active: torch.Tensor | None = None) -> ReuseResult:
        """The request's prefill through the reuse path: every segment where it lies, each reached by queries
        turned to its frame and merged by log-sum-exp (SPEC §5). `active`: a bool mask over the relocated rows to
        use as the active rows instead of the profile's rule (tests and benchmarks comparing two paths on the
        same rows); the first fences still run and are counted as always."""
        with self.adapter.scope():
            return run_pass(self.adapter.begin(docs, question), active, naive=self.mode == "naive")

    @torch.inference_mode()
    def prefill_cache(self, docs, question: list[int], reloc=None, active: torch.Tensor | None = None) -> ReuseResult:
        """`prefill` on the request's own KV cache, relocated once (families whose artifacts may be moved: the
        Llama family; DeepSeek-V4's are read in place and refuse). `reloc`: the relocated K/V, where the caller
        shares them between arms. The result's state is a cache the model's own forward continues."""
        with self.adapter.scope():
            return run_pass(self.adapter.cache_pass(docs, question, reloc), active, naive=self.mode == "naive")

    @torch.inference_mode()
    def decode_batch(self, states: list, tokens: list[int]) -> torch.Tensor:
        """One new row for each of B requests after their prefills through this engine; their logits [B, V]."""
        if not states or len(states) != len(tokens):
            raise ValueError(f"decode_batch: {len(tokens)} tokens for {len(states)} requests")
        return self.adapter.decode_batch(states, tokens)

    @torch.inference_mode()
    def decode(self, state, token: int) -> torch.Tensor:
        """One new row after a prefill (`decode_batch` of this request alone)."""
        return self.decode_batch([state], [token])[0]

    @torch.inference_mode()
    def generate(self, docs, question: list[int], max_new_tokens: int, stop: set[int] | None = None,
                 cache: bool = False, keep_stop: bool = False) -> tuple[list[int], ReuseResult]:
        """Greedy answer: `prefill` (or `prefill_cache`), then decode steps over the request's state. `stop`: the
        tokens that end it (default: the model's end-of-sequence tokens)."""
        res = self.prefill_cache(docs, question) if cache else self.prefill(docs, question)
        stop = self.adapter.stop_tokens() if stop is None else stop
        return greedy(res.logits, lambda t: self.decode(res.state, t), max_new_tokens, stop, keep_stop), res
