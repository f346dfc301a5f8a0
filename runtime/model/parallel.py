"""Tensor parallelism: which slice of each full tensor a rank owns, and the one collective the model uses.

Each rank owns whole output groups (heads, their sink, their W_a block, W_b's matching columns), an equal
share of the routed experts and of the shared expert's inner dim; everything else is replicated. Two
all-reduces per layer: after W_b and after the MoE.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .config import ModelConfig


@dataclass(frozen=True)
class Parallel:
    rank: int = 0
    size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_object(self, obj) -> list:
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    @staticmethod
    def from_env() -> "Parallel":
        if dist.is_available() and dist.is_initialized():
            return Parallel(dist.get_rank(), dist.get_world_size())
        return Parallel()


_EXPERT = re.compile(r"^layers\.\d+\.ffn\.experts\.(\d+)\.")


def check_geometry(cfg: ModelConfig, size: int) -> None:
    bad = [f"{name}={val}" for name, val in (("o_groups", cfg.o_groups), ("n_routed_experts", cfg.n_routed_experts),
                                             ("moe_inter_dim", cfg.moe_inter_dim)) if val % size]
    if bad:
        raise ValueError(f"tensor parallel size {size} must divide {', '.join(bad)}")


def rank_needs(cfg: ModelConfig, par: Parallel, name: str) -> bool:
    """False for tensors that belong wholly to other ranks (routed experts); lets the loader skip their bytes."""
    m = _EXPERT.match(name)
    if not m:
        return True
    e, per = int(m.group(1)), cfg.n_routed_experts // par.size
    return par.rank * per <= e < (par.rank + 1) * per


def _split(t: torch.Tensor, dim: int, par: Parallel) -> torch.Tensor:
    n = t.shape[dim] // par.size
    return t.narrow(dim, par.rank * n, n).contiguous()


def shard_tensor(cfg: ModelConfig, par: Parallel, name: str, t: torch.Tensor) -> torch.Tensor:
    """The rank's slice of the full tensor `name`."""
    if par.size == 1:
        return t
    if name.endswith(("attn.wq_b.weight", "attn.attn_sink", "attn.wo_a.weight")):
        return _split(t, 0, par)               # heads / whole groups
    if name.endswith("attn.wo_b.weight"):
        return _split(t, 1, par)               # row-parallel W_b
    if ".ffn.shared_experts." in name:
        return _split(t, 1 if name.endswith("w2.weight") else 0, par)
    return t


def shard_state(cfg: ModelConfig, par: Parallel, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: shard_tensor(cfg, par, k, v) for k, v in full.items() if rank_needs(cfg, par, k)}
