"""LayerPrefetcher: each layer's copies are issued one layer ahead and waited on once, however often the consumer
reads that layer's fields (the consumer reads them document by document, tens of times a layer)."""
import math

import pytest
import torch

from runtime.reuse.artifact import DocumentArtifact, LayerArtifact, Owner
from runtime.reuse.prefetcher import LayerPrefetcher


def _docs(n_docs=3, n_layers=4):
    g = torch.Generator().manual_seed(0)
    return [DocumentArtifact(list(range(8)), 8,
                             [LayerArtifact(torch.randn(8, 4, generator=g), torch.randn(2, 4, generator=g),
                                            local_p=torch.randn(8, 6, generator=g)) for _ in range(n_layers)])
            for _ in range(n_docs)]


def _run(device):
    docs = _docs()
    pf = LayerPrefetcher(docs, device)
    views = pf.documents()
    issued = []
    real_issue = pf._issue
    pf._issue = lambda i: (issued.append(i) if i not in pf.staged and i < pf.n_layers else None, real_issue(i))
    for i in range(pf.n_layers):
        for _ in range(5):                                    # many reads of one layer
            for j, v in enumerate(views):
                got = v.layers[i]
                assert torch.equal(got.latent.cpu(), docs[j].layers[i].latent)
                assert torch.equal(got.local_p.cpu(), docs[j].layers[i].local_p)
                assert got.latent.device.type == torch.device(device).type
        assert sorted(pf.staged) == [k for k in (i, i + 1) if k < pf.n_layers]   # one layer ahead, old ones dropped
    assert issued == list(range(pf.n_layers))                 # each layer issued once, in order
    return pf


def test_cpu_each_layer_once_one_ahead():
    pf = _run("cpu")
    assert pf.bytes_copied == 0                               # no copies where there is no GPU
    assert not any(v.layers[pf.n_layers - 1].owner is Owner.REQUEST for v in pf.documents())   # the caller's


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_waits_and_records_once_per_layer(monkeypatch):
    waits, records = [], []
    real_wait, real_record = torch.cuda.Stream.wait_event, torch.Tensor.record_stream
    monkeypatch.setattr(torch.cuda.Stream, "wait_event", lambda s, ev: (waits.append(s), real_wait(s, ev))[1])
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: (records.append(s), real_record(t, s))[1])
    pf = _run("cuda")
    compute = torch.cuda.current_stream()
    # per layer, device-side waits only: the compute stream on the copy, the side stream on the buffer's allocation
    # (the buffer comes from the compute stream's pool)
    assert waits.count(compute) == waits.count(pf.stream) == pf.n_layers and len(waits) == 2 * pf.n_layers
    # host documents not packed by `pin`: each tensor copied into the layer's one buffer, recorded once per buffer
    # on each stream that used it
    from runtime.reuse.packing import pack_documents
    assert records.count(compute) == records.count(pf.stream) == pf.n_layers and len(records) == 2 * pf.n_layers
    assert pf.loose == pf.n_layers * 3
    assert pf.bytes_copied == sum(pack_documents([d.layers[i] for d in _docs()], "cpu")[1]
                                  for i in range(pf.n_layers))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_copies_are_private_and_device_tensors_are_not():
    pf = LayerPrefetcher(_docs(), "cuda")
    views = pf.documents()
    _ = [v.layers[0] for v in views]
    assert all(v.layers[0].owner is Owner.REQUEST for v in views)      # this request's own device copies
    on_device = [DocumentArtifact(d.tokens, d.n_content, [LayerArtifact(la.latent.cuda(), la.entries.cuda(),
                                                                        local_p=la.local_p.cuda())
                                                          for la in d.layers]) for d in _docs()]
    pf2 = LayerPrefetcher(on_device, "cuda")
    views2 = pf2.documents()
    assert views2[0].layers[0].latent.data_ptr() == on_device[0].layers[0].latent.data_ptr()   # no copy made
    assert not any(v.layers[0].owner is Owner.REQUEST for v in views2)  # the caller's tensors: the engine copies


def test_layers_that_are_already_private_stay_private_through_the_prefetcher():
    """An owned_copy's layers through LayerPrefetcher stay the request's own (`Owner.REQUEST`, set by owned_copy),
    so the engine still overlays them in place; a caller's plain layers never are."""
    from runtime.reuse.packing import owned_copy
    docs = _docs()
    own = LayerPrefetcher([owned_copy(d) for d in docs], "cpu").documents()
    plain = LayerPrefetcher(docs, "cpu").documents()
    for i in range(len(docs[0].layers)):
        _ = [v.layers[i] for v in own + plain]                 # read, as the consumer reads before overlaying
        assert all(v.layers[i].owner is Owner.REQUEST for v in own)
        assert not any(v.layers[i].owner is Owner.REQUEST for v in plain)
    assert docs[0].layers[0].owner is Owner.CALLER


