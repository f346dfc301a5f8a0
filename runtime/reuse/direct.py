"""A layer group's shards read straight into the slabs that hold its layers (`DirectGroup`): the worker's fetch
through the store's local socket, which hands it each blob's descriptor.

    group = DirectGroup(head, range(4, 8), pinned=True)     # slabs laid out as `packing.pin_layers` lays them out
    for shard descriptor fd:  prefix, targets = group.place(fd, file_name, size)
        # the reader fills `targets` with the file's bytes after `prefix`, hashes prefix + targets in file order
        # against the store's digest, and calls group.verified(file_name, digest)
    layers, verdict = group.result(head)                   # every shard there, each digest the certificate's

A layer's packed layout (`packing._layout`: every tensor of the layer in one run of bytes, in field order) follows
from the verified manifest alone (each shard's tensor names, shapes and dtypes), so the slabs are allocated before
a byte arrives, and each shard's safetensors header (read first, a few hundred bytes) says where in the file each
tensor's bytes lie: `place` maps them to the tensor's place in its layer's slab and the reader moves them there
with one `preadv` from the page cache. On the bytes path (`store.read_layers`, then `pin_layers`) every byte crossed
host memory three more times (into a fresh `bytes`, faulting its pages in; hashed; copied into the slab tensor by
tensor under the GIL). Here each byte is written once (into page-locked memory that the tier keeps and the
device copy reads) and hashed once, by the consuming side.

A header that does not match the manifest rejects the group (digest_mismatch, as `read_layers` says it); its bytes
still go somewhere (a scratch buffer) so that the reader can tell a corrupt blob (the store's digest fails: the store
is told) from a committed blob that disagrees with the certificate."""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch

from .artifact import LayerArtifact
from .certificate import FallbackReason, Verdict
from .packing import _layout, layer_tensors, rebuild, slab_plan
from .store import ArtifactHead, _Reject, _layer, check_tensors, safetensors_spans, shard_file

HEADER_PROBE = 8        # bytes read first: the safetensors header's length


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise _Reject(Verdict.reject(FallbackReason.DIGEST_MISMATCH, f"manifest names an unknown dtype {name!r}"))
    return dt


@dataclass
class _Shard:
    entry: dict                                     # its manifest entry
    places: dict[str, torch.Tensor]                 # tensor name -> its bytes' place in a slab (uint8)
    digest: str | None = None                       # the digest its bytes were verified against, once read


class DirectGroup:
    """One document's layers `layers` (a range) for one certificate's manifest, in slabs of page-locked memory
    (`pinned`; plain memory where no GPU exists), filled shard by shard by a reader (`place`, `verified`) from any
    number of threads, then handed out verified (`result`). `nbytes`: the shards' bytes."""

    def __init__(self, head: ArtifactHead, layers: range, pinned: bool):
        m = head.manifest
        self.layers, self.nbytes = layers, 0
        entries = {shard_file(s["name"]): s for s in m["shards"] if s["layer"] in set(layers)}
        self._lock = threading.Lock()
        self._rejected: Verdict | None = None
        self._shards: dict[str, _Shard] = {}
        try:
            meta = {e["name"]: {k: torch.empty(shape, dtype=_dtype(dt), device="meta")
                                for k, (shape, dt) in e["tensors"].items()} for e in entries.values()}
            templates = [_layer(m, i, meta) for i in layers]
        except _Reject as r:                        # a manifest whose shards do not make its layers
            self._rejected, templates = r.verdict, []
        owner = {id(t): (shard_file(name), k) for name, ts in meta.items() for k, t in ts.items()} if templates else {}
        plans = [(ts, _layout(ts)) for ts in map(layer_tensors, templates)]
        self._layers: list[LayerArtifact | None] = [None] * len(templates)
        places: dict[str, dict[str, torch.Tensor]] = {f: {} for f in entries}
        for cap, placed in slab_plan([size for _, (_, size, _) in plans], [a for _, (_, _, a) in plans]) \
                if plans else []:
            slab = torch.empty(cap, dtype=torch.uint8, pin_memory=pinned)
            for li, o in placed:
                ts, (offs, size, _) = plans[li]
                flat = slab[o:o + size]
                self._layers[li] = rebuild(templates[li], flat, offs, ts)
                for t, off in zip(ts, offs):
                    f, k = owner[id(t)]
                    places[f][k] = flat[off:off + t.numel() * t.element_size()]
        self._shards = {f: _Shard(e, places[f]) for f, e in entries.items()}

    def place(self, fd: int, file: str, size: int) -> tuple[bytes, list]:
        """Where the bytes of shard file `file` (`size` bytes, open as `fd`) go: (the prefix read here, the
        buffers that take the rest of the file in order). Never raises on content: a shard this group does not
        expect, or whose header disagrees with the manifest, rejects the group and its bytes go to scratch."""
        head = os.pread(fd, HEADER_PROBE, 0)
        if len(head) == HEADER_PROBE:
            n = int.from_bytes(head, "little")
            if 0 <= n <= size - HEADER_PROBE:
                head += os.pread(fd, n, HEADER_PROBE)
        sh = self._shards.get(file)
        try:
            if sh is None:
                raise _Reject(Verdict.reject(FallbackReason.DIGEST_MISMATCH, f"{file} is not a shard of layers "
                                             f"{self.layers.start}..{self.layers.stop - 1}"))
            try:
                base, spans = safetensors_spans(head, size)
            except ValueError as e:
                raise _Reject(Verdict.reject(FallbackReason.DIGEST_MISMATCH, f"shard {file} does not parse: {e}"))
            check_tensors(sh.entry["name"], {k: (shape, dt) for _, _, k, dt, shape in spans}, sh.entry)
            with self._lock:
                self.nbytes += size
            # a tensor the layers do not use (none today) is still read, to be hashed, into scratch
            return head[:base], [sh.places[k].numpy() if k in sh.places else bytearray(e - b)
                                 for b, e, k, _, _ in spans]
        except _Reject as r:
            self._reject(r.verdict)
            rest = max(0, size - len(head))
            return head, [bytearray(rest)] if rest else []

    def _reject(self, v: Verdict) -> None:
        with self._lock:
            if self._rejected is None:
                self._rejected = v

    def verified(self, file: str, digest: str) -> None:
        """The reader's word: `file`'s bytes, all of them placed, hash to `digest` (the store's)."""
        sh = self._shards.get(file)
        if sh is not None:
            sh.digest = digest

    def result(self, head: ArtifactHead) -> tuple[list[LayerArtifact] | None, Verdict]:
        """The group's layers (views of the slabs, laid out as `pin_layers` lays them out) if every shard of its
        layers was read and hashes to `head`'s certified digest (missing -> missing_shard, other bytes ->
        digest_mismatch, in sorted order); otherwise the reject."""
        if self._rejected is not None:
            return None, self._rejected
        for f in sorted(self._shards):
            sh = self._shards[f]
            name = sh.entry["name"]
            if sh.digest is None:
                return None, Verdict.reject(FallbackReason.MISSING_SHARD, f"shard {name} not found")
            want = head.certificate.shard_digests.get(name)
            if sh.digest != want:
                return None, Verdict.reject(FallbackReason.DIGEST_MISMATCH,
                                            f"shard {name} digest {sh.digest[:16]} != certified {str(want)[:16]}")
        return list(self._layers), Verdict.accept()
