"""One request end to end on one TP rank: load and verify each document's artifact, agree across ranks with one
collective, then run the reuse path, or fall back, explicitly and counted, to full recomputation of the same
(padded) tokens. A reuse-arm result always says which arm really ran.

`answer` reads whole artifact directories before the forward; `answer_staged` (the worker) validates the
certificates and manifests, agrees, and then runs the forward while later layer groups are still arriving
(`stager.GroupStager`); a late group that fails verification on any rank restarts the request, on every rank,
in the recompute arm.

A profile with a preamble (the Llama family) opens every request with it, in both arms: [preamble][documents]
[question]. The reuse arm's prefix is the preamble's own artifact (`preamble_artifact`: computed alone on this
model, exact at position 0, certified with this server's identity, held in memory), and every named document,
built after the preamble, is relocated; the recompute arm runs the same tokens (`served_tokens`)."""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime.families import build as family_build, device_of, expectations, family, prefill
from runtime.model.deepseek_v4 import ModelCache, Transformer
from .certificate import Certificate, FallbackCounter, Verdict, agree, digest_bytes, token_hash, validate
from .call import RequestState
from .engine import ReuseEngine
from runtime.model.parallel import Parallel
from .ledger import Ledger
from .prefetcher import LayerPrefetcher
from .stager import GroupStager, HotSource, StagedSource, StagingRejected, Trace, source_verdict
from .producer import pad_document
from .profile import ProfileError, ReuseProfile
from .store import CERTIFICATE_FILE, check_binding, load_artifact, read_head


@dataclass(frozen=True)
class ServingIdentity:
    """What every artifact must be bound to: the checkpoint fingerprint and the tokenizer's."""
    fingerprint: str
    tokenizer_fingerprint: str


@dataclass
class Outcome:
    logits: torch.Tensor
    arm: str                                  # "reuse" or "recompute": what really ran
    verdict: Verdict
    ledger: Ledger | None
    # what decoding continues (`step`, or a server's batched steps with other requests'): the recompute arm's
    # native cache (Transformer.decode), or the reuse arm's request state (`engine`, ReuseEngine.decode_batch)
    cache: ModelCache | None = field(default=None, repr=False)
    state: RequestState | None = field(default=None, repr=False)
    engine: ReuseEngine | None = field(default=None, repr=False)
    model: Transformer | None = field(default=None, repr=False)
    # on a fallback: the index of the document whose artifact THIS rank rejected (its certificate, manifest or a
    # shard; None where the rank only followed another's reject or nothing of one document was at fault)
    document: int | None = None

    @property
    def fell_back(self) -> bool:
        return self.arm != "reuse"

    def step(self, token: int) -> torch.Tensor:
        """This request continued by one token in the arm that ran, alone; the next logits [V]. No second
        prefill."""
        if self.cache is not None:
            return self.model(torch.tensor([token], device=device_of(self.model)), self.cache)
        return self.engine.decode(self.state, token)


def build(model, tokens: list[int], profile: ReuseProfile, ident: ServingIdentity,
          directory: str | os.PathLike, generation: int = 1) -> Path:
    """Producer + store: one document's artifact for this rank, certified (`runtime.families.build`)."""
    return family_build(model, tokens, profile, ident.fingerprint, ident.tokenizer_fingerprint, directory,
                        generation)


def served_tokens(profile: ReuseProfile, docs: list[list[int]], question: list[int], pad_id: int) -> list[int]:
    """Every token a request runs over, in either arm: the profile's preamble, each document padded to the
    profile's alignment, the question."""
    return list(profile.preamble) + [t for d in docs for t in pad_document(d, profile.align, pad_id)] + list(question)


def preamble_artifact(model, profile: ReuseProfile, ident: ServingIdentity):
    """The profile's preamble's own artifact on `model` (a `LlamaArtifact`: computed alone, so exact where every
    request puts it, at position 0), certified with this server's identity; None without a preamble. A server
    computes it once per model and profile and passes it to every `answer`/`answer_staged`."""
    if not profile.preamble:
        return None
    if family(model) != "llama":
        raise ProfileError(f"profile {profile.name!r}: a preamble is implemented on the Llama family only")
    from runtime.llama.artifacts import produce_llama
    return produce_llama(model, list(profile.preamble), profile, ident.tokenizer_fingerprint, ident.fingerprint)


