"""LayerPrefetcher: each layer's copies are issued one layer ahead and waited on once, however often the consumer
reads that layer's fields (the consumer reads them document by document, tens of times a layer)."""
import pytest
import torch

from runtime.reuse.artifact import DocumentArtifact, LayerArtifact
from runtime.reuse.prefetch import LayerPrefetcher


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
    assert not any(v.layers.private(pf.n_layers - 1) for v in pf.documents())   # the caller's own: never written


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_waits_and_records_once_per_layer(monkeypatch):
    waits, records = [], []
    real_wait, real_record = torch.cuda.Stream.wait_event, torch.Tensor.record_stream
    monkeypatch.setattr(torch.cuda.Stream, "wait_event", lambda s, ev: (waits.append(ev), real_wait(s, ev))[1])
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: (records.append(1), real_record(t, s))[1])
    pf = _run("cuda")
    assert len(waits) == pf.n_layers                          # one device-side wait per layer
    assert len(records) == pf.n_layers * 3 * 3                # three tensors of three documents, once each
    assert pf.bytes_copied == sum(t.numel() * 4 for d in _docs() for la in d.layers
                                  for t in (la.latent, la.entries, la.local_p))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_copies_are_private_and_device_tensors_are_not():
    pf = LayerPrefetcher(_docs(), "cuda")
    views = pf.documents()
    _ = [v.layers[0] for v in views]
    assert all(v.layers.private(0) for v in views)            # this request's own device copies
    on_device = [DocumentArtifact(d.tokens, d.n_content, [LayerArtifact(la.latent.cuda(), la.entries.cuda(),
                                                                        local_p=la.local_p.cuda())
                                                          for la in d.layers]) for d in _docs()]
    pf2 = LayerPrefetcher(on_device, "cuda")
    views2 = pf2.documents()
    assert views2[0].layers[0].latent.data_ptr() == on_device[0].layers[0].latent.data_ptr()   # no copy made
    assert not any(v.layers.private(0) for v in views2)       # the caller's tensors: the consumer must copy


def test_layers_that_are_already_private_stay_private_through_the_prefetcher():
    """A GroupStager's or an owned_copy's layers wrapped by LayerPrefetcher (the worker's staged path) keep saying
    they are the request's own, so the consumer still overlays them in place; a caller's plain layers never do."""
    from runtime.reuse.artifact import is_private
    from runtime.reuse.prefetch import owned_copy
    docs = _docs()
    own = LayerPrefetcher([owned_copy(d) for d in docs], "cpu").documents()
    plain = LayerPrefetcher(docs, "cpu").documents()
    for i in range(len(docs[0].layers)):
        assert not is_private(own[0], i + 1)                  # not read yet: not known, so not private (safe)
        _ = [v.layers[i] for v in own + plain]                 # read, as the consumer reads before overlaying
        assert all(is_private(v, i) for v in own) and not any(is_private(v, i) for v in plain)
    assert not is_private(docs[0], 0)
