"""RuntimePolicy: the measured-best rules the fast path follows, as one frozen value.

The process edge (the `redknot` command, a service's settings, a benchmark's `--policy key=value`) builds one and
hands it to the model (`Transformer(..., policy=)` or `Transformer.set_policy`); the model's modules and the reuse
engine read it from there. Nothing below the process edge reads the environment for these rules: the one switch
that stays is REDKNOT_KERNELS (the torch reference path against the GPU kernels, `runtime.kernels.enabled`).

Every field is a threshold in a shape the hardware decides (heads against the MMA tile's 16 rows, routed slots
against a GEMM's size); the defaults are the values measured best on an H200 with DeepSeek-V4-Flash's shapes (64
query heads on the active rows, 8 Global heads, 16 experts of 2048 per token slot). A model of other shapes (the
tests' tiny configs) sets them to its own head counts to take the same kernels."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class RuntimePolicy:
    # a segment-attention call of at least this many heads on CUDA takes the fused multi-segment kernel (one launch
    # over every segment); fewer heads (Flash's 8 Global heads) take the stacked per-segment parts and one merge,
    # where the fused kernel leaves most of its 16-row tile idle and measured 1.3-3.6x slower
    fused_min_heads: int = 16
    # ... and a call of fewer heads takes it too once it reaches at least this many segments: the stacked path's
    # launches grow with the segments (about five per segment and query chunk) and outgrow the fused kernel's idle
    # tile half (32K, 10% budget, one H100: stacked 1.707 vs fused 1.734 s at 32 documents, 2.388 vs 2.127 s at 64)
    fused_min_segments: int = 48
    # a fused call in "picks" mode (CSA) of at least this many heads turns the keys to the query's frame, one loop
    # over the row's picks across segments; other calls turn the query per segment
    key_frame_min_heads: int = 16
    # an HCA call ("causal" over the compressed entries) over at least this many segments takes the fused kernel in
    # the key frame, whatever its heads (0: never; it then follows the rules above). With many short documents each
    # segment's few compressed entries (8 for a document of 1024 tokens at ratio 128) fill an eighth of a 64-entry
    # tile in the per-segment loops, where the key frame's one loop runs across segments, 8 rows of the 8 Global
    # heads sharing each tile. bench/ttft.py beside the earlier rules (stacked below 48 segments for 8 heads, the
    # query frame for 64; `--policy key_frame_min_segments_hca=0`), one H100, 10% budget: 32K 1.390 vs 1.587 s at
    # 32 documents; 64K 2.959 vs 3.265 at 32, 3.233 vs 3.662 at 64. Below 16 (8 documents) the earlier rules stay:
    # the key frame lost there (32K: 1.123 vs 1.089 s) and so did the Global heads' HCA calls fused in the query
    # frame at 64K (2.299 vs 2.243 s; a tie at 32K)
    key_frame_min_segments_hca: int = 16
    # the stacked path holds one float32 [rows, heads, head_dim] part per segment a call reaches: its query chunk
    # (q_chunk x n_heads (row, head) pairs) is sized for this many parts, and a call over more segments takes
    # proportionally fewer rows per chunk, so its parts stay within the same memory whatever the document count
    # (8 documents and the request's own segment: at 32 documents one chunk of 32K rows needed 14 GiB more on an
    # H100 and ran out of memory; 0: no bound)
    stacked_parts: int = 9
    # the routed MoE takes one grouped GEMM per weight (no host read) for calls of at most this many (row, slot)
    # pairs; above, the per-expert loop, whose GEMMs are then large enough that its one host read costs little
    # (0: always the loop)
    moe_grouped_slots: int = 1 << 15
    # a request's own forward over its whole prompt (the recompute arm, a fallback, a shadow recompute) runs in
    # chunks of at most this many tokens, each extending the request's cache (`Transformer.prefill`: the same logits
    # and cache as one forward, tests/runtime/test_model_fidelity.py); it bounds the activations of a long prompt
    # (the recompute arm needs ~65 GiB at 64K in one forward with 8 routed experts) (0: one forward)
    prefill_chunk: int = 0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"RuntimePolicy.{f.name} must be a non-negative int, got {v!r}")

    def replace(self, **changes) -> "RuntimePolicy":
        return dataclasses.replace(self, **changes)

    @classmethod
    def parse(cls, items: list[str] | tuple[str, ...] = ()) -> "RuntimePolicy":
        """The default policy with `key=value` items applied (a benchmark's or the command's `--policy`); an unknown
        key or a value that is not an int is a ValueError naming the fields."""
        names = {f.name for f in dataclasses.fields(cls)}
        changes = {}
        for item in items:
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in names:
                raise ValueError(f"policy item {item!r} must be key=value with key one of {sorted(names)}")
            try:
                changes[key] = int(value.strip(), 0)
            except ValueError:
                raise ValueError(f"policy item {item!r}: {key} takes an int") from None
        return cls(**changes)

    def diff(self) -> dict[str, int]:
        """The fields that differ from the default, for a benchmark's record."""
        base = RuntimePolicy()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(base, f.name)}


DEFAULT_POLICY = RuntimePolicy()
