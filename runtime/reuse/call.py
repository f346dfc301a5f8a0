"""What one call of the DeepSeek-V4 reuse adapter carries (a prefill, a decode step, or the question's draft
pass): its own state, made by the call and passed down explicitly, so one engine serves several requests at once,
and the request state a prefill hands to decode."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.model.deepseek_v4 import Block, CompressorState, LayerCache
from .artifact import DocumentArtifact
from .keys import SegmentKeys
from .ledger import Ledger
from .rows import Rows, Split


@dataclass
class RequestState:
    """Everything a request needs to keep decoding: native caches for fence layers, segment keys (artifact +
    overlay) for reusable layers, and the new-rows segment's own latent and compressor state."""
    fence_caches: dict[int, LayerCache]
    seg_keys: dict[int, list[SegmentKeys]]              # reusable layer -> prefix + relocated segments
    new_latent: dict[int, torch.Tensor]
    new_comp: dict[int, CompressorState]
    new_index: dict[int, CompressorState]
    new_delta: int
    pos: int


@dataclass
class Call:
    """One call's own state (a prefill, or one decode step), made by the call and passed down explicitly: the
    engine keeps nothing per request, so one engine serves several requests at once. `docs`: the request's
    documents (None in a decode step); `ledger`: where the call's counts go (None: not counted), those that are
    device tensors deferred to `flush`, once at the end of the request (no per-layer sync)."""
    docs: list[DocumentArtifact] | None
    ledger: Ledger | None
    deferred: list = field(default_factory=list)

    def defer(self, method: str, *args) -> None:
        if self.ledger is not None:
            self.deferred.append((getattr(self.ledger, method), args))

    def flush(self) -> None:
        calls, self.deferred = self.deferred, []
        tensors = [a for _, args in calls for a in args if isinstance(a, torch.Tensor)]
        vals = iter(torch.stack([t.double() for t in tensors]).tolist()) if tensors else iter(())
        for fn, args in calls:
            fn(*[next(vals) if isinstance(a, torch.Tensor) else a for a in args])


@dataclass(frozen=True)
class LayerRows:
    """What one layer's pass over a call's rows takes (`ReuseEngine._rows`): the layer, the rows' streams and
    attention input, the call's row plan, and where the other rows' Local contribution comes from."""
    i: int
    block: Block
    x: torch.Tensor                 # [M, hc, D] the rows' residual streams
    hn: torch.Tensor                # [M, D] their normed attention input
    post: torch.Tensor              # hc_pre's weights, for hc_post
    comb: torch.Tensor
    tokens: torch.Tensor
    sp: Split
    n_reloc: int                    # rows [0, n_reloc) are relocated rows, the rest new rows
    restore: bool                   # the other rows' W_a,L O_L restored from the call's documents
    fence: bool

    @property
    def rest(self) -> Rows | None:
        """The other rows, where this layer computes them (an artifact-KV fence does not)."""
        return None if self.fence else self.sp.rest


