"""The tests' tiny DeepSeek-V4 model, built one way everywhere: a config (tiny_reuse unless a test needs another
shape), the seeded random checkpoint state of `runtime.model.checkpoint.random_state` loaded into it, on the CPU
or, where a test asks for it, on CUDA with the Triton kernels (skipped where there is none)."""
from __future__ import annotations

import pytest
import torch

from runtime.model.checkpoint import random_state
from runtime.model.config import ModelConfig, tiny_reuse
from runtime.model.deepseek_v4 import Transformer


def tiny_model(cfg: ModelConfig | None = None, seed: int = 1, device: str = "cpu") -> Transformer:
    cfg = cfg or tiny_reuse()
    if device == "cuda":
        import runtime.kernels as K
        if not (torch.cuda.is_available() and K.available()):
            pytest.skip("needs CUDA and Triton")
    with torch.device(device):
        m = Transformer(cfg)
    m.load_state_dict(random_state(cfg, seed=seed))
    return m.eval()
