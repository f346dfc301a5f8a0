"""The benchmarks' one timer: the median of `reps` timed calls after one warm-up call; on CUDA each call between
two events with the device synchronized around it, elsewhere (a CPU smoke run, not a measurement) wall clock."""
from __future__ import annotations

import statistics
import time

import torch


def median_time(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        if not torch.cuda.is_available():
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1000)
    return statistics.median(ts)