def _full_layer(g):
    """A layer with every kind of field: tuples, int32 picks, an empty tensor, a non-contiguous source."""
    return LayerArtifact(torch.randn(8, 4, generator=g), torch.randn(0, 4, generator=g),
                         torch.randn(2, 6, generator=g).to(torch.bfloat16),
                         (torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)), None,
                         torch.randn(6, 8, generator=g).t(), torch.randint(-1, 2, (8, 3), generator=g,
                                                                            dtype=torch.int32))


def _packed(la):
    """`la` packed as `pin` packs a document's layer."""
    from runtime.reuse.packing import pin
    return pin(DocumentArtifact(list(range(8)), 8, [la])).layers[0]


def test_pin_puts_every_tensor_of_a_layer_in_one_aligned_buffer():
    from runtime.reuse.packing import layer_tensors, PACK_ALIGN
    la = _full_layer(torch.Generator().manual_seed(1))
    packed = _packed(la)
    src, got = layer_tensors(la), layer_tensors(packed)
    assert len(got) == len(src) == 7 and packed.index_prev is None
    for a, b in zip(src, got):
        assert b.dtype == a.dtype and b.shape == a.shape and torch.equal(a, b) and b.is_contiguous()
        assert b.untyped_storage().data_ptr() == got[0].untyped_storage().data_ptr()      # one buffer
        assert (b.storage_offset() * b.element_size()) % PACK_ALIGN == 0
    la.latent.add_(1)                                        # a copy: the source's later changes do not show
    assert not torch.equal(la.latent, packed.latent)


def test_packed_documents_share_one_buffer_with_every_field_on_whole_rows():
    """pack_documents: several documents' layer in one buffer, each copied whole once from its packed storage, the
    same views rebuilt; every tensor starts on a whole row of its width counted from the buffer's start (what the
    consumer's one-view overlays need)."""
    from runtime.reuse.packing import layer_tensors, PACK_ALIGN, pack_documents, packed_storage
    g = torch.Generator().manual_seed(2)
    host = [_packed(_full_layer(g)) for _ in range(3)]
    assert all(packed_storage(la) is not None for la in host)
    copies = []
    staged, n = pack_documents(host, "cpu", lambda slot, src: (copies.append(src.numel()), slot.copy_(src)))
    assert len(copies) == 3 and copies == [packed_storage(la).numel() for la in host]
    base = layer_tensors(staged[0])[0].untyped_storage()
    assert n == base.nbytes()
    for la, got in zip(host, staged):
        for a, b in zip(layer_tensors(la), layer_tensors(got)):
            assert b.dtype == a.dtype and b.shape == a.shape and b.stride() == a.stride() and torch.equal(a, b)
            assert b.untyped_storage().data_ptr() == base.data_ptr()
            row = math.prod(b.shape[1:]) * b.element_size()
            assert (b.storage_offset() * b.element_size()) % row == 0
    # a layer not packed (here: separate tensors) goes into its slot tensor by tensor; the packed ones still whole
    loose = _full_layer(g)
    copies.clear()
    mixed, _ = pack_documents([host[0], loose, host[1]], "cpu",
                              lambda slot, src: (copies.append(src.numel()), slot.copy_(src)))
    assert copies == [packed_storage(host[0]).numel(), packed_storage(host[1]).numel()]
    assert len({t.untyped_storage().data_ptr() for la in mixed for t in layer_tensors(la)}) == 1
    for la, got in zip([host[0], loose, host[1]], mixed):
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(layer_tensors(la), layer_tensors(got)))
    with pytest.raises(ValueError, match="2 sources for 3 layers"):
        pack_documents([host[0], loose, host[1]], "cpu", lambda slot, src: slot.copy_(src), [None, None])
    packed, _ = pack_documents([_full_layer(torch.Generator().manual_seed(3)) for _ in range(2)], "cpu")
    assert len({t.untyped_storage().data_ptr() for la in packed for t in layer_tensors(la)}) == 1   # packed in place
    # not packed: separate tensors, or views of a buffer off the layer's alignment or layout
    assert packed_storage(_full_layer(torch.Generator().manual_seed(3))) is None
    assert packed_storage(LayerArtifact(torch.randn(1000)[3:11].view(2, 4))) is None
    assert packed_storage(LayerArtifact(torch.randn(1000)[::2][:8].view(2, 4))) is None
    buf = torch.randn(1000)                          # a view on the alignment, laid out as pin lays it out
    assert packed_storage(LayerArtifact(buf[64:72].view(2, 4))).numel() == PACK_ALIGN


