"""`LayerPrefetcher` (benchmarks, and `request.answer` on CUDA): hot artifacts already in pinned host memory, staged
one layer ahead on a dedicated CUDA stream. The engine asks for layer i; the copy of layer i (issued while layer i-1
ran) is ordered before its use by a CUDA event that the compute stream waits on (a device-side wait, never a host
poll), and layer i+1's copy is issued at once. A layer's buffer is allocated from the compute stream's pool (one
pool for the forward and its staging); the side stream waits for that allocation before writing it. Every layer
copied here is this request's own (`Owner.REQUEST`): the engine overlays active rows on it in place."""
from __future__ import annotations

import torch

from .artifact import DocumentArtifact, LayerArtifact, Owner
from .packing import host_plan, layer_tensors, map_layer, pack_documents


class LayerPrefetcher:
    def __init__(self, docs: list[DocumentArtifact], device: torch.device, depth: int = 1):
        self.docs, self.device, self.depth = docs, torch.device(device), depth
        self.n_layers = len(docs[0].layers)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        # per layer: every document's staged layer, the copy's event, and one tensor per storage they are views of
        # (what the compute stream records once it reads them)
        self.staged: dict[int, tuple[list[LayerArtifact], object, list[torch.Tensor]]] = {}
        self._ready: set[int] = set()           # layers whose copy the compute stream already waits on
        self.bytes_copied = 0
        self.loose = 0              # (layer, document) pairs staged tensor by tensor: not packed by `pin`

    def _issue(self, i: int) -> None:
        if i in self.staged or i >= self.n_layers:
            return
        if not self.cuda:         # the documents' own layers, owned as they are
            self.staged[i] = ([d.layers[i] for d in self.docs], None, [])
            return
        cur = torch.cuda.current_stream(self.device)
        held: list[torch.Tensor] = []

        def alloc(n: int) -> torch.Tensor:
            # the layer's buffer comes from the compute stream's pool, which reads it and frees it: blocks cached
            # for the side stream cannot serve the compute stream's allocations, and with them beside what a
            # recompute-sized forward leaves cached, a 128K reuse request made the allocator retry (free its cache,
            # synchronizing every stream) and map memory anew, 61 cudaMallocs a request; with one pool, none
            # (docs/BENCHMARKS.md run 15).
            # The side stream writes it only once the compute stream reached this allocation (the block may be one
            # the compute stream freed and its queued work still uses), and it is recorded on the side stream so
            # that a buffer freed before its copy ended (a layer never read) is not reused early.
            with torch.cuda.stream(cur):
                buf = torch.empty(n, dtype=torch.uint8, device=self.device)
                ev = torch.cuda.Event()
                ev.record(cur)
            self.stream.wait_event(ev)
            buf.record_stream(self.stream)
            held.append(buf)                   # every staged tensor of the layer is a view of this one buffer
            return buf

        with torch.cuda.stream(self.stream):
            copied = []

            def copy(t):
                self.bytes_copied += t.numel() * t.element_size()
                out = t.to(self.device, non_blocking=True)
                copied[-1] &= out.data_ptr() != t.data_ptr()      # already on the device: no copy was made
                return out
            host = [d.layers[i] for d in self.docs]
            hp = [host_plan(la) for la in host]
            if all(t.device.type == "cpu" for ts, _, _ in hp for t in ts):
                # host documents: one buffer for the whole layer; a pinned, packed document's layer (`pin`) is
                # copied whole (one copy), any other tensor by tensor into its slot (counted in `loose`)
                sources = [src for _, _, src in hp]
                self.loose += sum(src is None for src in sources)
                layers, n = pack_documents(host, self.device, lambda slot, src: slot.copy_(src, non_blocking=True),
                                           sources, alloc, [(ts, lay) for ts, lay, _ in hp], Owner.REQUEST)
                self.bytes_copied += n
            else:
                layers = []
                for la in host:
                    copied.append(True)
                    staged = map_layer(la, copy)
                    # a copy made here is this request's own; tensors already on the device stay as they were owned
                    staged.owner = Owner.REQUEST if copied[-1] else la.owner
                    layers.append(staged)
                seen = set()                   # once per storage
                for la in layers:
                    for t in layer_tensors(la):
                        if t.untyped_storage().data_ptr() not in seen:
                            seen.add(t.untyped_storage().data_ptr())
                            held.append(t)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self.staged[i] = (layers, ev, held)

    def get(self, i: int) -> list[LayerArtifact]:
        """Every document's layer i, ready for the compute stream. The first call for a layer makes the compute
        stream wait on its copy, records its tensors on that stream and issues the next layers' copies; later
        calls for the same layer (the engine reads one layer's fields document by document) only look it up."""
        if i in self._ready:
            return self.staged[i][0]
        self._issue(i)
        layers, ev, held = self.staged[i]
        if ev is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(ev)
            for t in held:
                t.record_stream(cur)
        self._ready.add(i)
        for j in range(i + 1, i + 1 + self.depth):
            self._issue(j)
        for old in [k for k in self.staged if k < i]:
            del self.staged[old]
            self._ready.discard(old)
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
