"""What the producer keeps for one document, in memory. Serialization and certificates: store.py, certificate.py.

A document is run alone at positions 0..n-1 (n padded up to the profile's alignment with the pad token), so
nothing here depends on where the document lands in a request."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class Owner(enum.Enum):
    """Who may write a LayerArtifact's tensors, said by whoever makes it (never guessed from where it came from)."""
    CALLER = "caller"         # the caller's (loaded, produced, in the hot tier): a request copies before writing
    REQUEST = "request"       # one request's own copy (staged for it, `owned_copy`): the engine overlays in place


@dataclass
class LayerArtifact:
    latent: torch.Tensor                      # [n, D] packed K=V latent of every row, RoPE at canonical positions
    entries: torch.Tensor | None = None       # [N, D] compressed entries (CSA / HCA layers)
    index_keys: torch.Tensor | None = None    # [N, index_head_dim] compressed indexer keys (CSA layers)
    # boundary metadata: the compressor's overlap half of the last complete block (CSA), pre-RoPE
    comp_prev: tuple[torch.Tensor, torch.Tensor] | None = None
    index_prev: tuple[torch.Tensor, torch.Tensor] | None = None
    local_p: torch.Tensor | None = None       # [n, G_local * o_lora_rank] W_a,L O_L, reusable layers, this rank
    picks: torch.Tensor | None = None         # [n, k] int32 offline indexer top-k (CSA, global_picks="artifact")
    # local_format="fp8": local_p holds float8_e4m3fn codes and local_s [n, ceil(C/128)] their uint8 E8M0 exponents,
    # one per row and 128 channels (`runtime.model.quant.quant_fp8_rows`); None for the native format
    local_s: torch.Tensor | None = None
    owner: Owner = field(default=Owner.CALLER, compare=False)


@dataclass
class KVLayerArtifact:
    """The Llama family's layer in the store format (runtime/llama/artifacts.py): K/V of every row at canonical
    positions (K with RoPE) and, in reusable layers, the Local heads' output projection W_o,L O_L; TP1 only."""
    k: torch.Tensor                           # [n, KV, D]
    v: torch.Tensor                           # [n, KV, D]
    local_p: torch.Tensor | None = None       # [n, d]
    local_s: torch.Tensor | None = None       # local_format="fp8": local_p's E8M0 scales, as LayerArtifact's
    owner: Owner = field(default=Owner.CALLER, compare=False)


@dataclass
class DocumentArtifact:
    tokens: list[int]                         # padded token ids the artifact was built on
    n_content: int                            # tokens before padding
    layers: list[LayerArtifact] | list[KVLayerArtifact]
    tp_rank: int = 0
    tp_size: int = 1
    meta: dict = field(default_factory=dict)  # profile, fingerprints, dtype, producer version, generation

    @property
    def n(self) -> int:
        return len(self.tokens)

