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


GREEDY = Sampling()


def decode(logits: torch.Tensor, step: Callable[[int], torch.Tensor], n: int, eos: int | None,
           sample: Callable[[torch.Tensor], int],
           emit: Callable[[int], None] | None = None,
           stopped: Callable[[], bool] | None = None) -> tuple[list[int], FinishReason]:
    """Up to `n` tokens from the prefill's `logits`; `step(token)` runs one decode step; `eos` None: it does not
    stop the answer. `emit(token)` sees each token as soon as it is drawn (before the next step runs); `stopped()`
    is asked before each further step."""
    out: list[int] = []
    with torch.inference_mode():
        while True:
            nxt = sample(logits)
            out.append(nxt)
            if emit is not None:
                emit(nxt)
            if nxt == eos:
                return out, STOP
            if len(out) == n:
                return out, LENGTH
            if stopped is not None and stopped():
                return out, CANCELLED
            logits = step(nxt)


def greedy(logits: torch.Tensor, step: Callable[[int], torch.Tensor], n: int, eos: int) -> list[int]:
    return decode(logits, step, n, eos, Sampler(GREEDY, logits.device))[0]
