"""Which relocated rows should a reuse arm recompute? Row-selection rules against oracles, on a real model.

For each question (the eval harness's layout, `runtime/eval/harness.py`), the recompute arm runs once with its
per-layer q/k/v captured. From it come two oracles a serving system cannot have (they need the recompute arm):
  oracle-attention   the rows the question rows attend to most in the recompute arm, summed over the reusable
                     layers (the rows whose stale K/V the question reads most);
  oracle-deviation   the rows whose K/V in the reusable layers deviate most from their artifact's.
Beside them the rules the engine implements (`select=`): mixed (the shared controller), deviation (first-fence
K deviation, CacheBlend-style), attention (the question's draft pass over the artifacts,
`LlamaAdapter.draft_attention`), and a seeded random pick. Every rule spends the same budget (ceil(budget x
relocated rows)) through the same engine (`ReuseEngine.prefill_cache`, the oracles through its `active=`
mask).

Per rule: first-token KL(recompute || rule), answer agreement with the recompute arm (greedy, --max-new-tokens),
and `cover`: the share of the oracle's question-attention mass over relocated rows in reusable layers that the
rule's rows hold. Example (this 2-core CPU box, about 2 minutes per question):

    .venv/bin/python bench/row_selection.py --task hotpotqa --offset 0 --limit 4 --json hq.json
"""
from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.eval.data import load_task                                               # noqa: E402
from runtime.eval.harness import _kl, eval_profile, layout, stop_tokens                # noqa: E402
from runtime.eval.metrics import answers_agree                                        # noqa: E402
from runtime.reuse.controller import choose_top                                       # noqa: E402
from runtime.llama.artifacts import produce_llama_packed, relocate                   # noqa: E402
from runtime.reuse.engine import ReuseEngine                                        # noqa: E402
from runtime.reuse.signals import rel_deviation                                      # noqa: E402
from bench.report import write_json  # noqa: E402

RULES = ("mixed", "deviation", "attention")
ORACLES = ("oracle-attention", "oracle-deviation", "random")


def question_attention(model, caps, q_start: int, n0: int) -> torch.Tensor:
    """Per layer and relocated row [L, n_reloc]: the attention probability the question rows' heads give the row
    in the recompute arm (rows and heads summed), from the captured q and k."""
    out = []
    for c in caps:
        q, k = c["q"][q_start:].float(), c["k"].float()
        T, G = k.shape[0], q.shape[1] // k.shape[1]
        s = torch.einsum("thd,shd->ths", q, k.repeat_interleave(G, dim=1)) * model.cfg.head_dim ** -0.5
        later = torch.arange(T)[None, None, :] > torch.arange(q_start, T)[:, None, None]
        out.append(torch.softmax(s.masked_fill(later, float("-inf")), -1)[:, :, n0:q_start].sum((0, 1)))
    return torch.stack(out)


@torch.inference_mode()
def study(model, tok, ex, budget: float, max_new: int, stop: set[int]) -> dict:
    prof = eval_profile((3, 3)).replace(budget=budget)
    lay = layout(tok, ex)
    tokens = [t for s in lay.segments for t in s] + lay.question
    n0, q_start = len(lay.segments[0]), sum(map(len, lay.segments))
    n_reloc, L = q_start - n0, len(model.layers)
    reus = list(range(prof.first_fences, L - prof.last_fences))
    cache = model.new_cache()
    for lc in cache.layers:
        lc.capture = {}
    ref = model(torch.tensor(tokens), cache)
    caps = [lc.capture for lc in cache.layers]
    for lc in cache.layers:
        lc.capture = None
    arts = produce_llama_packed(model, lay.segments, [prof])[0]
    reloc = relocate(model, arts)
    att = question_attention(model, caps, q_start, n0)[reus].sum(0)
    dev = torch.stack([rel_deviation(caps[i]["k"][n0:q_start], reloc.k[i][n0:]) +
                       rel_deviation(caps[i]["v"][n0:q_start], reloc.v[i][n0:]) for i in reus]).sum(0)
    given = {"oracle-attention": choose_top(prof, att), "oracle-deviation": choose_top(prof, dev),
             "random": choose_top(prof, torch.rand(n_reloc, generator=torch.Generator().manual_seed(0)))}
    names, firsts, caches, covers = ["recompute"], [ref], [cache], {}
    for name in RULES + ORACLES:
        eng = ReuseEngine(model, prof.replace(select=name if name in RULES else "mixed"))
        r = eng.prefill_cache(arts, lay.question, reloc, active=given.get(name))
        logits, c, led = r.logits, r.state, r.ledger
        mask = torch.zeros(n_reloc, dtype=torch.bool)
        mask[list(led.active_rows)] = True                   # the rule's own rows (or the oracle's), for its cover
        assert led.active == int(mask.sum()) == math.ceil(budget * n_reloc - 1e-9), (name, led.active)
        covers[name] = float(att[mask].sum() / att.sum())
        names.append(name), firsts.append(logits), caches.append(c)
    ids = model.greedy_many(caches, firsts, max_new, stop)
    ref_answer = tok.decode(ids[0]).strip()
    row = {"id": ex.id, "relocated_rows": n_reloc, "active_rows": int(given["random"].sum())}
    for name, first, i in zip(names[1:], firsts[1:], ids[1:]):
        answer = tok.decode(i).strip()
        row[name] = {"kl": _kl(ref, first), "agree": float(answers_agree(answer, ref_answer)),
                     "cover": covers[name], "answer": answer}
    row["recompute_answer"] = ref_answer
    return row


def table(rows: list[dict]) -> str:
    lines = ["| rule | first-token KL (mean) | agreement | cover of the question's attention |", "|---|---:|---:|---:|"]
    for name in RULES + ORACLES:
        kl = statistics.mean(r[name]["kl"] for r in rows)
        agree = statistics.mean(r[name]["agree"] for r in rows)
        cover = statistics.mean(r[name]["cover"] for r in rows)
        lines.append(f"| {name} | {kl:.3f} | {agree:.2f} | {cover:.1%} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="hotpotqa", choices=["hotpotqa", "squad"])
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", default=None, help="checkpoint dir (default: SmolLM2-135M-Instruct from its GGUF)")
    p.add_argument("--json", default=None, help="write the per-question rows and the table here")
    a = p.parse_args(argv)
    from runtime.llama.gguf import convert_gguf
    from runtime.llama.loader import load_llama
    from runtime.llama.tokenizer import ChatTokenizer
    torch.set_num_threads(a.threads)
    mdir = a.model or str(convert_gguf().out)
    model = load_llama(mdir, dtype=torch.float32, device="cpu")
    tok = ChatTokenizer.from_dir(mdir)
    stop = stop_tokens(model, tok)
    rows = []
    for ex in itertools.islice(load_task(a.task), a.offset, a.offset + a.limit):
        t = time.perf_counter()
        rows.append(study(model, tok, ex, a.budget, a.max_new_tokens, stop))
        print(f"{ex.id}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    out = table(rows)
    print(out)
    write_json(a.json, {"task": a.task, "offset": a.offset, "budget": a.budget,
                        "max_new_tokens": a.max_new_tokens, "rows": rows, "table": out}, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
