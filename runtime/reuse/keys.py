"""A segment's keys in one layer and the helpers that move them to a request's frame: each relocated document's
keys stay in their canonical frame (positions 0..n-1) and the query is turned to t - Delta instead (docs/reuse.md).
Everything here that depends only on the request's rows is made once per call's rows (`memo` over `trig`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.kernels._host import to_device_nowait
from runtime.model.config import WINDOW


@dataclass
class SegmentKeys:
    """One segment's keys in one layer, in its canonical frame (positions 0..n-1)."""
    delta: int
    latent: torch.Tensor                      # [n, D]
    entries: torch.Tensor | None = None       # [N, D]
    index_keys: torch.Tensor | None = None    # [N, id]


def memo(trig, key, make):
    """`make()` once per key for all the request's layers: `trig` is the rows' per-request cache (None: none)."""
    if trig is None:
        return make()
    if key not in trig:
        trig[key] = make()
    return trig[key]


def shifted(qpos, lo, hi, delta, trig):
    """Rows lo..hi's positions in a segment's frame (t - Delta)."""
    return memo(trig, ("pos", lo, hi, delta), lambda: qpos[lo:hi] - delta)


def angles(attn, qpos, lo, hi, delta, trig):
    """cos/sin at t - delta for rows lo..hi. Every non-window layer has the same rotary (YaRN, compress theta) and
    every window layer the same plain one (Attention.__init__), so one cache per call's rows serves all layers."""
    return memo(trig, (attn.kind == WINDOW, lo, hi, delta),
                 lambda: attn.rotary.cos_sin(shifted(qpos, lo, hi, delta, trig)))


def delta_turns(attn, deltas: tuple[int, ...], device, trig) -> torch.Tensor:
    """[P, 2, rd/2] float32: cos and sin of each Delta x the layer's frequencies (the turn of a key stored at 0..
    to its place), the model's own angles (`Rotary.cos_sin`); once per call's rows and places (`trig`)."""
    return memo(trig, ("delta_angles", attn.kind == WINDOW, deltas), lambda: torch.stack(
        attn.rotary.cos_sin(to_device_nowait(torch.tensor(deltas, dtype=torch.long), device)), dim=1))


def offsets(segments: list[SegmentKeys], attr: str) -> tuple[list[int], int]:
    """Global ids over every segment's `attr` ("entries" or "index_keys"): segment j's row w is first[j] + w; total
    = all rows. (A segment's indexer keys and entries come from compressors of the same ratio over the same rows,
    so the two numberings agree.)"""
    first, total = [], 0
    for s in segments:
        first.append(total)
        rows = getattr(s, attr)
        total += 0 if rows is None else rows.shape[0]
    return first, total

