"""Where a CUDA run makes the host wait: every synchronizing call of one run of a function, each named by the stack
of our code (`runtime/` frames) that made it, and the caching allocator's own synchronizations over the same run.

    from bench.syncs import sync_report
    print(sync_report(lambda: engine.prefill(docs, question)))

`bench/ttft.py --syncs-at L` prints it for one reuse prefill at length L. Not a test: a reading aid.

- Synchronizing calls: torch's sync debug mode ("warn") raises a warning at the calls that wait for the GPU through
  torch's `memcpy_and_sync` / `stream_synchronize` (seen on the H200 with torch 2.11: `.tolist()`, `torch.bincount`,
  a blocking host->device copy from pageable memory); each is counted under the innermost frames of ours that led
  to it. Not every wait is flagged: a test counting `.item()` calls did not get the counts it expected there (cause not
  found), and event or allocator waits are not warned about (the allocator's are counted below).
- Allocator: `torch.cuda.memory_stats()` counters over the run. `num_alloc_retries` counts allocations that failed,
  freed the cached blocks (synchronizing every stream) and retried; `num_sync_all_streams` counts those
  synchronizations (also on `empty_cache`); `num_device_alloc` / `num_device_free` count cudaMalloc / cudaFree (or,
  with expandable segments, page maps and unmaps, an unmap synchronizing first).
"""
from __future__ import annotations

import collections
import traceback
import warnings

import torch

ALLOCATOR_KEYS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free", "num_ooms")


def allocator_counters() -> dict[str, int]:
    """The caching allocator's counters of ALLOCATOR_KEYS now (all 0 without CUDA)."""
    if not torch.cuda.is_available():
        return {k: 0 for k in ALLOCATOR_KEYS}
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_KEYS}


def allocator_delta(before: dict[str, int]) -> dict[str, int]:
    after = allocator_counters()
    return {k: after[k] - before[k] for k in ALLOCATOR_KEYS}


def _ours(stack, where: str, depth: int) -> str:
    frames = [f for f in stack if where in f.filename.replace("\\", "/")]
    if not frames:
        return "(no frame under " + where + ")"
    return " <- ".join(f"{f.filename.split(where, 1)[-1]}:{f.lineno} {f.name}" for f in reversed(frames[-depth:]))


def find_syncs(fn, where: str = "runtime/", depth: int = 3):
    """Run fn() once; -> (its result, Counter {our innermost `depth` frames: synchronizing calls}, allocator
    counters' change). Without CUDA the counter is empty (nothing synchronizes)."""
    seen: collections.Counter = collections.Counter()
    before = allocator_counters()
    if not torch.cuda.is_available():
        return fn(), seen, allocator_delta(before)
    torch.cuda.synchronize()
    old_mode = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        old_show = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                seen[_ours(traceback.extract_stack()[:-1], where, depth)] += 1
            else:
                old_show(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode(old_mode)
            warnings.showwarning = old_show
    torch.cuda.synchronize()
    return out, seen, allocator_delta(before)


def sync_report(fn, where: str = "runtime/", depth: int = 3, title: str = "") -> str:
    _, seen, alloc = find_syncs(fn, where, depth)
    lines = [f"## host syncs {title}: {sum(seen.values())} synchronizing calls at {len(seen)} places; allocator "
             + ", ".join(f"{k} {v}" for k, v in alloc.items())]
    lines += [f"   {n:5d}  {where_}" for where_, n in seen.most_common()]
    return "\n".join(lines)
