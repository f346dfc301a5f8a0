"""Execution roles of heads: in each output group the first `global_per_group` heads are Global (computed
online), the rest Local (restored). Roles are by position in the group, so every TP rank, which owns whole
groups, derives the same roles for its heads."""
from __future__ import annotations

import torch

from runtime.model.config import ModelConfig
from .profile import ReuseProfile


def global_mask(cfg: ModelConfig, profile: ReuseProfile, n_local_heads: int, rank: int = 0) -> torch.Tensor:
    """Bool [n_local_heads]: True for Global heads of this rank's groups."""
    in_group = torch.arange(n_local_heads) % cfg.heads_per_group
    return in_group < profile.global_per_group


def local_mask(cfg: ModelConfig, profile: ReuseProfile, n_local_heads: int, rank: int = 0) -> torch.Tensor:
    return ~global_mask(cfg, profile, n_local_heads, rank)


def channel_range(cfg: ModelConfig, rank: int, size: int) -> tuple[int, int]:
    """The projected-state channels (of G x o_lora_rank) whose W_a,L O_L this rank holds."""
    width = cfg.o_groups * cfg.o_lora_rank // size
    return rank * width, (rank + 1) * width
