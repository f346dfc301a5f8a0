"""Prefill benchmark: one DeepSeek-V4-Flash layer of each kind (window / CSA / HCA) at real dimensions,
bf16 on one GPU, from 8K to 128K rows. Routed experts are reduced so the layers fit (printed); top-6 routing
and the shared expert are kept, so MoE work per row is the real model's. Prints time, analytic FLOPs and
achieved TFLOP/s per layer kind. Not a test: run it through the device tool.

    python bench/prefill.py --lengths 8192,16384,32768,65536,131072 --experts 16
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from runtime.model.config import FLASH  # noqa: E402
from runtime.model.deepseek_v4 import Block, LayerCache  # noqa: E402
from runtime.model.flops import layer_flops  # noqa: E402
from runtime.model.parallel import Parallel  # noqa: E402
from bench.report import header, write_json  # noqa: E402

LAYERS = {"window": 1, "csa": 2, "hca": 3}     # Flash: L0-1 window, then CSA (even) / HCA (odd)


def init_block(block: Block, cfg, gen: torch.Generator) -> None:
    for name, p in block.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        elif "hc_" in name and name.endswith("_fn"):
            p.data.normal_(0, 0.02, generator=gen)
        elif p.dim() == 2:
            p.data.normal_(0, p.shape[1] ** -0.5, generator=gen)
        else:
            p.data.normal_(0, 0.1, generator=gen)
    if block.ffn.gate.hash:
        tid = torch.stack([torch.randperm(cfg.n_routed_experts)[:cfg.n_activated_experts] for _ in range(cfg.vocab_size)])
        block.ffn.gate.tid2eid.copy_(tid)


def time_layer(block: Block, cfg, T: int, reps: int, q_chunk: int, device) -> list[float]:
    gen = torch.Generator(device=device).manual_seed(T)
    x = torch.randn(T, cfg.hc_mult, cfg.dim, device=device, dtype=torch.bfloat16, generator=gen)
    tokens = torch.randint(0, cfg.vocab_size, (T,), device=device, generator=gen)
    pos = torch.arange(T, device=device)
    times = []
    for i in range(reps + 1):                           # first run is warm-up
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.inference_mode():
            block(x, tokens, pos, LayerCache(), q_chunk)
        end.record()
        torch.cuda.synchronize()
        if i:
            times.append(start.elapsed_time(end) / 1000)
    return times


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8192,16384,32768,65536,131072")
    ap.add_argument("--experts", type=int, default=16, help="routed experts kept (Flash has 256)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--q-chunk", type=int, default=4096)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a GPU"
    device = torch.device("cuda")
    cfg = FLASH.replace(n_routed_experts=args.experts)
    header(f"Flash dims, bf16, "
           f"routed experts {args.experts} of 256 (top-{cfg.n_activated_experts} + shared kept)", device)
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for kind, layer in LAYERS.items():
        with torch.device(device):
            block = Block(cfg, layer, Parallel(), torch.bfloat16)
        init_block(block, cfg, gen)
        block.eval()
        for T in [int(v) for v in args.lengths.split(",")]:
            torch.cuda.empty_cache()
            t = statistics.median(time_layer(block, cfg, T, args.reps, args.q_chunk, device))
            f = layer_flops(cfg, layer, T)
            row = dict(kind=kind, tokens=T, seconds=t, tflop=f.total / 1e12, tflops=f.total / t / 1e12,
                       proj_tflop=f.projections / 1e12, attn_tflop=f.attention / 1e12,
                       indexer_tflop=f.indexer / 1e12, moe_tflop=f.moe / 1e12,
                       peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30)
            rows.append(row)
            print(f"{kind:6s} T={T:7d}  {t * 1000:9.1f} ms  {row['tflop']:8.2f} TFLOP  {row['tflops']:6.1f} TFLOP/s  "
                  f"(proj {row['proj_tflop']:.1f}, attn {row['attn_tflop']:.1f}, indexer {row['indexer_tflop']:.1f}, "
                  f"moe {row['moe_tflop']:.1f}; peak {row['peak_gib']:.0f} GiB)", flush=True)
            torch.cuda.reset_peak_memory_stats()
        del block
    write_json(args.json, dict(experts=args.experts, rows=rows, when=time.strftime("%Y-%m-%d %H:%M:%S")), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
