"""bench/syncs.py: on CUDA every synchronizing call of the run is counted under the frames that made it, and a
stream-ordered run counts none; without CUDA it runs the function and reports nothing (nothing synchronizes)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.syncs import ALLOCATOR_KEYS, find_syncs, sync_report  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _reads_back(x):
    return x[:4].tolist()                       # one host read: synchronizes


def _stays_on_device(x):
    return (x * 2).sum()


def test_without_cuda_the_function_runs_once_and_nothing_is_counted(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = []
    out, seen, alloc = find_syncs(lambda: calls.append(1) or 7)
    assert out == 7 and calls == [1] and not seen and alloc == {k: 0 for k in ALLOCATOR_KEYS}
    assert sync_report(lambda: None).startswith("## host syncs : 0 synchronizing calls at 0 places")


@cuda
def test_each_host_read_is_counted_where_it_was_made_and_device_work_is_not():
    x = torch.ones(1000, device="cuda")
    _, seen, _ = find_syncs(lambda: [_reads_back(x) for _ in range(3)], where="tests/", depth=1)
    assert sum(n for k, n in seen.items() if "_reads_back" in k) >= 3, seen
    _, seen, _ = find_syncs(lambda: [_stays_on_device(x) for _ in range(3)], where="tests/")
    assert not seen, seen
    assert torch.cuda.get_sync_debug_mode() == 0, "the caller's mode is restored"


@cuda
def test_a_blocking_index_copy_waits_and_the_consumers_pinned_copy_does_not():
    from runtime.kernels._host import to_device_nowait
    ids = torch.arange(5000)
    _, seen, _ = find_syncs(lambda: ids.to("cuda"), where="tests/")
    assert sum(seen.values()) >= 1, "a blocking copy from pageable memory waits for the stream"
    out, seen, _ = find_syncs(lambda: to_device_nowait(ids, "cuda"), where="tests/")
    assert not seen, seen
    assert torch.equal(out.cpu(), ids)
