"""`redknot eval` (and `python -m runtime.eval`, which needs none of the service stack): load the model,
tokenizer and data, run every arm over chunks of questions on one or more processes with a progress bar,
merge, print the table; with --out also write the JSON and the markdown table beside it."""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path


def add_arguments(e: argparse.ArgumentParser) -> None:
    from .data import TASKS
    e.add_argument("--task", default="hotpotqa", choices=list(TASKS),
                   help="a loaded task, or a synthetic one generated from a seed (kv_retrieval, var_tracking, "
                        "aggregation: runtime/eval/synthetic.py)")
    e.add_argument("--data", default=None, help="data file: LongBench JSONL, or an examples file written by "
                                                "scripts/prepare_devq.py (default: the bundled HotpotQA / SQuAD)")
    e.add_argument("--model", default=None, help="checkpoint dir; default: SmolLM2-135M-Instruct converted from GGUF")
    e.add_argument("--offset", type=int, default=0, help="skip this many examples (run a task in chunks)")
    e.add_argument("--limit", type=int, default=20)
    e.add_argument("--budgets", default="0.1,0.2,0.25")
    e.add_argument("--fences", default="3,3", help="first,last fence layers (the Llama family's eval profile; a "
                                                   "--profile brings its own)")
    e.add_argument("--preamble", action="store_true", help="build every document after a fixed preamble (the chat "
                                                           "template's head and the instruction), which opens every "
                                                           "request; every arm on that layout (the Llama family)")
    e.add_argument("--profile", default="", help="the reuse arms' base profile: a preset (demo, flash, pro, llama) or a "
                                                 "JSON object; required for a DeepSeek-V4 checkpoint (the profile "
                                                 "it serves: its rule, fences and alignment); default for the Llama "
                                                 "family: the eval profile")
    e.add_argument("--variants", default="", help="extra reuse arms beside the default ones, comma-separated: "
                                                  "reuse@B[:knob=value]... with knobs fences=F+L, gpg=N, "
                                                  "ffn=skip|native, lastkv=recompute|artifact, "
                                                  "select=attention|mixed|deviation, signal=k|kv, join=N, recent=N "
                                                  "(runtime/eval/arms.py)")
    e.add_argument("--max-new-tokens", type=int, default=32)
    e.add_argument("--teacher-tokens", type=int, default=32,
                   help="positions of the teacher-forced metrics: the recompute arm's continuation fed to every arm")
    e.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    e.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="model dtype; float32 keeps the recompute arm faithful (attention scores are float32 in "
                        "either)")
    e.add_argument("--procs", type=int, default=1, help="worker processes, each with its own model copy, sharing "
                                                        "the chunks of questions (on one GPU too)")
    e.add_argument("--chunk-size", type=int, default=None,
                   help="questions per chunk (default: limit / procs, rounded up)")
    e.add_argument("--chunk-dir", default=None, help="keep finished chunks here and reuse them on a later run "
                                                     "with the same settings (a stopped run resumes)")
    e.add_argument("--deadline", type=float, default=None,
                   help="seconds from now after which no new chunk starts; unfinished chunks are listed and the "
                        "command exits 3 (run it again with the same --chunk-dir to finish)")
    e.add_argument("--out", default=None, help="write the per-example results and summary (JSON) and the "
                                               "markdown table (same name, .md)")
    e.add_argument("--merge", nargs="*", default=None, help="merge these chunk JSONs instead of running")


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _family(model_dir: str) -> str | None:
    cfg = Path(model_dir) / "config.json"
    return json.loads(cfg.read_text()).get("model_type") if cfg.is_file() else None


def run_eval_cli(args) -> int:
    summary, status = evaluate(args)
    return status


def evaluate(args) -> tuple[dict | None, int]:
    """`redknot eval`'s run: the summary (None when nothing ran) and the command's exit status; the table printed
    and, with --out, written."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    from .arms import ArmError, arm_list
    from .harness import markdown, merge_runs, save
    from .runner import RunSpec, plan, run_chunks

    console = Console(stderr=True)
    status = 0
    if args.merge:
        summary = merge_runs([json.loads(open(p).read()) for p in args.merge])
        meta = {k: v for k, v in json.loads(open(args.merge[0]).read()).items()
                if k in ("task", "model", "budgets", "fences", "variants", "max_new_tokens", "teacher_tokens", "dtype",
                         "device", "profile")}
        summary.update(meta, offset=None)
    else:
        model_dir = args.model
        if model_dir is None:
            from runtime.llama.gguf import convert_gguf
            model_dir = str(convert_gguf().out)
        device = args.device or ("cuda" if _cuda() else "cpu")
        spec = RunSpec(model_dir=model_dir, task=args.task, data=args.data,
                       budgets=tuple(float(b) for b in args.budgets.split(",") if b),
                       fences=tuple(int(f) for f in args.fences.split(",")), max_new_tokens=args.max_new_tokens,
                       device=device, dtype=args.dtype,
                       variants=tuple(v for v in args.variants.split(",") if v.strip()),
                       teacher_tokens=args.teacher_tokens, profile=args.profile, preamble=args.preamble)
        assert len(spec.fences) == 2, f"--fences {args.fences}: give first,last"
        if not args.profile and _family(model_dir) == "deepseek_v4":
            console.print("redknot eval: a DeepSeek-V4 checkpoint is evaluated under the profile it serves: give "
                          "--profile (demo, flash, pro, llama or a JSON object)")
            return None, 2
        try:
            arms = arm_list(list(spec.budgets), list(spec.variants), spec.arm_fences())
        except (ArmError, ValueError, TypeError) as err:
            console.print(f"redknot eval: {err}")
            return None, 2
        procs = max(1, args.procs)
        chunks = plan(args.offset, args.limit, args.chunk_size or math.ceil(args.limit / procs))
        deadline = time.time() + args.deadline if args.deadline else None
        cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TimeRemainingColumn())
        with Progress(*cols, console=console) as bar:
            task = bar.add_task(f"{args.task}: {args.limit} questions x {len(arms)} arms, {procs} procs, "
                                f"{device}", total=args.limit)
            r = run_chunks(spec, chunks, procs, args.chunk_dir, deadline,
                           progress=lambda n: bar.update(task, completed=n))
        if not r.summaries:
            console.print(f"no chunk finished before the deadline ({len(r.pending)} pending)")
            return None, 3
        summary = merge_runs(r.summaries) if len(r.summaries) > 1 else r.summaries[0]
        summary.update(task=args.task, model=model_dir, offset=args.offset, budgets=list(spec.budgets),
                       fences=list(spec.fences), variants=list(spec.variants), max_new_tokens=args.max_new_tokens,
                       teacher_tokens=args.teacher_tokens, dtype=args.dtype, device=device,
                       procs=procs, chunks_reused=r.reused,
                       pending=[[c.offset, c.limit] for c in r.pending])
        if r.pending:
            console.print(f"[yellow]incomplete: {len(r.pending)} of {len(chunks)} chunks did not start before the "
                          f"deadline (offsets {[c.offset for c in r.pending]}); run again with the same "
                          f"--chunk-dir to finish[/yellow]")
            status = 3
    table = markdown(summary, f"{summary.get('task', 'merged')}")
    if args.out:
        save(summary, args.out)
        Path(args.out).with_suffix(".md").write_text(table + "\n")
    print(table)
    return summary, status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.eval", description="the quality harness (redknot eval)")
    add_arguments(p)
    return run_eval_cli(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
