"""The Llama family's artifacts (SPEC §4 on GQA): per layer the document's K/V at canonical positions and, in
reusable layers, the Local heads' output projection W_o,L O_L; their producers (one document, one document for
several profiles, several documents packed into one forward), their certificate in the shared format, and their
relocation to a request's positions (K rotated once by each segment's offset). The services store them in the
shared artifact format (`runtime/reuse/store.py`: a `kv` and a `local` shard per layer, `to_document`, `build`) and
read them back layer by layer as any artifact (`from_document`)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.llama.model import Llama
from runtime.model.quant import dequant_fp8_rows, quant_fp8_rows
from runtime.reuse.artifact import DocumentArtifact, KVLayerArtifact
from runtime.reuse.certificate import Certificate, token_hash
from runtime.reuse.controller import doc_offsets
from runtime.reuse.profile import ReuseProfile

PRODUCER_VERSION = "redknot-llama-producer/1"

@dataclass
class LlamaArtifact:
    tokens: list[int]
    k: list[torch.Tensor]                     # per layer [n, KV, D], RoPE at canonical positions 0..n-1
    v: list[torch.Tensor]                     # per layer [n, KV, D]
    local: list[torch.Tensor | None]          # per layer [n, d]: W_o,L O_L in reusable layers
    cert: Certificate | None = None           # what the artifact is certified for (`certify`)
    start: int = 0                            # canonical position of its first row (after its profile's preamble)
    # local_format="fp8": `local` holds float8_e4m3fn codes and `local_s` their uint8 E8M0 exponents per row and 128
    # channels (`quant_fp8_rows`), as DeepSeek-V4's artifacts store them; None for the model's own dtype
    local_s: list[torch.Tensor | None] | None = None

    @property
    def n(self) -> int:
        return len(self.tokens)

    def local_at(self, i: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Layer i's W_o,L O_L in `dtype`: the stored tensor cast, or its FP8 codes dequantized (exact in float32,
        then `dtype`: what DeepSeek-V4's restore computes)."""
        p = self.local[i]
        s = None if self.local_s is None else self.local_s[i]
        if p is None:
            return None
        return p.to(dtype) if s is None else dequant_fp8_rows(p, s, dtype)


def _stored_local(p: torch.Tensor, prof: ReuseProfile) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A layer's W_o,L O_L as `prof` stores it: itself, or (codes, scales) for local_format="fp8"."""
    return quant_fp8_rows(p) if prof.local_format == "fp8" else (p, None)


def _split_local(pairs: list) -> tuple[list, list | None]:
    """Per-layer (tensor, scales) pairs (None where a layer has none) -> (`local`, `local_s` or None)."""
    local = [None if q is None else q[0] for q in pairs]
    scales = [None if q is None else q[1] for q in pairs]
    return local, (scales if any(x is not None for x in scales) else None)


def expectations(model: Llama, fingerprint: str = "") -> dict:
    """What a consumer on `model` requires of a certificate (`certificate.validate`'s keywords but the token hash,
    profile and generation): one rank holding every head and channel, every layer's K/V, the model's dtype and
    this producer. `fingerprint`: the checkpoint's, where the caller has one (the eval harness produces and
    consumes on one loaded model and leaves it empty)."""
    return dict(fingerprint=fingerprint, tp_size=1, tp_rank=0, channel_range=(0, model.cfg.hidden_size),
                layers_needed=set(range(len(model.layers))),
                dtype=str(next(model.parameters()).dtype).removeprefix("torch."), producer_version=PRODUCER_VERSION)


def certify(model: Llama, tokens: list[int], prof: ReuseProfile, tokenizer_fp: str = "",
            fingerprint: str = "") -> Certificate:
    """The certificate of an artifact of `tokens` produced on `model` for `prof` (held in memory: generation 0,
    no shard digests), in the shared certificate format the DeepSeek artifacts use."""
    e = expectations(model, fingerprint)
    return Certificate(e["fingerprint"], token_hash(tokens, tokenizer_fp), len(tokens), prof.to_dict(), 1, 0,
                       e["channel_range"], tuple(sorted(e["layers_needed"])), e["dtype"], PRODUCER_VERSION)


def global_heads(model: Llama, prof: ReuseProfile) -> torch.Tensor:
    G = model.cfg.num_attention_heads // model.cfg.num_key_value_heads
    return torch.arange(model.cfg.num_attention_heads) % G < prof.global_per_group


