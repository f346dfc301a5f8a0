"""Where the GPU waits: idle gaps of the busiest CUDA stream in a torch.profiler chrome trace, attributed to what
the host was doing when it launched the kernel that ended each gap.

    python3 bench/gaps.py trace.json [--top 20] [--min-us 1]

`bench/ttft.py --profile-at L` calls `report` on the trace of each arm. For each gap of at least --min-us between
two kernels (or copies) of the stream with the most kernel time:
- "after a host sync": a cudaStreamSynchronize / cudaDeviceSynchronize / cudaEventSynchronize returned inside the
  gap (the host drained the queue, e.g. `.item()`, `.tolist()`, `nonzero`), so the GPU waits for the host to
  refill it;
- "host-bound": the kernel after the gap was launched after the gap began (the host was slower than the GPU);
- "launched early": it was launched before the gap began (launch latency, or a wait on another stream's event).
The stream's kernels are counted, and their GPU time summed per kernel name, per innermost `record_function` label
at their launch (the `rk.*` / `blk.*` phases of the consumer and Block.forward: which kernels a phase's time goes
to), and the gaps are summed per that label, per innermost aten op enclosing
the launch (on the launching thread) and, when the profile was taken with `with_stack=True`, per innermost Python
function of ours (a `runtime/` frame). Not a test: a reading aid for a profile.
"""
from __future__ import annotations

import argparse
import bisect
import json
import sys
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
SYNC_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


class _Enclosing:
    """Innermost interval (latest start) of a set of host intervals that contains a time."""

    def __init__(self, events, back: int = 256):
        self.ev, self.back = sorted(events, key=lambda e: e["ts"]), back
        self.starts = [e["ts"] for e in self.ev]

    def at(self, t: float, tid=None, where=None):
        """The innermost event containing t (on thread `tid` when given; whose name holds `where` when given)."""
        k = bisect.bisect_right(self.starts, t)
        for e in reversed(self.ev[max(0, k - self.back):k]):      # nested intervals: the innermost starts last
            if (e["ts"] <= t <= e["ts"] + e.get("dur", 0) and (tid is None or e.get("tid") == tid)
                    and (where is None or where in e["name"])):
                return e
        return None


