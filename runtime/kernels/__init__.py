"""GPU kernels (Triton) for the consumer's attention, the N-way LSE merge and the lightning indexer.

Each kernel sits beside a torch reference (`reference.py`, built from the model's own functions) and is compared
with it by `tests/kernels/test_kernels_gpu.py` on the device machine. Importable everywhere: on a machine without
Triton or without CUDA, `available()` is False and the reference path is what callers use.

    from runtime.kernels import available, sparse_mqa_attention, merge_lse, indexer_topk
"""
from __future__ import annotations

from ._triton import HAVE_TRITON, available, enabled
from .indexer import indexer_scores, indexer_scores_parts, indexer_topk, parts_programs
from .merge import merge_lse, merge_stacked
from .rope import rope_
from .sparse_attention import sparse_mqa_attention

__all__ = ["HAVE_TRITON", "available", "enabled", "sparse_mqa_attention", "merge_lse", "merge_stacked", "rope_",
           "indexer_scores", "indexer_scores_parts", "indexer_topk", "parts_programs"]
