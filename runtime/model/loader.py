"""Build a model from a checkpoint directory (official DeepSeek layout or transformers layout), or from a
random-init spec (`random_init.py`: config, tokenizer and a seed; no weight files)."""
from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import read_checkpoint
from .config import load_config
from .deepseek_v4 import Transformer
from .parallel import Parallel, check_geometry, rank_needs, shard_state
from .random_init import init_random, read_spec


def load_model(path: str | Path, par: Parallel | None = None, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", q_chunk: int = 4096) -> Transformer:
    """Every tensor is validated by the reader before any is used; a rank reads only its own experts."""
    par = par or Parallel()
    cfg = load_config(path)
    check_geometry(cfg, par.size)
    spec = read_spec(path)
    if spec is not None:
        if par.size != 1:
            # each rank would draw its own shard from the parameter's name: not the shards of one TP=1 model
            raise ValueError(f"{path}: a random-init checkpoint serves TP 1 only (asked for TP {par.size})")
        if spec["device"] == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"{path}: its weights are drawn on CUDA, and this process has no GPU")
        draw = torch.device(device) if torch.device(device).type == spec["device"] else torch.device(spec["device"])
        with torch.device(device):
            model = Transformer(cfg, par, dtype, q_chunk)
        init_random(model, spec["seed"], per_name=True, device=draw)
        return model.eval()
    state = read_checkpoint(path, cfg, keep=lambda name: rank_needs(cfg, par, name), dtype=dtype)
    with torch.device("meta"):
        model = Transformer(cfg, par, dtype, q_chunk)
    local = shard_state(cfg, par, state)
    # keep each tensor in the dtype the module declares (norms, hc mixes, sinks and compressor in float32)
    want = {k: v.dtype for k, v in model.state_dict().items()}
    local = {k: v.to(want[k]) if k in want else v for k, v in local.items()}
    model.load_state_dict(local, strict=True, assign=True)
    return model.to(device).eval()
