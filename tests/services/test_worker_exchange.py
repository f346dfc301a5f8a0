"""The TP group's shard exchange (services/worker/exchange.py) on two real ranks (gloo over loopback, spawned by
services.common.tp.launch): each rank contributes the latent shards of the layers it owns, every rank ends with
every latent shard of the layer group plus its own LOCAL shards; received bytes carry no digest (read_layers
hashes them against the certificate); an owner's failure reaches every rank (the owner with its reason, the others
as following it, naming the owner and its reason), and the exchange goes on with the next layer group."""
from __future__ import annotations

import json
from concurrent.futures import Future

from runtime.reuse.certificate import FallbackReason
from runtime.reuse.stager import SourceError
from runtime.reuse.store import VerifiedFiles, latent_shard, shard_file
from services.common.tp import launch


def _own(rank: int, layers: range, fail: bool = False) -> Future:
    """What rank `rank`'s store fetch of a layer group delivers: its owned latent shards and its LOCAL shards."""
    f: Future = Future()
    if fail:
        f.set_exception(SourceError(FallbackReason.DIGEST_MISMATCH, "shard layer02.latent altered in the store"))
        return f
    files = {shard_file(latent_shard(i)): f"latent {i}".encode() * 1000 for i in layers if i % 2 == rank}
    files.update({shard_file(f"layer{i:02d}.local.r{rank}.c0-8"): f"local {i} {rank}".encode() for i in layers})
    f.set_result(VerifiedFiles(files, {n: f"digest of {n}" for n in files}))
    return f


def _rank(group, out_dir: str) -> None:
    from services.worker.exchange import ShardExchange
    ex = ShardExchange(group.rank, group.size, group.exchange)
    first = ex.submit(_own(group.rank, range(0, 3)), range(0, 3))
    # layers 2-3: rank 0 owns layer 2 and its fetch failed
    second = ex.submit(_own(group.rank, range(2, 4), fail=group.rank == 0), range(2, 4))
    third = ex.submit(_own(group.rank, range(4, 5)), range(4, 5))
    got = first.result(timeout=60)
    try:
        second.result(timeout=60)
        err = None
    except SourceError as e:
        err = [e.reason.value, str(e)]
    last = third.result(timeout=60)
    with open(f"{out_dir}/rank{group.rank}.json", "w") as fh:
        json.dump(dict(files=sorted(got), digested=sorted(got.digests), error=err, last=sorted(last),
                       sizes={n: len(d) for n, d in got.items()}, received=ex.take_received()), fh)
    ex.close()


def test_two_ranks_exchange_the_shared_shards(tmp_path):
    assert launch(2, _rank, (str(tmp_path),)) == 0
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    latent = [shard_file(latent_shard(i)) for i in range(3)]
    for r, got in enumerate(ranks):
        own_local = [shard_file(f"layer{i:02d}.local.r{r}.c0-8") for i in range(3)]
        assert got["files"] == sorted(latent + own_local)          # every latent shard, only its own LOCAL shards
        owned = [n for i, n in enumerate(latent) if i % 2 == r]
        assert got["digested"] == sorted(owned + own_local)         # received bytes: no digest, hashed later
        assert got["sizes"][latent[1]] == len(b"latent 1") * 1000
        # rank 0 (the owner of layer 2) fails with its reason; rank 1 follows it and names it and its reason
        assert got["error"][0] == ("digest_mismatch" if r == 0 else "rank_disagreement"), got["error"]
        assert "altered in the store" in got["error"][1]
        assert (r == 1) <= ("digest_mismatch" in got["error"][1])
        assert ("rank 0, which fetches the shared shards of layers 2-3" in got["error"][1]) == (r == 1)
        assert got["last"] == sorted([shard_file(latent_shard(4)), shard_file(f"layer04.local.r{r}.c0-8")])
        # bytes received from the other rank: layer 1 (rank 0) or layers 0, 2 (rank 1), then layer 4 (rank 1)
        want = sum(len(f"latent {i}".encode()) * 1000 for i in ([1] if r == 0 else [0, 2, 4]))
        assert got["received"] == want
