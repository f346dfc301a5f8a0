"""Process memory tuning for moving many large, short-lived buffers (shard chunks)."""
from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3     # glibc mallopt parameters


def tune_malloc() -> bool:
    """Keep large freed buffers in the heap. Every shard chunk is a fresh 4 MiB buffer; glibc's defaults serve
    such blocks with mmap and hand them back on free, so every chunk faults its pages in again, which cost
    about half the fetch throughput in bench/store.py. The store server calls this at start; a worker process
    that fetches many shards can call it too. glibc only; returns False (and does nothing) elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, 64 << 20)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 512 << 20))
