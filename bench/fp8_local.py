"""What storing the Local contribution W_a,L O_L in FP8 costs and saves, on the Flash-shaped model of bench/ttft.py.

    python3 bench/fp8_local.py --lengths 16384,32768 --budget 0.1 --questions 8 --json out.json    # on the GPU
    python3 bench/fp8_local.py --small                                                           # CPU smoke run

Per length: bench/ttft.py's request (documents of random token ids, Flash dimensions, bf16 on CUDA, kernels on),
every document produced twice, with `local_format` "native" (the model's dtype) and "fp8" (e4m3 codes, one
power-of-two scale per row and 128 channels); for each of `--questions` questions the reuse prefill over either
set and the recompute arm. Reported:
- the cost of FP8 storage: the last row's logits of the FP8 reuse against the native reuse (relative max error),
  the first-token KL(native || fp8) and top-1 agreement, beside the reuse arm's own KL(recompute || native reuse):
  the share of the reuse arm's deviation that storage adds (the issue's target: <= 10%);
- the bytes: per document token and reusable layer, for each tensor of the artifact as the producer writes it (TP1,
  measured), and per rank at TP8 (the Local tensors hold 1/8 of the channels on each rank; every other tensor is
  rank-agnostic and today fetched by every rank).
A random-init checkpoint: the deviations are a measure of the rounding, not of answer quality.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.ttft import add_model_args, flash_model, model_config, request  # noqa: E402
from runtime.reuse.engine import ReuseEngine  # noqa: E402
from runtime.reuse.producer import produce  # noqa: E402
from bench.report import header, write_json  # noqa: E402

FIELDS = ("latent", "entries", "index_keys", "comp_prev", "index_prev", "picks", "local_p", "local_s")
PER_RANK = ("local_p", "local_s")          # this rank's channel range only


def bytes_per_token(arts, prof, cfg) -> dict[str, float]:
    """Mean bytes per document token and reusable layer, by field, over the relocated documents."""
    out = {f: 0 for f in FIELDS}
    reusable = prof.reusable_layers(cfg)
    n = 0
    for a in arts[1:]:
        n += a.n * len(reusable)
        for i in reusable:
            la = a.layers[i]
            for f in FIELDS:
                v = getattr(la, f)
                ts = v if isinstance(v, tuple) else (() if v is None else (v,))
                out[f] += sum(t.numel() * t.element_size() for t in ts)
    return {f: b / n for f, b in out.items()}


def last_row(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    return logits.float().reshape(-1, vocab)[-1]


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p || q) of the softmaxes, float64."""
    lp, lq = p_logits.double().log_softmax(-1), q_logits.double().log_softmax(-1)
    return float((lp.exp() * (lp - lq)).sum())


@torch.no_grad()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap, lengths="16384")
    ap.set_defaults(budget=0.1)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.small:
        args.lengths, args.docs, args.questions, args.layers, args.experts, args.device = "1024", 4, 2, 8, 8, "cpu"
    device = torch.device(args.device)
    cfg, prof = model_config(args)
    if args.small:
        prof = prof.replace(first_fences=2, last_fences=2)
    model = flash_model(cfg, device, args.q_chunk)
    dtype = model.dtype
    header(f"Flash dims x {cfg.n_layers} layers{' (small)' if args.small else ''}"
           f", {dtype}, routed experts {cfg.n_routed_experts} | profile {prof.first_fences}F-"
           f"{len(prof.reusable_layers(cfg))}R-{prof.last_fences}F budget {prof.budget:.0%} picks {prof.global_picks}"
           f" | {args.docs} documents, {args.questions} questions of {args.question} tokens", device)
    rows = []
    for L in [int(v) for v in args.lengths.split(",") if v.strip()]:
        docs, _ = request(cfg, L, args.docs, args.question, seed=L, spread=args.doc_lengths)
        arts = {fmt: [produce(model, d, prof.replace(local_format=fmt)) for d in docs] for fmt in ("native", "fp8")}
        engines = {fmt: ReuseEngine(model, prof.replace(local_format=fmt)) for fmt in arts}
        full_prefix = [t for a in arts["native"] for t in a.tokens]
        per_q = []
        g = torch.Generator().manual_seed(L + 1)
        for _ in range(args.questions):
            q = torch.randint(2, cfg.vocab_size, (args.question,), generator=g).tolist()
            lg = {fmt: last_row(engines[fmt].prefill(arts[fmt], q).logits, cfg.vocab_size) for fmt in arts}
            full = last_row(model(torch.tensor(full_prefix + q, device=device)), cfg.vocab_size)
            per_q.append(dict(
                rel_err=float((lg["fp8"] - lg["native"]).abs().max() / lg["native"].abs().max()),
                kl_storage=kl(lg["native"], lg["fp8"]), kl_reuse=kl(full, lg["native"]),
                kl_reuse_fp8=kl(full, lg["fp8"]),
                top1_storage=bool(lg["fp8"].argmax() == lg["native"].argmax()),
                top1_reuse=bool(lg["native"].argmax() == full.argmax())))
        b = {fmt: bytes_per_token(a, prof, cfg) for fmt, a in arts.items()}
        tp8 = {fmt: {f: v / 8 if f in PER_RANK else v for f, v in bb.items()} for fmt, bb in b.items()}
        row = dict(tokens=L, docs=args.docs, questions=per_q,
                   rel_err_median=statistics.median(r["rel_err"] for r in per_q),
                   kl_storage_mean=statistics.fmean(r["kl_storage"] for r in per_q),
                   kl_reuse_mean=statistics.fmean(r["kl_reuse"] for r in per_q),
                   kl_reuse_fp8_mean=statistics.fmean(r["kl_reuse_fp8"] for r in per_q),
                   top1_storage=statistics.fmean(r["top1_storage"] for r in per_q),
                   top1_reuse=statistics.fmean(r["top1_reuse"] for r in per_q),
                   bytes_tp1=b, bytes_tp8_rank=tp8)
        row["kl_share"] = row["kl_storage_mean"] / row["kl_reuse_mean"] if row["kl_reuse_mean"] else float("nan")
        rows.append(row)
        print(f"  {L}: fp8 vs native reuse: logits rel err {row['rel_err_median']:.2e} (median), KL "
              f"{row['kl_storage_mean']:.2e}, top-1 {row['top1_storage']:.0%} | reuse vs recompute: KL "
              f"{row['kl_reuse_mean']:.2e} native, {row['kl_reuse_fp8_mean']:.2e} fp8, top-1 {row['top1_reuse']:.0%}"
              f" | storage KL / reuse KL {row['kl_share']:.2%}", flush=True)
    print("\n| bytes per document token and reusable layer | " + " | ".join(
        f"{fmt} TP1 | {fmt} TP8 rank" for fmt in ("native", "fp8")) + " |")
    print("|---|" + "---:|" * 4)
    last = rows[-1]
    for f in FIELDS + ("total",):
        vals = []
        for fmt in ("native", "fp8"):
            for d in (last["bytes_tp1"][fmt], last["bytes_tp8_rank"][fmt]):
                vals.append(sum(d.values()) if f == "total" else d[f])
        print(f"| {f} | " + " | ".join(f"{v:,.0f} B ({v / 1024:.2f} KiB)" for v in vals) + " |")
    write_json(args.json, dict(small=args.small, profile=prof.to_dict(), layers=cfg.n_layers,
                               experts=cfg.n_routed_experts, rows=rows), args, device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
