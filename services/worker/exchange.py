"""The TP group's shared shards, fetched once per group: each rank fetches from the store the latent shards
(`layerLL.latent`: latent, entries, indexer keys, carried state, picks: the same bytes for every rank) of the
layers it owns (layer % TP) and its own LOCAL shards, and the group all-gathers the latent shards, so the node
moves each shared byte once instead of TP times.

One exchange thread per rank runs the all-gathers one layer group at a time, first in first out, over a process
group of its own (gloo: the shards are host bytes, and the model's collectives never wait behind an exchange).
Jobs are submitted only from the lockstep path (a request's documents and the warm-up hints, in the same order on
every rank), so every rank's thread runs the same sequence of collectives. A rank whose own fetch failed still
takes part: it sends its failure (its own reason), and every other rank fails that layer group as following it
(rank_disagreement, the detail naming the owner and its reason). Received bytes carry no digest of their own
(`VerifiedFiles` lists only what this rank's client checked), so `read_layers` hashes them against this rank's
certificate like any unverified bytes."""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future

import torch.distributed as dist

from runtime.reuse.certificate import FallbackReason
from runtime.reuse.stager import SourceError
from runtime.reuse.store import VerifiedFiles, latent_shard, shard_file

log = logging.getLogger("redknot.worker")


class ShardExchange:
    def __init__(self, rank: int, size: int, group):
        if size < 2:
            raise ValueError(f"an exchange needs a TP group of 2 or more ranks, got {size}")
        self.rank, self.size, self.group = rank, size, group
        self.received = 0                       # bytes that came from other ranks instead of the store
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="shard-exchange", daemon=True)
        self._thread.start()

    def owner(self, layer: int) -> int:
        return layer % self.size

    def owned_files(self, layers: range) -> set[str]:
        """The latent shard files of `layers` this rank fetches for the group."""
        return {shard_file(latent_shard(i)) for i in layers if self.owner(i) == self.rank}

    def shared_files(self, layers: range) -> set[str]:
        return {shard_file(latent_shard(i)) for i in layers}

    def submit(self, own: Future, layers: range) -> Future:
        """The layer group's files once the group has exchanged them: `own` (this rank's fetch: VerifiedFiles
        of its owned latent shards and its LOCAL shards) plus every other owner's latent shards."""
        out: Future = Future()
        self._jobs.put((own, layers, out))
        return out

    def take_received(self) -> int:
        with self._lock:
            n, self.received = self.received, 0
            return n

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            own, layers, out = job
            files, failure = None, None
            try:
                files = own.result()
                mine = self.owned_files(layers)
                payload = ("ok", {n: files[n] for n in mine if n in files})
            except SourceError as e:
                failure, payload = e, ("error", e.reason.value, e.detail)
            except Exception as e:                              # noqa: BLE001 - sent to the group, raised here
                failure = SourceError(FallbackReason.STORE_UNAVAILABLE, f"{type(e).__name__}: {e}")
                payload = ("error", failure.reason.value, failure.detail)
            gathered: list = [None] * self.size
            try:
                dist.all_gather_object(gathered, payload, group=self.group)
            except Exception as e:                              # noqa: BLE001 - the group itself failed
                out.set_exception(SourceError(FallbackReason.STORE_UNAVAILABLE,
                                              f"shard exchange of layers {layers.start}-{layers.stop - 1}: {e}"))
                continue
            if failure is not None:
                out.set_exception(failure)
                continue
            bad = [(r, p) for r, p in enumerate(gathered) if p[0] == "error"]
            if bad:
                r, p = bad[0]
                # this rank follows the owner's failure: the owner reports the cause (services/worker/engine.py
                # root_cause names the rank with a reason of its own)
                out.set_exception(SourceError(FallbackReason.RANK_DISAGREEMENT,
                                              f"rank {r}, which fetches the shared shards of layers "
                                              f"{layers.start}-{layers.stop - 1}, failed: {p[1]}: {p[2]}"))
                continue
            merged = VerifiedFiles(files, files.digests)
            n = 0
            for r, p in enumerate(gathered):
                if r != self.rank:
                    for name, data in p[1].items():
                        merged[name] = data                     # not in merged.digests: hashed by read_layers
                        n += len(data)
            with self._lock:
                self.received += n
            out.set_result(merged)

    def close(self) -> None:
        self._jobs.put(None)
