"""Greedy decoding after a prefill, the same for every engine and arm: only how a step is taken differs."""
from __future__ import annotations

from typing import Callable

import torch


def greedy(logits: torch.Tensor, step: Callable[[int], torch.Tensor], max_new_tokens: int, stop: set[int],
           keep_stop: bool = False) -> list[int]:
    """Up to `max_new_tokens` argmax tokens from the first token's `logits`; `step(token)` returns the logits
    after it. A token in `stop` ends the answer without a step after it (it is part of the answer with
    `keep_stop`)."""
    out = []
    for _ in range(max_new_tokens):
        nxt = int(logits.argmax())
        if nxt in stop:
            if keep_stop:
                out.append(nxt)
            break
        out.append(nxt)
        logits = step(nxt)
    return out