def test_slabs_are_powers_of_two_and_hold_every_layer_once_on_its_alignment():
    """pin's slabs: torch's pinned allocator rounds each block up to a power of two, so the slabs are powers of two
    and the waste is their unfilled tails: a 128K-token document (43 layers just over 256 MiB, a few small ones)
    fits in slabs at most 1/8 larger than its bytes, where one buffer per layer would take nearly twice them."""
    from runtime.reuse.packing import slab_plan
    mib = 1 << 20
    cases = [([257 * mib + 4096 * k for k in range(37)] + [3 * mib] * 6, [2304] * 43),
             ([0, 10, 300, 4096, 0], [256, 256, 512, 256, 256]), ([1], [256]), ([5000] * 9, [1024] * 9)]
    for sizes, aligns in cases:
        plan = slab_plan(sizes, aligns)
        seen = [li for _, placed in plan for li, _ in placed]
        assert seen == list(range(len(sizes)))                                  # every layer once, in order
        for cap, placed in plan:
            assert cap & (cap - 1) == 0 and placed
            ends = 0
            for li, o in placed:
                assert o % aligns[li] == 0 and o >= ends and o + sizes[li] <= cap
                ends = o + sizes[li]
        if sizes[0] > mib:
            total = sum(cap for cap, _ in plan)
            assert total <= 1.125 * sum(sizes) and len(plan) <= 6, (total / sum(sizes), len(plan))
            per_layer = sum(1 << (n - 1).bit_length() for n in sizes)
            assert per_layer > 1.9 * sum(sizes)


def test_a_pinned_layer_with_its_last_fields_dropped_is_still_copied_whole():
    """bench/ttft.py drops the prefix document's Local and picks (the last fields); what is left is a prefix of the
    packed layout, so it is still one copy (of fewer bytes) and not staged tensor by tensor."""
    import dataclasses
    from runtime.reuse.packing import layer_tensors, pack_documents, packed_storage, pin
    g = torch.Generator().manual_seed(5)
    la = LayerArtifact(torch.randn(8, 4, generator=g), torch.randn(2, 4, generator=g), None, None, None,
                       torch.randn(8, 16, generator=g), torch.randint(0, 2, (8, 3), generator=g, dtype=torch.int32))
    hot = pin(DocumentArtifact(torch.arange(8), 8, [la], 0, 1, {})).layers[0]
    cut = dataclasses.replace(hot, local_p=None, picks=None)
    whole, part = packed_storage(hot), packed_storage(cut)
    assert part is not None and part.numel() < whole.numel() and part.data_ptr() == whole.data_ptr()
    copies = []
    staged, _ = pack_documents([cut, hot], "cpu", lambda slot, src: (copies.append(src.numel()), slot.copy_(src)))
    assert copies == [part.numel(), whole.numel()]
    assert all(torch.equal(a, b) for x, y in zip([cut, hot], staged)
               for a, b in zip(layer_tensors(x), layer_tensors(y)))


def test_pin_packs_every_layer_for_one_copy_in_shared_slabs():
    from runtime.reuse.packing import layer_tensors, PACK_ALIGN, packed_storage, pin, rebuild
    g = torch.Generator().manual_seed(4)
    doc = DocumentArtifact(torch.arange(8), 8, [_full_layer(g) for _ in range(5)], 0, 1, {})
    hot = pin(doc)
    slabs = {layer_tensors(la)[0].untyped_storage().data_ptr() for la in hot.layers}
    assert len(slabs) < len(hot.layers)                                          # layers share slabs
    for la, src in zip(hot.layers, doc.layers):
        flat = packed_storage(la)
        assert flat is not None and flat.numel() % PACK_ALIGN == 0
        again = rebuild(la, flat.clone())                                        # its bytes hold the whole layer
        for a, b, c in zip(layer_tensors(src), layer_tensors(la), layer_tensors(again)):
            assert torch.equal(a, b) and torch.equal(a, c) and c.dtype == a.dtype and c.shape == a.shape


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_stages_pinned_documents_with_one_copy_each_into_one_buffer_per_layer(monkeypatch):
    from runtime.reuse.packing import layer_tensors, pack_documents, pin
    docs = [pin(d) for d in _docs()]
    copies = []
    real_to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **k: (copies.append(t.dtype), real_to(t, *a, **k))[1])
    pf = LayerPrefetcher(docs, "cuda")
    views = pf.documents()
    for i in range(pf.n_layers):
        for j, v in enumerate(views):
            got = v.layers[i]
            for a, b in zip(layer_tensors(docs[j].layers[i]), layer_tensors(got)):
                assert b.is_cuda and torch.equal(b.cpu(), a)
            assert len({t.untyped_storage().data_ptr() for t in layer_tensors(got)}) == 1
            assert v.layers[i].owner is Owner.REQUEST
    assert copies == [] and pf.loose == 0                         # no per-tensor copies: slot copies (copy_) only
    assert pf.bytes_copied == sum(pack_documents([d.layers[i] for d in docs], "cpu")[1] for i in range(pf.n_layers))