def _opening(model, profile: ReuseProfile, ident: ServingIdentity, pre):
    """The preamble artifact a request opens with (None without a preamble): `pre` as given, checked against this
    model, identity and profile (a ValueError names what differs), else computed now."""
    if not profile.preamble:
        if pre is not None:
            raise ValueError(f"profile {profile.name!r} has no preamble, yet a preamble artifact was given")
        return None
    if pre is None:
        return preamble_artifact(model, profile, ident)
    v = validate(pre.cert, **expectations(model, profile, ident.fingerprint), current_generation=0,
                 tokens_hash=token_hash(profile.preamble, ident.tokenizer_fingerprint))
    if not v.ok or pre.tokens != list(profile.preamble) or pre.start != 0:
        raise ValueError(f"the preamble artifact given is not this profile's on this model: {v.reason} {v.detail}")
    return pre


def _validate(model: Transformer, profile: ReuseProfile, ident: ServingIdentity, padded: list[list[int]], items,
              current_generation: int | Sequence[int], read) -> tuple[list, list[str], Verdict]:
    """This rank's verdict on every document (`read(item, expect)` -> (artifact, certificate, verdict)), stopping
    at the first reject: the artifacts and binding digests of those accepted, and the verdict."""
    gens = [current_generation] * len(padded) if isinstance(current_generation, int) else list(current_generation)
    assert len(gens) == len(padded), f"{len(gens)} current generations for {len(padded)} documents"
    expect = expectations(model, profile, ident.fingerprint)          # the model family's
    arts, bindings = [], []
    for toks, item, gen in zip(padded, items, gens):
        art, cert, v = read(item, dict(expect, current_generation=gen,
                                       tokens_hash=token_hash(toks, ident.tokenizer_fingerprint)))
        if not v.ok:
            return arts, bindings, v
        arts.append(art)
        bindings.append(cert.binding_digest())
    return arts, bindings, Verdict.accept()


def _recompute(model: Transformer, profile: ReuseProfile, padded: list[list[int]], question: list[int],
               verdict: Verdict, counter: FallbackCounter | None, document: int | None = None) -> Outcome:
    """The model's own forward over `served_tokens` (`padded`: the documents already padded)."""
    if counter is not None:
        counter.observe(verdict)
    dev = device_of(model)
    full = torch.tensor(served_tokens(profile, padded, question, model.cfg.eos_token_id), device=dev)
    cache = model.new_cache()
    return Outcome(prefill(model, full, cache), "recompute", verdict, None, cache=cache, model=model,
                   document=document)


def _prefetched(model: Transformer, arts: list) -> list:
    """Host artifacts as the engine reads them: on CUDA each DeepSeek-V4 layer reaches the GPU one layer ahead on a
    copy stream (`LayerPrefetcher`), as this request's own copies; elsewhere as they are (the Llama family's reach
    the device in `_reuse`)."""
    dev = device_of(model)
    return LayerPrefetcher(arts, dev).documents() if dev.type == "cuda" and family(model) == "deepseek_v4" else arts


def _reuse(model: Transformer, profile: ReuseProfile, docs: list, question: list[int], verdict: Verdict,
           pre=None) -> Outcome:
    """The reuse arm over `docs` as the engine reads them (prefetched host artifacts, or a GroupStager's documents,
    which it stages itself: not wrapped again). The Llama family's documents (verified `KVLayerArtifact` layers)
    reach the device here, after the preamble's artifact `pre` where the profile has one (the prefix: every named
    document is relocated), and its reuse arm runs on the request's own KV cache (`prefill_cache`), which decoding
    then continues as the recompute arm's."""
    engine = ReuseEngine(model, profile)
    if family(model) == "llama":
        from runtime.llama.artifacts import from_document
        dev = device_of(model)
        opening = [pre] if pre is not None else []
        res = engine.prefill_cache(opening + [from_document(d, dev, profile) for d in docs], question)
        return Outcome(res.logits, "reuse", verdict, res.ledger, cache=res.state, model=model)
    res = engine.prefill(docs, question)
    return Outcome(res.logits, "reuse", verdict, res.ledger, state=res.state, engine=engine)


@torch.inference_mode()
def answer(model: Transformer, profile: ReuseProfile, docs: list[list[int]], artifact_dirs: list[str | os.PathLike],
           question: list[int], ident: ServingIdentity, current_generation: int | Sequence[int],
           counter: FallbackCounter | None = None, preamble=None) -> Outcome:
    """`current_generation`: one for every document, or one per document (documents are rebuilt independently).
    `preamble`: the profile's preamble artifact (`preamble_artifact`), where the caller keeps one; else computed."""
    pre = _opening(model, profile, ident, preamble)
    padded = [pad_document(d, profile.align, model.cfg.eos_token_id) for d in docs]

    def read(d, expect):
        art, v = load_artifact(d, expect)
        cert = Certificate.from_bytes((Path(d) / CERTIFICATE_FILE).read_bytes()) if v.ok else None
        return art, cert, v
    arts, bindings, verdict = _validate(model, profile, ident, padded, artifact_dirs, current_generation, read)
    # the one agreement collective, before any reuse-specific collective: all ranks reuse or none does, and
    # ranks that accept must have accepted the same artifacts (same binding digest); the Llama family runs at TP1
    if family(model) == "deepseek_v4":
        verdict = agree(verdict, model.par, binding=digest_bytes("|".join(bindings).encode()) if verdict.ok else None)
    if verdict.ok:
        return _reuse(model, profile, _prefetched(model, arts), question, verdict, pre)
    return _recompute(model, profile, padded, question, verdict, counter)


