"""A tensor-parallel rank group on one host, for `redknot worker --tp N` and `redknot builder --tp N`.

`launch` spawns N processes (spawn start method; N=1 runs in-process); each joins a process group (gloo on CPU,
NCCL on GPU) and runs `target(group, *args)`. Rank 0 leads: it takes work and broadcasts each job, the other
ranks follow, so every collective of the model runs in the same order everywhere. The launching process only
supervises: SIGTERM/SIGINT go to rank 0, which broadcasts a stop; when any rank dies the others are terminated
and `launch` returns 1 (an orchestrator restarts the whole group: a TP group is not repaired rank by rank)."""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import shutil
import sys
import tempfile
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from runtime.model.parallel import Parallel

log = logging.getLogger("redknot.tp")
STOP = "__stop__"


@dataclass(frozen=True)
class RankGroup:
    rank: int
    size: int
    device: torch.device
    par: Parallel
    # control-plane collectives between layers (per-layer-group agreements): gloo, so that on GPUs they never
    # queue behind the model's NCCL kernels on the compute stream
    control: Parallel = Parallel()
    # the worker's shard exchange (services/worker/exchange.py): a gloo group of its own, driven by one thread per
    # rank, so that its all-gathers never interleave with the model's or the control plane's collectives
    exchange: object | None = None

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj=None):
        """Rank 0's `obj` on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def gather(self, obj) -> list:
        return self.par.all_gather_object(obj)


def _die_with_parent() -> None:
    try:                                    # Linux: a rank never outlives its supervisor (even after SIGKILL)
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def rank_threads(size: int, cpus: int = 0) -> int:
    """Each rank's torch threads: OMP_NUM_THREADS where the deployment set it (per process), else the group's CPUs
    divided among the ranks: `cpus` where given (the worker's and builder's `cpus` setting, REDKNOT_CPUS, which the
    Helm chart sets from the pod's CPU limit, or its request where it has no limit: a container's share, which the
    host's core count does not show), else the cores this process may run on."""
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    cores = cpus if cpus > 0 else (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                   else os.cpu_count() or 1)
    return max(1, cores // size)


def _entry(rank: int, target, size: int, rendezvous: str, device: str, args: tuple, cpus: int) -> None:
    _die_with_parent()
    if rank != 0:                           # followers stop when rank 0 broadcasts the stop, never on their own
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(rank_threads(size, cpus))
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=f"file://{rendezvous}",
                            rank=rank, world_size=size, timeout=timedelta(hours=1))
    try:
        control = Parallel(rank, size, dist.new_group(backend="gloo")) if dev.type == "cuda" else Parallel(rank, size)
        exchange = dist.new_group(backend="gloo") if size > 1 else None      # nothing to exchange alone
        target(RankGroup(rank, size, dev, Parallel(rank, size), control, exchange), *args)
        dist.barrier()                      # no rank tears the group down while another still talks to it
    finally:
        dist.destroy_process_group()
    # A rank that finished cleanly leaves without interpreter finalization: there, process-group worker threads that
    # still hold tensors can abort the process ("terminate called without an active exception", SIGABRT), which the
    # supervisor would report as a dead rank. Everything the rank owns is already closed; only the output is flushed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(size: int, target, args: tuple = (), device: str = "cpu", cpus: int = 0) -> int:
    """Run `target(group, *args)` on `size` ranks (spawned processes; in this process at size 1), each with
    `rank_threads(size, cpus)` torch threads (at size 1 only where `cpus` is given: else torch's own count)."""
    if size == 1:
        if cpus > 0:
            torch.set_num_threads(rank_threads(1, cpus))
        dev = torch.device(device)
        target(RankGroup(0, 1, dev, Parallel()), *args)
        return 0
    # the ranks meet through a file in a directory of the group's own (a TCP port picked free here could be taken
    # by another process before rank 0 bound it); the directory goes when the group does
    meet = tempfile.mkdtemp(prefix="redknot-tp-")
    try:
        return _supervise(mp.start_processes(_entry, args=(target, size, os.path.join(meet, "rendezvous"), device,
                                                           args, cpus), nprocs=size, join=False, start_method="spawn"))
    finally:
        shutil.rmtree(meet, ignore_errors=True)


def _supervise(ctx) -> int:
    leader = ctx.processes[0]

    def forward(signum, _frame):
        if leader.is_alive():
            os.kill(leader.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        while not ctx.join(timeout=0.5):
            pass
    except ProcessException as e:           # join() has terminated the other ranks
        log.error("TP group stopped: %s", e)
        return 1
    return 0