def test_host_plan_is_kept_on_the_layer_while_its_tensors_are_the_same():
    """`host_plan` (a host layer's tensors, layout and packed source, what staging reads every request) is computed
    once per layer and computed again once a field holds another tensor; equal to computing it afresh."""
    from runtime.reuse.packing import _layout, host_plan, layer_tensors, packed_storage
    la = _packed(_full_layer(torch.Generator().manual_seed(5)))
    first = host_plan(la)
    assert host_plan(la) is first                                         # kept
    ts, lay, src = first
    assert all(a is b for a, b in zip(ts, layer_tensors(la))) and lay == _layout(layer_tensors(la))
    assert src is not None and torch.equal(src, packed_storage(la))
    la.latent = la.latent.clone()                                         # a field replaced: not the packed one
    again = host_plan(la)
    assert again is not first and again[0][0] is la.latent and again[2] is None and packed_storage(la) is None


def test_packing_through_the_kept_plans_equals_packing_afresh():
    """pack_documents given the kept plans (`host_plan`, as LayerPrefetcher stages) lays out and copies the same
    bytes as without them, request after request, each packed layer copied whole once."""
    from runtime.reuse.packing import host_plan, layer_tensors, pack_documents, pin
    host = [pin(DocumentArtifact(list(range(8)), 8, [_full_layer(torch.Generator().manual_seed(10 + j))])).layers[0]
            for j in range(3)]
    fresh, n0 = pack_documents(host, "cpu", lambda slot, src: slot.copy_(src))
    for _ in range(2):
        hp = [host_plan(la) for la in host]
        copies = []
        kept, n1 = pack_documents(host, "cpu", lambda slot, src: (copies.append(src.numel()), slot.copy_(src)),
                                  [src for _, _, src in hp], None, [(ts, lay) for ts, lay, _ in hp])
        assert n1 == n0 and copies == [src.numel() for _, _, src in hp]
        for a_la, b_la, src_la in zip(kept, fresh, host):
            for a, b, c in zip(layer_tensors(a_la), layer_tensors(b_la), layer_tensors(src_la)):
                assert a.dtype == b.dtype == c.dtype and a.shape == b.shape == c.shape
                assert a.stride() == b.stride() == torch.empty(a.shape).stride()    # plain contiguous views
                assert torch.equal(a, b) and torch.equal(a, c)
    with pytest.raises(ValueError, match="plans"):
        pack_documents(host, "cpu", plans=[(ts, lay) for ts, lay, _ in hp][:2])


def test_bench_stage_views_times_the_packed_one_copy_path(tmp_path, monkeypatch):
    """bench/stage_views.py times what LayerPrefetcher does for pinned documents: its layers pack into one storage
    each (one copy a document, not the loose tensor-by-tensor path), and it reports a time per document count."""
    import json
    import sys
    from bench import stage_views
    from runtime.reuse.packing import host_plan, pin_layers
    for csa in (True, False):
        la = pin_layers([stage_views.flash_layer(128, csa)])[0]
        assert host_plan(la)[2] is not None                              # a packed source: one copy
    out = tmp_path / "views.json"
    monkeypatch.setattr(sys, "argv", ["stage_views", "--docs", "2,4", "--layers", "2", "--reps", "1",
                                      "--json", str(out)])
    stage_views.main()
    rows = json.loads(out.read_text())["rows"]
    assert [r["docs"] for r in rows] == [2, 4] and all(r["s"] > 0 and r["first_s"] > 0 for r in rows)