@torch.inference_mode()
def answer_staged(model: Transformer, profile: ReuseProfile, docs: list[list[int]],
                  sources: list[StagedSource | HotSource],
                  question: list[int], ident: ServingIdentity, current_generation: int | Sequence[int],
                  control: Parallel | None = None, counter: FallbackCounter | None = None,
                  trace: Trace | None = None, groups: Sequence[range] | None = None, preamble=None) -> Outcome:
    """`answer` over documents that arrive layer group by layer group. Each rank validates its certificates and
    manifests (everything but the layer shards), the ranks agree once (with the binding digest) before any
    reuse-specific collective, then the forward consumes group g as soon as group g is verified and staged on
    every rank (`control`: the group the per-group agreements run on, default the model's; `groups`: the layer
    groups, which every rank must share, default the sources' own). A group rejected
    by any rank (digest, missing shard, source failure) stops the reuse forward on every rank at the same
    layer, and the request runs again, whole, in the recompute arm: the counted fallback, same answer.

    A `HotSource` (a document verified earlier and kept in pinned host memory) is checked for its binding only.
    When every document is hot, the forward takes `answer`'s path over them: each layer staged one layer ahead in
    one copy (`LayerPrefetcher`), nothing read, parsed or digested. `preamble`: as in `answer`."""
    pre = _opening(model, profile, ident, preamble)
    padded = [pad_document(d, profile.align, model.cfg.eos_token_id) for d in docs]

    def read(src: StagedSource | HotSource, expect):
        if isinstance(src, HotSource):
            v = check_binding(src.head, expect)
            return src.head, src.head.certificate if v.ok else None, v
        files, v = source_verdict(src.head)
        head, v = read_head(files, expect) if v.ok else (None, v)
        return head, head.certificate if v.ok else None, v
    heads, bindings, verdict = _validate(model, profile, ident, padded, sources, current_generation, read)
    document = None if verdict.ok else len(heads)      # `_validate` stops at the first document it rejects
    if family(model) == "llama":            # TP1: no agreement; every layer verified before the forward
        return _whole_llama(model, profile, padded, sources, heads, question, verdict, counter, document, pre)
    hot = all(isinstance(s, HotSource) for s in sources)
    if model.par.size > 1:      # every rank takes the same path (the staged one runs per-group agreements)
        hot = all((control or model.par).all_gather_object(hot))
    # staging starts before the agreement (it only reads); nothing is consumed before every rank accepted
    stager = GroupStager(heads, sources, device_of(model), control or model.par, trace, groups).start() \
        if verdict.ok and not hot else None
    verdict = agree(verdict, model.par, binding=digest_bytes("|".join(bindings).encode()) if verdict.ok else None)
    if verdict.ok:
        if hot:
            return _reuse(model, profile, _prefetched(model, [s.doc for s in sources]), question, verdict)
        try:
            return _reuse(model, profile, stager.documents(), question, verdict)
        except StagingRejected as r:
            verdict, document = r.verdict, r.document
    return _recompute(model, profile, padded, question, verdict, counter, document)


def _whole_llama(model, profile: ReuseProfile, padded: list[list[int]], sources: list[StagedSource | HotSource],
                 heads: list, question: list[int], verdict: Verdict, counter: FallbackCounter | None,
                 document: int | None, pre) -> Outcome:
    """`answer_staged` on the Llama family (TP1): every layer group of every document verified against its
    certificate, parsed and pinned (`StagedSource.read`, shared with the worker's tier) before the reuse forward,
    which runs on the request's own KV cache; the first group any document fails names the fallback."""
    if not verdict.ok:
        return _recompute(model, profile, padded, question, verdict, counter, document)
    docs = []
    for d, (src, head) in enumerate(zip(sources, heads)):
        if isinstance(src, HotSource):
            docs.append(src.doc)
            continue
        layers, v = src.read_all(head)
        if not v.ok:
            return _recompute(model, profile, padded, question, v, counter, d)
        docs.append(head.document(layers))
    return _reuse(model, profile, docs, question, verdict, pre)
