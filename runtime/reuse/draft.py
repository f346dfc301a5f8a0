"""The question's draft attention on DeepSeek-V4 (profile `select="attention"`, next to the native indexer's
class in `select="mixed"`): the rule that measured best on the Llama family (docs/QUALITY.md, "Row selection"),
the same question asked of the V4 model.

After the first fences, the question rows alone run on through every reusable layer with the engine's own layer
math over every document's artifact keys as stored (relocated, nothing recomputed: what the naive arm sees), like
decode steps. In each of those layers their queries score every document row's stored latent (K = V), each
segment's rows with the query turned to t - Delta as the reuse path does, and the softmax over all document rows
(dense: the sparse path's window, compressed entries and sink left out, so every row gets a share) gives each
relocated row the probability mass the question's heads put on it. Summed over layers, question rows and heads
(all TP ranks), it ranks the relocated rows; `controller.choose` gives the budget to the top ones."""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from runtime.model.deepseek_v4 import CompressorState, Rotary
from .call import Call, LayerRows, RequestState
from .keys import SegmentKeys
from .rows import Rows, Split
from .signals import attention_mass


def document_mass(attn, q: torch.Tensor, latents: list[torch.Tensor], deltas: list[int]) -> list[torch.Tensor]:
    """Per document [n_j] float32: the softmax mass over every document row (all segments together) that the
    queries q [T,H,D] (normed, roped at their request positions t) put on each of its rows, summed over rows and
    heads. Segment j (canonical latent [n_j, D], at offset deltas[j]) is scored with the query turned back by
    Delta_j, to t - Delta_j. Two passes per segment (the normalizer, then the mass), so no [T, H, all rows]
    score tensor is held."""
    T = q.shape[0]
    turned = [q if dl == 0 else Rotary.apply(q, *attn.rotary.cos_sin(torch.full((T,), dl, device=q.device)),
                                             inverse=True) for dl in deltas]
    lse = torch.stack([torch.logsumexp(torch.einsum("thd,sd->ths", qt.float(), k.float()) * attn.scale, -1)
                       for qt, k in zip(turned, latents)]).logsumexp(0)
    return [attention_mass(qt, k[:, None], lse, attn.scale) for qt, k in zip(turned, latents)]


def draft_attention(model, layers: list[int], xq: torch.Tensor, pos_q: torch.Tensor, latents: Callable,
                    deltas: list[int], step: Callable, count: Callable) -> torch.Tensor:
    """[n_reloc] float32 per relocated row: the question's draft attention (module docstring). `xq` [T, hc, D]:
    the question rows' streams after the first fences; `latents(i)`: every document's stored latent in layer i,
    prefix first; `step(i, xq, hn, post, comb)`: the engine's layer over the question rows alone (naive view),
    returning their next streams; `count(i, keys)`: where the draft's cost goes."""
    score = None
    for i in layers:
        block = model.layers[i]
        h, post, comb = block.hc_pre(xq, "attn")
        hn = block.attn_norm(h)
        lat = latents(i)
        mass = document_mass(block.attn, block.attn.queries(hn, pos_q)[0], lat, deltas)
        rel = torch.cat(mass[1:]) if len(mass) > 1 else mass[0][:0]
        score = rel if score is None else score + rel
        count(i, sum(t.shape[0] for t in lat))
        xq = step(i, xq, hn, post, comb)
    return model.par.all_reduce(score)


def draft_rows(engine, call: Call, xq: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
               deltas: list[int]) -> torch.Tensor:
    """`draft_attention` with `engine`'s (a DeepSeekAdapter's) own layer over the question rows alone: their own
    segment at the request's q_start, every document's keys its artifact's, the new segment's compressors
    continuing from the last document's stored tail state. Its cost goes to the call's ledger (`draft_layer`);
    nothing of it is kept."""
    docs, n_q = call.docs, xq.shape[0]
    q_start = deltas[-1] + docs[-1].n
    rows = Split(Rows(None, positions, np.arange(q_start, q_start + n_q)), None)
    state = RequestState({}, {}, {}, {}, {}, q_start, q_start + n_q)
    quiet = Call(docs, None)                     # the draft's own layer counts are not the request's

    def carried(prev) -> CompressorState:
        return CompressorState() if prev is None else CompressorState(prev_kv=prev[0].clone(),
                                                                      prev_gate=prev[1].clone())

    def step(i, x, hn, post, comb):
        arts = [d.layers[i] for d in docs]
        state.seg_keys[i] = [SegmentKeys(dl, a.latent, a.entries, a.index_keys) for a, dl in zip(arts, deltas)]
        state.new_latent[i] = hn.new_zeros((0, engine.cfg.head_dim))
        state.new_comp[i], state.new_index[i] = carried(arts[-1].comp_prev), carried(arts[-1].index_prev)
        return engine._rows(quiet, LayerRows(i, engine.model.layers[i], x, hn, post, comb, tokens, rows, 0, False,
                                             False), state)

    def count(i, keys):
        if call.ledger is not None:
            call.ledger.draft_layer(i, n_q, q_start + n_q, keys)

    return draft_attention(engine.model, engine.profile.reusable_layers(engine.cfg), xq, positions,
                           lambda i: [d.layers[i].latent for d in docs], deltas, step, count)
