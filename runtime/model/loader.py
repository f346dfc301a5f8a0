"""Build a model from a checkpoint directory (official DeepSeek layout or transformers layout)."""
from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import read_checkpoint
from .config import load_config
from .deepseek_v4 import Transformer
from .parallel import Parallel, check_geometry, rank_needs, shard_state


def load_model(path: str | Path, par: Parallel | None = None, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", q_chunk: int = 4096) -> Transformer:
    """Every tensor is validated by the reader before any is used; a rank reads only its own experts."""
    par = par or Parallel()
    cfg = load_config(path)
    check_geometry(cfg, par.size)
    state = read_checkpoint(path, cfg, keep=lambda name: rank_needs(cfg, par, name), dtype=dtype)
    with torch.device("meta"):
        model = Transformer(cfg, par, dtype, q_chunk)
    local = shard_state(cfg, par, state)
    # keep each tensor in the dtype the module declares (norms, hc mixes, sinks and compressor in float32)
    want = {k: v.dtype for k, v in model.state_dict().items()}
    local = {k: v.to(want[k]) if k in want else v for k, v in local.items()}
    model.load_state_dict(local, strict=True, assign=True)
    return model.to(device).eval()