@torch.inference_mode()
def produce_llama(model: Llama, tokens: list[int], prof: ReuseProfile, tokenizer_fp: str = "",
                  fingerprint: str = "") -> LlamaArtifact:
    return produce_llama_many(model, tokens, [prof], tokenizer_fp, fingerprint)[0]


@torch.inference_mode()
def produce_llama_many(model: Llama, tokens: list[int], profs: list[ReuseProfile], tokenizer_fp: str = "",
                       fingerprint: str = "") -> list[LlamaArtifact]:
    """One document's artifact for each profile from one forward: K/V do not depend on the profile (the
    artifacts share those tensors), the Local projections only on the fences and Global heads per group. With a
    preamble (every profile's the same) the document runs after it and keeps its own rows (`start` = its length);
    the preamble's own artifact is computed alone."""
    n_layers = len(model.layers)
    dev = next(model.parameters()).device
    pre = _preamble(profs, tokens)
    cache = model.new_cache()
    for lc in cache.layers:
        lc.capture = {}
    model(torch.tensor(pre + list(tokens), device=dev), cache)
    P = len(pre)
    caps = [{k: v[P:] for k, v in lc.capture.items()} for lc in cache.layers]
    for lc in cache.layers:
        lc.capture = None
    ks = [c["k"].clone() for c in caps]
    vs = [c["v"].clone() for c in caps]
    # (layer, global_per_group, local_format) -> W_o,L O_L as stored: (tensor, FP8 scales or None)
    local: dict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor | None]] = {}
    out = []
    for prof in profs:
        loc = (~global_heads(model, prof)).nonzero().flatten().to(dev)      # Local head ids (host mask: no sync)
        locals_ = []
        for i, (layer, cap) in enumerate(zip(model.layers, caps)):
            if i < prof.first_fences or i >= n_layers - prof.last_fences:
                locals_.append(None)
                continue
            key = (i, prof.global_per_group, prof.local_format)
            if key not in local:
                local[key] = _stored_local(layer.self_attn.project(cap["o"].index_select(1, loc), heads=loc), prof)
            locals_.append(local[key])
        lp, ls = _split_local(locals_)
        out.append(LlamaArtifact(list(tokens), ks, vs, lp, certify(model, tokens, prof, tokenizer_fp, fingerprint),
                                 start=P, local_s=ls))
    return out


def start_of(prof: ReuseProfile, tokens: list[int]) -> int:
    """The canonical position of the first row of `tokens`' artifact for `prof` (what its certificate binds through
    the profile): the preamble's length, or 0 without one or for the preamble itself."""
    return len(_preamble([prof], tokens))


def _preamble(profs: list[ReuseProfile], tokens: list[int]) -> list[int]:
    """The preamble the document `tokens` is built after (every profile's must be the same): none when the document
    is the preamble itself (a request opens with it, computed alone)."""
    pres = {p.preamble for p in profs}
    if len(pres) > 1:
        raise ValueError("one forward builds artifacts for profiles of one preamble")
    pre = list(next(iter(pres), ()))
    return [] if list(tokens) == pre else pre


