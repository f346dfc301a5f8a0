"""The recompute arm alone on the synthetic tasks (runtime/eval/synthetic.py): the plain model on the harness's
layout and chat template, greedy, the harness's stop tokens. A quick check that a model can do a task at all.

    python -m runtime.eval.score --model CHECKPOINT_DIR --limit 30
"""
from __future__ import annotations

from .synthetic import SYNTHETIC_TASKS, load_synthetic


def score_recompute(model_dir: str, tasks: tuple[str, ...] = SYNTHETIC_TASKS, limit: int = 30, seed: int = 0,
                    max_new_tokens: int = 32) -> dict[str, dict[str, float]]:
    """The recompute arm alone (the plain model on the harness's layout and chat template, greedy, the harness's
    stop tokens) over the first `limit` examples of each task: EM and F1 against gold. A quick check that a
    model can do a task at all, far cheaper than the whole harness on CPU."""
    import torch

    from runtime.llama.loader import load_llama
    from runtime.llama.tokenizer import ChatTokenizer
    from .harness import _greedy, layout, stop_tokens
    from .metrics import best_em, best_f1

    model, tok = load_llama(model_dir), ChatTokenizer.from_dir(model_dir)
    stop, out = stop_tokens(model, tok), {}
    with torch.backends.mkldnn.flags(enabled=False):           # no oneDNN kernel compile per new shape on CPU
        for task in tasks:
            em = f1 = 0.0
            for ex in load_synthetic(task, limit, seed):
                lay = layout(tok, ex)
                (ids, _), _ = _greedy(model, [t for s in lay.segments for t in s] + lay.question, max_new_tokens,
                                      stop)
                text = tok.decode(ids).strip()
                em, f1 = em + best_em(text, ex.answers), f1 + best_f1(text, ex.answers)
            out[task] = {"n": limit, "em": em / limit, "f1": f1 / limit}
            print(f"{task}: recompute EM {em / limit:.3f} F1 {f1 / limit:.3f} (n = {limit}, seed {seed})", flush=True)
    return out


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(prog="python -m runtime.eval.score",
                                description="score the recompute arm alone on the synthetic tasks")
    p.add_argument("--model", required=True, help="checkpoint dir (redknot models convert-gguf)")
    p.add_argument("--tasks", default=",".join(SYNTHETIC_TASKS))
    p.add_argument("--limit", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=32)
    a = p.parse_args()
    score_recompute(a.model, tuple(a.tasks.split(",")), a.limit, a.seed, a.max_new_tokens)
