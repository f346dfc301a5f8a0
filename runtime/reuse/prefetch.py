"""Hot artifacts in pinned host memory, staged to the GPU one layer ahead on a dedicated CUDA stream.

The consumer asks for layer i; the copy of layer i (issued while layer i-1 ran) is ordered before its use by
a CUDA event that the compute stream waits on (a device-side wait, never a host poll), and layer i+1's copy is
issued at once. Staged tensors are recorded on the compute stream so their memory is not reused early."""
from __future__ import annotations

from dataclasses import fields

import torch

from .artifact import DocumentArtifact, LayerArtifact


def _map(la: LayerArtifact, fn) -> LayerArtifact:
    out = {}
    for f in fields(LayerArtifact):
        v = getattr(la, f.name)
        if isinstance(v, tuple):
            v = tuple(fn(t) for t in v)
        elif isinstance(v, torch.Tensor):
            v = fn(v)
        out[f.name] = v
    return LayerArtifact(**out)


def pin(doc: DocumentArtifact) -> DocumentArtifact:
    """A copy of `doc` whose tensors live in page-locked host memory (the hot tier); plain host memory where no
    GPU exists (page-locking needs one)."""
    pinned = torch.cuda.is_available()
    return DocumentArtifact(doc.tokens, doc.n_content,
                            [_map(la, lambda t: t.cpu().pin_memory() if pinned else t.cpu()) for la in doc.layers],
                            doc.tp_rank, doc.tp_size, dict(doc.meta))


class LayerPrefetcher:
    def __init__(self, docs: list[DocumentArtifact], device: torch.device, depth: int = 1):
        self.docs, self.device, self.depth = docs, torch.device(device), depth
        self.n_layers = len(docs[0].layers)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self.staged: dict[int, tuple[list[LayerArtifact], object]] = {}
        self.bytes_copied = 0

    def _issue(self, i: int) -> None:
        if i in self.staged or i >= self.n_layers:
            return
        if not self.cuda:
            self.staged[i] = ([d.layers[i] for d in self.docs], None)
            return
        with torch.cuda.stream(self.stream):
            def copy(t):
                self.bytes_copied += t.numel() * t.element_size()
                return t.to(self.device, non_blocking=True)
            layers = [_map(d.layers[i], copy) for d in self.docs]
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self.staged[i] = (layers, ev)

    def get(self, i: int) -> list[LayerArtifact]:
        self._issue(i)
        layers, ev = self.staged[i]
        if ev is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(ev)
            for la in layers:
                _map(la, lambda t: (t.record_stream(cur), t)[1])
        for j in range(i + 1, i + 1 + self.depth):
            self._issue(j)
        for old in [k for k in self.staged if k < i]:
            del self.staged[old]
        return layers

    def documents(self) -> list[DocumentArtifact]:
        """Views of the documents whose `layers[i]` comes through this prefetcher."""
        return [DocumentArtifact(d.tokens, d.n_content, _StagedLayers(self, j), d.tp_rank, d.tp_size, d.meta)
                for j, d in enumerate(self.docs)]


class _StagedLayers:
    def __init__(self, pf: LayerPrefetcher, j: int):
        self.pf, self.j = pf, j

    def __getitem__(self, i: int) -> LayerArtifact:
        return self.pf.get(i)[self.j]

    def __len__(self) -> int:
        return self.pf.n_layers
