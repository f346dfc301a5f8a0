"""GPU kernels (Triton) for the consumer's attention, the N-way LSE merge and the lightning indexer.

Each kernel sits beside a torch reference (`reference.py`, built from the model's own functions) and is compared
with it by `tests/kernels/test_kernels_gpu.py` on the device machine. Importable everywhere: on a machine without
Triton or without CUDA, `available()` is False and the reference path is what callers use.

    from runtime.kernels import available, sparse_mqa_attention, merge_lse, indexer_topk
"""
from __future__ import annotations

import os

import torch

from ._triton import HAVE_TRITON, available
from .indexer import indexer_scores, indexer_topk
from .merge import merge_lse, merge_stacked
from .rope import rope_
from .sparse_attention import sparse_mqa_attention

__all__ = ["HAVE_TRITON", "available", "enabled", "sparse_mqa_attention", "merge_lse", "merge_stacked", "rope_",
           "indexer_scores", "indexer_topk"]


def enabled(t: torch.Tensor) -> bool:
    """The one switch between the fast path and the reference path: Triton kernels for CUDA tensors unless
    REDKNOT_KERNELS=0 (then, and on CPU, the torch reference path runs)."""
    return t.is_cuda and available() and os.environ.get("REDKNOT_KERNELS", "1") != "0"
