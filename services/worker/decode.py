"""Decoding after the prefill: each next token from the last logits, by argmax (temperature 0) or by sampling with
temperature and nucleus (top_p) from a generator seeded per request, so every TP rank draws the same token (their
logits are the same gathered tensor) and a seed repeats its answer. Tokens reach the caller one by one as they
exist (`emit`), and a request stops early when `stopped()` says so (its client went away, or a stop sequence
was met)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# why a request's decoding ended: its end-of-sequence token, its token budget, or its caller stopped it
FinishReason = str
STOP, LENGTH, CANCELLED = "stop", "length", "cancelled"


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0        # 0: greedy
    top_p: float = 1.0              # the smallest set of tokens whose probability reaches top_p is sampled from
    seed: int = 0                   # the generator's seed (used when temperature > 0)


class Sampler:
    def __init__(self, s: Sampling, device: torch.device):
        if not 0.0 <= s.temperature or not 0.0 < s.top_p <= 1.0:
            raise ValueError(f"temperature {s.temperature} must be >= 0 and top_p {s.top_p} in (0, 1]")
        self.s = s
        self.gen = None
        if s.temperature > 0:
            self.gen = torch.Generator(device=device)
            self.gen.manual_seed(s.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        logits = logits.reshape(-1)
        if self.gen is None:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / self.s.temperature, dim=-1)
        if self.s.top_p < 1.0:
            p, idx = probs.sort(descending=True)
            # keep a token while the mass before it is below top_p: the most likely token is always kept
            p = p * ((p.cumsum(-1) - p) < self.s.top_p)
            return int(idx[torch.multinomial(p, 1, generator=self.gen)])
        return int(torch.multinomial(probs, 1, generator=self.gen))


class Decoding:
    """One request's decoding, a token at a time (so that the worker can batch several requests' steps): the first
    token is drawn from the prefill's `logits` at construction; each `draw(logits)` takes the logits of the step
    that fed `last` (the worker's batched step, RankEngine.advance_all) and draws the next. `emit(token)` sees each
    token as soon as it is drawn; `eos` None does not end the answer."""

    def __init__(self, logits: torch.Tensor, n: int, eos: int | None, sample: Callable[[torch.Tensor], int],
                 emit: Callable[[int], None] | None = None):
        self.n, self.eos, self.sample, self.emit = n, eos, sample, emit
        self.tokens: list[int] = []
        self.finish: FinishReason | None = None
        self.draw(logits)

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def last(self) -> int:
        """The token the next step feeds."""
        return self.tokens[-1]

    def draw(self, logits: torch.Tensor) -> None:
        """The next token from `logits`: those of the step that fed `last`."""
        if self.done:
            raise ValueError(f"decoding already ended ({self.finish}): no token is drawn after it")
        nxt = self.sample(logits)
        self.tokens.append(nxt)
        if self.emit is not None:
            self.emit(nxt)
        if nxt == self.eos:
            self.finish = STOP
        elif len(self.tokens) == self.n:
            self.finish = LENGTH

    def cancel(self) -> None:
        """Its caller stopped it: it ends before another step runs (an ended decoding keeps its reason)."""
        if not self.done:
            self.finish = CANCELLED
