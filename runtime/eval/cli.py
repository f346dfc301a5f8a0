"""`redknot eval` entry: load model, tokenizer and data, run every arm with a progress bar, print the table."""
from __future__ import annotations

import itertools
import json

import torch
from rich.console import Console
from rich.progress import Progress

from runtime.llama.loader import load_llama
from runtime.llama.tokenizer import ChatTokenizer
from .data import load_task
from .harness import markdown, merge_runs, run_eval, save


def run_eval_cli(args) -> int:
    console = Console()
    if args.merge:
        summary = merge_runs([json.loads(open(p).read()) for p in args.merge])
    else:
        model_dir = args.model
        if model_dir is None:
            from runtime.llama.gguf import convert_gguf
            model_dir = str(convert_gguf().out)
        model = load_llama(model_dir, device=args.device)
        tok = ChatTokenizer.from_dir(model_dir)
        examples = list(itertools.islice(load_task(args.task, args.data, None), args.offset,
                                         args.offset + args.limit))
        budgets = [float(b) for b in args.budgets.split(",") if b]
        fences = tuple(int(f) for f in args.fences.split(","))
        torch.manual_seed(0)
        # on CPU, oneDNN compiles a kernel per new matmul shape (~16 ms each); segment lengths vary per example
        flags = torch.backends.mkldnn.flags(enabled=args.device != "cpu")
        with flags, Progress(console=console) as bar:
            task = bar.add_task(f"{args.task}: {len(examples)} questions x {3 + len(budgets)} arms", total=len(examples))
            summary = run_eval(model, tok, examples, budgets, args.max_new_tokens, fences,
                               progress=lambda n, _: bar.update(task, completed=n))
        summary.update(task=args.task, model=model_dir, offset=args.offset, budgets=budgets, fences=list(fences),
                       max_new_tokens=args.max_new_tokens)
    if args.out:
        save(summary, args.out)
    console.print(markdown(summary, f"{summary.get('task', 'merged')}"))
    return 0