@torch.inference_mode()
def produce_llama_packed(model: Llama, segments: list[list[int]], profs: list[ReuseProfile], tokenizer_fp: str = "",
                         fingerprint: str = "") -> list[list[LlamaArtifact]]:
    """`produce_llama_many` for every document of a request in one packed forward (`Llama.forward_packed`):
    per profile, the artifacts of the documents in order; equal to producing each alone up to rounding (each
    after the profiles' preamble, but the preamble's own)."""
    n_layers = len(model.layers)
    pres = [_preamble(profs, t) for t in segments]
    caps = model.forward_packed([p + list(t) for p, t in zip(pres, segments)])
    dev = caps[0][0].device
    spans, o = [], 0                        # each document's own rows in the packed forward
    for p, t in zip(pres, segments):
        spans.append((o + len(p), o + len(p) + len(t)))
        o += len(p) + len(t)
    cut = lambda x: [x[a:b] for a, b in spans]            # noqa: E731
    ks = list(zip(*(cut(k) for k, _, _ in caps)))                          # per document, per layer
    vs = list(zip(*(cut(v) for _, v, _ in caps)))
    local: dict[tuple[int, int, str], list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
    out = []
    for prof in profs:
        loc = (~global_heads(model, prof)).nonzero().flatten().to(dev)
        per_layer = []
        for i, (layer, (_, _, o)) in enumerate(zip(model.layers, caps)):
            if i < prof.first_fences or i >= n_layers - prof.last_fences:
                per_layer.append([None] * len(segments))
                continue
            key = (i, prof.global_per_group, prof.local_format)
            if key not in local:        # each document's rows quantized on their own (as produced alone)
                local[key] = [_stored_local(x, prof)
                              for x in cut(layer.self_attn.project(o.index_select(1, loc), heads=loc))]
            per_layer.append(local[key])
        arts = []
        for j, t in enumerate(segments):
            lp, ls = _split_local([p[j] for p in per_layer])
            arts.append(LlamaArtifact(list(t), list(ks[j]), list(vs[j]), lp,
                                      certify(model, t, prof, tokenizer_fp, fingerprint), start=len(pres[j]),
                                      local_s=ls))
        out.append(arts)
    return out


@dataclass
class Relocated:
    """Every document row's artifact K/V at its request position (K rotated by its segment's offset; the
    prefix's offset is 0), per layer [q_start, KV, D]. The naive and reuse arms of one request share it: the
    artifacts' K/V do not depend on the profile."""
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    deltas: list[int]
    n: int                                    # q_start: rows before the question


@torch.inference_mode()
def relocate(model: Llama, docs: list[LlamaArtifact]) -> Relocated:
    deltas = doc_offsets([d.n for d in docs])
    pos = deltas[-1] + docs[-1].n
    dev = docs[0].k[0].device
    shift = torch.tensor([dl - d.start for d, dl in zip(docs, deltas) for _ in range(d.n)], device=dev)
    L = len(model.layers)
    k = torch.cat([torch.stack(d.k, dim=1) for d in docs])                # [q_start, L, KV, D]
    k = model.rotary.rotate(k, shift)
    v = torch.cat([torch.stack(d.v, dim=1) for d in docs])
    return Relocated([k[:, i] for i in range(L)], [v[:, i] for i in range(L)], deltas, pos)


# ------------------------------------------------------------------------------- the store format (the services)

def to_document(art: LlamaArtifact) -> DocumentArtifact:
    """`art` as the shared artifact format holds it: one `KVLayerArtifact` a layer, TP1, meta naming the family."""
    dtype = str(art.k[0].dtype).removeprefix("torch.")
    scales = art.local_s or [None] * len(art.k)
    return DocumentArtifact(list(art.tokens), len(art.tokens),
                            [KVLayerArtifact(k, v, p, s) for k, v, p, s in zip(art.k, art.v, art.local, scales)],
                            meta={"family": "llama", "dtype": dtype, "producer_version": PRODUCER_VERSION})


def from_document(doc: DocumentArtifact, device: torch.device | str | None = None,
                  prof: ReuseProfile | None = None) -> LlamaArtifact:
    """A stored Llama artifact (read and verified against its certificate layer by layer) as the engine reads it;
    on `device` where given (one copy per tensor), else the layers' own tensors. `prof`: the profile its
    certificate was checked against, whose preamble (if any) the document was built after (`start_of`)."""
    def on(t: torch.Tensor | None) -> torch.Tensor | None:
        return t if t is None or device is None else t.to(device, non_blocking=True)
    layers = doc.layers
    if not all(isinstance(la, KVLayerArtifact) for la in layers):
        raise TypeError("not a Llama-family artifact (its layers are not KVLayerArtifact)")
    scales = [on(la.local_s) for la in layers]
    return LlamaArtifact(list(doc.tokens), [on(la.k) for la in layers], [on(la.v) for la in layers],
                         [on(la.local_p) for la in layers],
                         start=start_of(prof, doc.tokens) if prof is not None else 0,
                         local_s=scales if any(x is not None for x in scales) else None)


def build(model: Llama, tokens: list[int], prof: ReuseProfile, fingerprint: str, tokenizer_fp: str,
          directory: str | os.PathLike, generation: int = 1) -> Path:
    """Producer + store for the services' builder: `tokens`' artifact for `prof`, certified in `directory` (TP1,
    every channel: `expectations`)."""
    from runtime.reuse.store import save_artifact
    art = produce_llama(model, tokens, prof, tokenizer_fp, fingerprint)
    e = expectations(model, fingerprint)
    save_artifact(to_document(art), directory, dict(
        fingerprint=fingerprint, token_hash=token_hash(art.tokens, tokenizer_fp), profile=prof.to_dict(),
        channel_range=e["channel_range"], dtype=e["dtype"], producer_version=PRODUCER_VERSION,
        generation=generation))
    return Path(directory)
