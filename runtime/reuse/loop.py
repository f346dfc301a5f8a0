"""The reuse path's request loop, written once for every model family (SPEC §5): layer by layer, a fence layer
recomputes every row from its hidden state (the first fences also measure each relocated row's deviation, and on
DeepSeek-V4 the native indexer's interest in it); at the first reusable layer the profile's rule
(`controller.fill_order`, or the caller's rows) orders the relocated rows once for the request; every reusable
layer then computes the first rows of that order (its budget's worth: one budget, or budgets falling over the
layers, `ReuseProfile.budget_slope`) and the new ones in full, and restores the others.

What a layer does is the family's: a `Pass` is one prefill of one request on one model adapter (DeepSeek-V4's
`runtime/reuse/deepseek.py`, the Llama family's `runtime/llama/adapter.py`), holding that prefill's own state, so
concurrent requests never share one. `ReuseEngine` (engine.py) makes the pass and runs it through `run_pass`."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from .controller import budget_rows, check_active, fill_order, first_rows
from .profile import ReuseProfile


@dataclass
class ReuseResult:
    logits: torch.Tensor                       # [V] the last row's next-token logits
    ledger: Any                                # the family's ledger (ledger.Ledger, LlamaLedger)
    active_rows: torch.Tensor                  # request positions of the active relocated rows
    state: Any                                 # what decoding continues from (the family's request state)


class Pass(ABC):
    """One prefill of one request: documents (prefix first, then the relocated ones at `deltas`), question rows
    from `q_start`. The first fences add to `deviation` (and `idx_score`, where the family has a native indexer),
    one value per relocated row; `active` is set once, at the first reusable layer."""

    def __init__(self, profile: ReuseProfile, doc_lens: list[int], deltas: list[int], n_q: int, n_layers: int,
                 device):
        self.profile, self.doc_lens, self.deltas, self.n_q, self.n_layers = profile, doc_lens, deltas, n_q, n_layers
        self.q_start = deltas[-1] + doc_lens[-1]
        self.n_reloc = self.q_start - doc_lens[0]
        self.deviation = torch.zeros(self.n_reloc, device=device)
        self.idx_score: torch.Tensor | None = None
        self.active: torch.Tensor | None = None

    def signals(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the rule ranks by: the first fences' deviation and indexer score (where the family has one)."""
        return self.deviation, self.idx_score

    @abstractmethod
    def is_fence(self, i: int) -> bool:
        """Layer i recomputes every row from its hidden state."""

    @abstractmethod
    def fence(self, i: int, signals: bool) -> None:
        """Fence layer i over every computed row; with `signals` (a first fence with relocated rows), each
        relocated row's deviation (and indexer score) added to this pass's."""

    @abstractmethod
    def draft(self) -> torch.Tensor:
        """[n_reloc] the question's draft attention over the relocated rows (`select="attention"`)."""

    @abstractmethod
    def activate(self, active: torch.Tensor) -> None:
        """The active relocated rows (a bool mask), once, before the first reusable layer: the rows the request
        reports as chosen."""

    def narrow(self, active: torch.Tensor) -> None:
        """Fewer active rows (a subset of the current ones) from the next reusable layer on (per-layer budgets)."""
        raise NotImplementedError(f"{type(self).__name__} runs one budget for every layer")

    @abstractmethod
    def reusable(self, i: int) -> None:
        """Reusable layer i (or a last fence that takes non-active rows' KV from the artifacts)."""

    @abstractmethod
    def finish(self) -> ReuseResult:
        """The last row's logits, the ledger, the active rows' positions and the state decoding continues."""


def run_pass(p: Pass, given: torch.Tensor | None = None, naive: bool = False) -> ReuseResult:
    """The request loop over every layer of `p`. `given`: a bool mask over the relocated rows used as the active
    rows of every reusable layer instead of the profile's rule (tests and studies comparing paths on the same
    rows); `naive`: no rows are chosen (the naive arm: every relocated row from its artifact). The k-th of the
    profile's R reusable layers computes the first `budget_rows(layer_budget(k, R))` rows of the rule's order; the
    last fences that take non-active rows' K/V from the artifacts keep the last reusable layer's rows."""
    prof = p.profile
    if given is not None and naive:
        raise ValueError("an active mask was given to the naive arm: the naive arm takes none")
    if given is not None:
        given = check_active(given, p.n_reloc)
    first, last = prof.first_fences, p.n_layers - prof.last_fences
    order, rows = None, 0
    for i in range(p.n_layers):
        if p.is_fence(i):
            p.fence(i, signals=i < prof.first_fences and p.n_reloc > 0)
            continue
        if p.active is None:
            if naive:
                p.activate(torch.zeros(p.n_reloc, dtype=torch.bool))
            elif given is not None:
                p.activate(given)
            else:
                rows = budget_rows(prof.layer_budget(0, last - first), p.n_reloc)
                order = fill_order(prof, *p.signals(), p.draft, p.doc_lens[1:], p.deltas[1:], p.q_start, p.n_q,
                                   rows)
                p.activate(first_rows(order, p.n_reloc, rows))
        elif order is not None and first <= i < last:
            k = budget_rows(prof.layer_budget(i - first, last - first), p.n_reloc)
            if k < rows:
                rows = k
                p.narrow(first_rows(order, p.n_reloc, rows))
        p.reusable(i)
    return p.finish()
