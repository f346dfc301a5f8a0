"""The reuse path under tensor parallelism (TP=2; gloo on CPU, and NCCL with one GPU per rank where two GPUs
exist): each rank builds and loads only its own shards (its rank and W_a,L channel range); the reuse arm equals
TP=1's reuse arm; one rank with a corrupted shard makes both ranks fall back together, with full
recomputation's answer, the reason counted on every rank, and no rank entering a reuse-specific collective."""
import json
import os
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.model.checkpoint import random_state, write_official_checkpoint
from runtime.model.config import tiny
from runtime.model.loader import load_model
from runtime.model.parallel import Parallel
from runtime.reuse.certificate import FallbackCounter
from runtime.reuse.producer import pad_document
from runtime.reuse.profile import ReuseProfile
from runtime.reuse.request import ServingIdentity, answer, build

CFG = tiny(n_layers=6, n_heads=16, o_groups=8, compress_ratios=(0, 4, 16, 4, 16, 4), n_hash_layers=2)
PROF = ReuseProfile(first_fences=2, last_fences=2, align=16, budget=0.25, recent_rows=16, join_rows=8)
IDENT = ServingIdentity("a" * 64, "tok")


def _rendezvous(d) -> str:
    """A fresh file for the ranks' rendezvous (torch.distributed's FileStore), not a TCP port: a port picked here and
    bound later by rank 0 could be taken in between by a parallel test process."""
    return f"file://{Path(d) / f'rdzv-{uuid.uuid4().hex}'}"


def _docs():
    g = torch.Generator().manual_seed(21)
    docs = [torch.randint(2, CFG.vocab_size, (n,), generator=g).tolist() for n in (40, 50, 30)]
    return docs, torch.randint(2, CFG.vocab_size, (8,), generator=g).tolist()


def _corrupt_local_shard(d):
    name = sorted(p for p in os.listdir(d) if ".local." in p)[0]
    data = bytearray(open(os.path.join(d, name), "rb").read())
    data[-3] ^= 0x10
    open(os.path.join(d, name), "wb").write(bytes(data))


def _rank(rank, size, init, ckpt, root, corrupt, backend="gloo", prof=PROF):
    torch.set_num_threads(1)
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
        os.environ["REDKNOT_KERNELS"] = "0"         # the reference path: compared with the CPU run to 1e-4
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=size)
    try:
        model = load_model(ckpt, par=Parallel(rank, size), device=device)
        docs, question = _docs()
        dirs = [build(model, d, prof, IDENT, os.path.join(root, f"rank{rank}", f"doc{i}")) for i, d in enumerate(docs)]
        assert all(f".local.r{rank}." in n for d in dirs for n in os.listdir(d) if ".local." in n)
        if corrupt and rank == 1:
            _corrupt_local_shard(dirs[1])
        counter = FallbackCounter()
        out = answer(model, prof, docs, dirs, question, IDENT, current_generation=1, counter=counter)
        torch.save(out.logits.cpu(), os.path.join(root, f"logits{rank}.pt"))
        with open(os.path.join(root, f"result{rank}.json"), "w") as fh:
            json.dump({"arm": out.arm, "reason": out.verdict.reason and out.verdict.reason.value,
                       "counts": counter.snapshot(),
                       "ledger": out.ledger.summary() if out.ledger else None}, fh)
        dist.barrier()
        open(os.path.join(root, f"done{rank}"), "w").close()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    write_official_checkpoint(path, CFG, random_state(CFG, seed=22), quantize=False)
    model = load_model(path)
    docs, question = _docs()
    root = tmp_path_factory.mktemp("tp1")
    dirs = [build(model, d, PROF, IDENT, root / f"doc{i}") for i, d in enumerate(docs)]
    reuse = answer(model, PROF, docs, dirs, question, IDENT, current_generation=1)
    assert reuse.arm == "reuse"
    setup_ledger = reuse.ledger.summary()
    full = model(torch.tensor([t for d in docs for t in pad_document(d, 16, CFG.eos_token_id)] + question))
    return str(path), reuse.logits, full, setup_ledger


BACKENDS = ["gloo", pytest.param("nccl", marks=pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="NCCL needs two CUDA devices"))]


def _run(setup, tmp_path, corrupt, backend="gloo", prof=PROF):
    ckpt = setup[0]
    try:
        mp.start_processes(_rank, args=(2, _rendezvous(tmp_path), ckpt, str(tmp_path), corrupt, backend, prof),
                           nprocs=2, join=True, start_method="spawn")
    except mp.ProcessExitedException:
        # a gloo teardown abort after every rank passed the final barrier does not touch the results
        if not all((tmp_path / f"done{r}").exists() for r in range(2)):
            raise
    results = [json.load(open(tmp_path / f"result{r}.json")) for r in range(2)]
    return results, torch.load(tmp_path / "logits0.pt")


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("backend", BACKENDS)
def test_tp2_reuse_equals_tp1_reuse(setup, tmp_path, backend):
    results, logits = _run(setup, tmp_path, corrupt=False, backend=backend)
    assert [r["arm"] for r in results] == ["reuse", "reuse"]
    assert rel(logits, setup[1]) <= (1e-5 if backend == "gloo" else 1e-4)
    # the ledger counts every rank's heads: the same namespaces as one rank holding them all
    tp1, tp2 = setup[3], results[0]["ledger"]
    assert tp2["head_row_saving"] == pytest.approx(tp1["head_row_saving"])
    assert tp2["flop_saving"]["attention"] == pytest.approx(tp1["flop_saving"]["attention"])


def test_tp2_attention_rule_takes_the_tp1_rows(setup, tmp_path):
    """select="attention": each rank drafts with its own heads and the scores are summed over ranks, so both ranks
    choose the rows one rank holding every head chooses, and the answer is TP=1's."""
    prof = PROF.replace(select="attention")
    model = load_model(setup[0])
    docs, question = _docs()
    dirs = [build(model, d, prof, IDENT, tmp_path / "tp1" / f"doc{i}") for i, d in enumerate(docs)]
    ref = answer(model, prof, docs, dirs, question, IDENT, current_generation=1)
    assert ref.arm == "reuse"
    (tmp_path / "tp2").mkdir()
    results, logits = _run(setup, tmp_path / "tp2", corrupt=False, prof=prof)
    assert [r["arm"] for r in results] == ["reuse", "reuse"]
    assert rel(logits, ref.logits) <= 1e-5
    assert results[0]["ledger"]["flop_saving"] == pytest.approx(ref.ledger.summary()["flop_saving"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_corrupted_shard_makes_every_rank_fall_back(setup, tmp_path, backend):
    results, logits = _run(setup, tmp_path, corrupt=True, backend=backend)
    assert [r["arm"] for r in results] == ["recompute", "recompute"]
    assert results[1]["reason"] == "digest_mismatch" and results[0]["reason"] == "rank_disagreement"
    assert results[1]["counts"]["digest_mismatch"] == 1 and results[0]["counts"]["rank_disagreement"] == 1
    assert rel(logits, setup[2]) <= (1e-5 if backend == "gloo" else 1e-4)
