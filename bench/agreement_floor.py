"""How often does a harmless perturbation of the recompute arm change its 16-token answer? The floor under the
quality target's "answer agreement": the same model, tokens, chat template and greedy settings, run once in
float32 (the eval's recompute arm) and once with bf16 weights and activations, a precision serving systems
deploy. Prints the agreement between the two (LongBench normalization, as in the eval), the first-token KL,
and where the reuse arm's GPU results of the same questions are given (--against, a `runtime.eval` JSON), the
agreement of the reuse arms restricted to the questions where bf16 kept the answer. Not a test.

    python bench/agreement_floor.py --task hotpotqa --limit 40 --against bench/results/quality_gpu_hotpotqa_n300.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from runtime.eval.data import load_task  # noqa: E402
from runtime.eval.harness import _greedy, _kl, layout, stop_tokens  # noqa: E402
from runtime.eval.metrics import answers_agree  # noqa: E402
from runtime.llama.loader import load_llama  # noqa: E402
from runtime.llama.tokenizer import ChatTokenizer  # noqa: E402
from bench.report import write_json  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="hotpotqa", choices=["hotpotqa", "squad"])
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: SmolLM2-135M-Instruct from GGUF)")
    ap.add_argument("--against", default=None, help="a runtime.eval JSON of the same questions")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model_dir = args.model
    if model_dir is None:
        from runtime.llama.gguf import convert_gguf
        model_dir = str(convert_gguf().out)
    tok = ChatTokenizer.from_dir(model_dir)
    models = {d: load_llama(model_dir, dtype=getattr(torch, d)) for d in ("float32", "bfloat16")}
    stop = stop_tokens(models["float32"], tok)
    exs = list(itertools.islice(load_task(args.task, None, None), args.offset, args.offset + args.limit))
    rows = []
    t0 = time.time()
    for n, ex in enumerate(exs):
        lay = layout(tok, ex)
        tokens = [t for s in lay.segments for t in s] + lay.question
        out = {}
        with torch.inference_mode():
            for d, m in models.items():
                (ids, first), _ = _greedy(m, tokens, args.max_new_tokens, stop)
                out[d] = (tok.decode(ids).strip(), first.float())
        rows.append(dict(id=ex.id, fp32=out["float32"][0], bf16=out["bfloat16"][0],
                         agree=answers_agree(out["float32"][0], out["bfloat16"][0]),
                         kl=_kl(out["float32"][1], out["bfloat16"][1])))
        print(f"{n + 1}/{len(exs)} agree={rows[-1]['agree']} kl={rows[-1]['kl']:.4f} ({time.time() - t0:.0f} s)",
              flush=True)
    agree = sum(r["agree"] for r in rows) / len(rows)
    kl = sum(r["kl"] for r in rows) / len(rows)
    print(f"# {args.task}, questions {args.offset}..{args.offset + len(rows) - 1}, output cap {args.max_new_tokens}: "
          f"bf16 vs float32 recompute arm: answer agreement {agree:.3f}, mean first-token KL {kl:.4f}")
    summary = dict(task=args.task, offset=args.offset, n=len(rows), max_new_tokens=args.max_new_tokens,
                   agreement=agree, first_token_kl=kl, rows=rows)
    if args.against:
        run = json.load(open(args.against))
        pos = {i: k for k, i in enumerate(run["ids"])}
        ref = run["raw"]["recompute"]["answers"]
        for r in rows:                       # the GPU run's recompute arm is the same float32 computation
            if r["id"] in pos:
                r["gpu_fp32_same"] = answers_agree(ref[pos[r["id"]]], r["fp32"])
        kept = [r for r in rows if r["id"] in pos and r["agree"]]
        summary["against"] = {}
        for arm, raw in run["raw"].items():
            if arm in ("recompute", "prefix-only"):
                continue
            a_all = [raw["agree"][pos[r["id"]]] for r in rows if r["id"] in pos]
            a_kept = [raw["agree"][pos[r["id"]]] for r in kept]
            summary["against"][arm] = dict(all=sum(a_all) / max(1, len(a_all)), n=len(a_all),
                                           where_bf16_agrees=sum(a_kept) / max(1, len(a_kept)), n_kept=len(a_kept))
            print(f"  {arm}: agreement {summary['against'][arm]['all']:.3f} on these {len(a_all)} questions, "
                  f"{summary['against'][arm]['where_bf16_agrees']:.3f} on the {len(a_kept)} where bf16 kept the answer")
        same = [r["gpu_fp32_same"] for r in rows if "gpu_fp32_same" in r]
        print(f"  float32 here vs float32 on the GPU run: {sum(same)}/{len(same)} answers equal")
    write_json(args.json, summary, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