def analyse(events: list[dict], min_us: float = 1.0, where: str = "runtime/") -> dict:
    """The gap summary of one trace's events (chrome-trace dicts with ph, cat, name, ts, dur, args); with Python
    stacks in the trace, also per innermost Python function whose name holds `where` (our code's frames)."""
    xs = [e for e in events if e.get("ph") == "X" and "ts" in e]
    gpu = [e for e in xs if e.get("cat") in GPU_CATS]
    if not gpu:
        raise ValueError("the trace holds no GPU kernels: profile with ProfilerActivity.CUDA on a GPU")
    per_stream = defaultdict(float)
    for e in gpu:
        if e.get("cat") == "kernel":
            per_stream[e.get("args", {}).get("stream")] += e.get("dur", 0)
    stream = max(per_stream, key=per_stream.get) if per_stream else gpu[0].get("args", {}).get("stream")
    main = sorted((e for e in gpu if e.get("args", {}).get("stream") == stream), key=lambda e: e["ts"])
    launch = {e["args"]["correlation"]: e for e in xs
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    syncs = sorted(e["ts"] + e.get("dur", 0) for e in xs
                   if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("name") in SYNC_NAMES)
    labels = _Enclosing([e for e in xs if e.get("cat") == "user_annotation"])
    ops = _Enclosing([e for e in xs if e.get("cat") == "cpu_op"])
    py = _Enclosing([e for e in xs if e.get("cat") == "python_function"], back=4096)   # with_stack=True only

    busy, end = 0.0, main[0]["ts"]
    per_kernel = defaultdict(lambda: [0, 0.0])   # (phase label at the launch, kernel name) -> [count, GPU us]
    kinds = defaultdict(lambda: [0, 0.0])
    by_label, by_op, by_py = (defaultdict(lambda: [0, 0.0]) for _ in range(3))
    for k, e in enumerate(main):
        s, d = e["ts"], e.get("dur", 0)
        host = launch.get(e.get("args", {}).get("correlation"))
        lab = labels.at(host["ts"], host.get("tid")) if host is not None else None
        pk = per_kernel[(lab["name"] if lab is not None else "(none)", e.get("name", "?"))]
        pk[0] += 1
        pk[1] += d
        gap = s - end
        if k and gap >= min_us:
            j = bisect.bisect_left(syncs, end)
            if j < len(syncs) and syncs[j] <= s:
                kind = "after a host sync"
            elif host is not None and host["ts"] >= end:
                kind = "host-bound"
            else:
                kind = "launched early"
            kinds[kind][0] += 1
            kinds[kind][1] += gap
            t, tid = (host["ts"], host.get("tid")) if host is not None else (s, None)
            if host is None:                # no launch record: what the host was in when the kernel started
                lab = labels.at(t)
            op = ops.at(t, tid)
            fn = py.at(t, tid, where) if py.ev else None
            for table, ev in ((by_label, lab), (by_op, op)) + (((by_py, fn),) if py.ev else ()):
                name = ev["name"] if ev is not None else "(none)"
                table[name][0] += 1
                table[name][1] += gap
        busy += max(0.0, s + d - max(s, end))
        end = max(end, s + d)
    window = end - main[0]["ts"]
    return dict(stream=stream, kernels=len(main), window_us=window, busy_us=busy, idle_us=window - busy,
                kinds={k: dict(gaps=v[0], us=v[1]) for k, v in kinds.items()},
                by_label=sorted(((k, v[0], v[1]) for k, v in by_label.items()), key=lambda r: -r[2]),
                by_op=sorted(((k, v[0], v[1]) for k, v in by_op.items()), key=lambda r: -r[2]),
                by_py=sorted(((k, v[0], v[1]) for k, v in by_py.items()), key=lambda r: -r[2]),
                launches=_launches(per_kernel), kernels_by_label=_by_label(per_kernel))


def _launches(per_kernel) -> list[tuple[str, int]]:
    """[(label, kernels and copies of the stream launched under it)], most first."""
    n = defaultdict(int)
    for (lab, _), (c, _) in per_kernel.items():
        n[lab] += c
    return sorted(n.items(), key=lambda kv: -kv[1])


def _by_label(per_kernel) -> list[tuple[str, float, list[tuple[str, int, float]]]]:
    """[(label, GPU us of its kernels, [(kernel, count, us)] largest first)], labels by GPU time."""
    groups = defaultdict(list)
    for (lab, name), (c, us) in per_kernel.items():
        groups[lab].append((name, c, us))
    return sorted(((lab, sum(us for _, _, us in ks), sorted(ks, key=lambda k: -k[2])) for lab, ks in groups.items()),
                  key=lambda r: -r[1])


def report(path: str, top: int = 20, min_us: float = 1.0, title: str = "", per_label_kernels: int = 6) -> str:
    """The summary of a chrome trace file as text."""
    with open(path) as fh:
        data = json.load(fh)
    r = analyse(data["traceEvents"] if isinstance(data, dict) else data, min_us)
    lines = [f"## GPU idle{(' ' + title) if title else ''}: stream {r['stream']}, {r['kernels']} kernels and copies, "
             f"window {r['window_us'] / 1e3:.1f} ms, busy {r['busy_us'] / 1e3:.1f} ms, idle "
             f"{r['idle_us'] / 1e3:.1f} ms ({100 * r['idle_us'] / max(r['window_us'], 1e-9):.1f}%)"]
    for k, v in sorted(r["kinds"].items(), key=lambda kv: -kv[1]["us"]):
        lines.append(f"   {k:18s} {v['gaps']:7d} gaps {v['us'] / 1e3:9.1f} ms")
    lines.append("   idle per innermost phase label at the launch that ended the gap:")
    lines += [f"     {n[:48]:48s} {c:7d} gaps {us / 1e3:9.1f} ms" for n, c, us in r["by_label"][:top]]
    lines.append("   idle per innermost host op at that launch:")
    lines += [f"     {n[:48]:48s} {c:7d} gaps {us / 1e3:9.1f} ms" for n, c, us in r["by_op"][:top]]
    lines.append("   kernels and copies of the stream per innermost phase label at their launch:")
    lines += [f"     {n[:48]:48s} {c:7d}" for n, c in r["launches"][:top]]
    lines.append("   GPU time of the stream per innermost phase label at the launch, and its largest kernels:")
    for lab, us, ks in r["kernels_by_label"][:top]:
        lines.append(f"     {lab[:48]:48s} {us / 1e3:9.1f} ms")
        lines += [f"       {n[:60]:60s} {c:7d} x {u / 1e3:9.1f} ms" for n, c, u in ks[:per_label_kernels]]
    if r["by_py"]:
        lines.append("   idle per innermost Python function of ours at that launch:")
        lines += [f"     {n[-64:]:64s} {c:7d} gaps {us / 1e3:9.1f} ms" for n, c, us in r["by_py"][:top]]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--min-us", type=float, default=1.0)
    args = ap.parse_args()
    print(report(args.trace, args.top, args.min_us))
    return 0


if __name__ == "__main__":
    sys.exit(main())
