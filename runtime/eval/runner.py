"""Running the harness over many questions: the questions are cut into chunks of consecutive examples, the
chunks are spread over worker processes on one device (each process holds its own model copy: at 135M
parameters the engine is bound by kernel launches, not by the GPU, so processes add throughput), finished
chunks are optionally kept in a directory so a stopped run resumes where it stopped, and the chunk summaries
are merged into one (`merge_runs`, CIs recomputed over all examples).

A chunk file's name carries a digest of everything that decides its numbers (model, task, data, arms, fences,
output cap, teacher-forcing window, dtype, device type), so a directory can hold runs of several settings without
mixing them."""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import queue
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunSpec:
    model_dir: str
    task: str
    data: str | None
    budgets: tuple[float, ...]
    fences: tuple[int, int]
    max_new_tokens: int
    device: str = "cpu"
    dtype: str = "float32"
    variants: tuple[str, ...] = ()          # extra reuse arms (arms.py), after the default ones
    teacher_tokens: int = 32                # positions of the teacher-forced metrics (harness.run_eval)
    profile: str = ""                       # the reuse arms' base profile (a preset or JSON; "": the eval profile)
    preamble: bool = False                  # documents built after the fixed preamble (harness.layout)

    def base(self):
        """The reuse arms' base profile: the one named, else (the Llama family) the eval profile at `fences`."""
        from runtime.reuse.profile import load_profile
        from .harness import eval_profile
        return load_profile(self.profile) if self.profile else eval_profile(self.fences)

    def arm_fences(self) -> tuple[int, int]:
        """The fences arms are named against: a named profile's own, else `fences`."""
        b = self.base()
        return (b.first_fences, b.last_fences) if self.profile else self.fences

    def key(self) -> str:
        d = asdict(self)
        d["model_dir"] = str(Path(self.model_dir).resolve())
        d["data"] = str(Path(self.data).resolve()) if self.data else None
        d["device"] = self.device.split(":")[0]                 # cuda:0 and cuda:1 give the same numbers
        # every arm as it resolves (its profile, row-selection rule included): a changed default changes the key,
        # so a chunk run under the old default is never reused under the new one
        from .arms import arm_list
        base = self.base()
        d["arms"] = [[a.name, a.profile(base).to_dict() if a.kind in ("naive", "reuse") else None]
                     for a in arm_list(list(self.budgets), list(self.variants), self.arm_fences())]
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Chunk:
    offset: int
    limit: int

    def file(self, spec: RunSpec) -> str:
        return f"{spec.task}-{spec.key()}-{self.offset:06d}-{self.limit:04d}.json"


def plan(offset: int, limit: int, size: int) -> list[Chunk]:
    assert limit > 0 and size > 0, f"limit={limit} size={size}"
    return [Chunk(a, min(size, offset + limit - a)) for a in range(offset, offset + limit, size)]


@dataclass
class RunResult:
    summaries: list[dict]               # one per finished chunk, in offset order
    pending: list[Chunk]                # chunks not run because the deadline passed
    reused: int = 0                     # chunks read back from the chunk directory


class Worker:
    """One model copy and the task's examples; runs chunks."""

    def __init__(self, spec: RunSpec, threads: int | None = None):
        import torch

        from runtime.families import load_checkpoint
        from runtime.llama.tokenizer import ChatTokenizer
        if threads:
            torch.set_num_threads(threads)
        self.spec = spec
        self.model = load_checkpoint(spec.model_dir, getattr(torch, spec.dtype), spec.device)
        self.tok = ChatTokenizer.from_dir(spec.model_dir)

    def examples(self, c: Chunk):
        from .data import load_task
        return list(itertools.islice(load_task(self.spec.task, self.spec.data, None), c.offset, c.offset + c.limit))

    def run(self, c: Chunk, progress=None) -> dict:
        import warnings

        import torch

        from .harness import run_eval
        # torch warns on every oneDNN flags switch that TF32 on oneDNN needs an Intel GPU: noise here
        warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN")
        examples = self.examples(c)
        assert len(examples) == c.limit, f"chunk {c}: the task has only {c.offset + len(examples)} examples"
        torch.manual_seed(0)
        # on CPU, oneDNN compiles a kernel per new matmul shape (~16 ms each); segment lengths vary per example
        with torch.backends.mkldnn.flags(enabled=self.spec.device != "cpu"):
            s = run_eval(self.model, self.tok, examples, list(self.spec.budgets), self.spec.max_new_tokens,
                         self.spec.fences, progress=progress, variants=list(self.spec.variants),
                         teacher_tokens=self.spec.teacher_tokens,
                         profile=self.spec.base() if self.spec.profile else None, preamble=self.spec.preamble)
        s["offset"] = c.offset
        return s


def _worker_main(spec: RunSpec, threads: int, jobs, events, deadline: float | None) -> None:
    try:
        w = Worker(spec, threads)
    except BaseException:
        events.put(("error", None, ("", ""), traceback.format_exc()))
        return
    while (c := jobs.get()) is not None:
        if deadline is not None and time.time() > deadline:
            events.put(("skipped", c, None, None))
            continue
        try:
            s = w.run(c, progress=lambda n, _, c=c: events.put(("progress", c, n, None)))
        except BaseException as e:
            events.put(("error", c, (type(e).__name__, str(e)), traceback.format_exc()))
            return
        events.put(("done", c, s, None))


def run_chunks(spec: RunSpec, chunks: list[Chunk], procs: int = 1, chunk_dir: str | Path | None = None,
               deadline: float | None = None, progress=None) -> RunResult:
    """Run every chunk not already in `chunk_dir` on `procs` processes (1: in this process); no chunk starts
    after `deadline` (time.time()); `progress(done_questions)` is called as questions finish. A worker's
    exception is raised here (an `EvalRejected` as itself)."""
    from .harness import EvalRejected

    cdir = Path(chunk_dir) if chunk_dir else None
    done: dict[int, dict] = {}
    if cdir:
        cdir.mkdir(parents=True, exist_ok=True)
        for c in chunks:
            f = cdir / c.file(spec)
            if f.is_file():
                done[c.offset] = json.loads(f.read_text())
    reused = len(done)
    todo = [c for c in chunks if c.offset not in done]
    counts = {c.offset: c.limit for c in chunks if c.offset in done}

    def report():
        if progress:
            progress(sum(counts.values()))

    def finish(c: Chunk, s: dict):
        done[c.offset] = s
        counts[c.offset] = c.limit
        if cdir:
            tmp = cdir / (c.file(spec) + ".tmp")
            tmp.write_text(json.dumps(s))
            tmp.rename(cdir / c.file(spec))
        report()

    report()
    pending: list[Chunk] = []
    if todo and procs <= 1:
        w = Worker(spec)
        for c in todo:
            if deadline is not None and time.time() > deadline:
                pending.append(c)
                continue

            def step(n, _, c=c):
                counts[c.offset] = n
                report()
            finish(c, w.run(c, progress=step))
    elif todo:
        pending = _run_processes(spec, todo, min(procs, len(todo)), deadline, finish, counts, report, EvalRejected)
    return RunResult([done[o] for o in sorted(done)], sorted(pending, key=lambda c: c.offset), reused)


def _run_processes(spec, todo, procs, deadline, finish, counts, report, rejected_type) -> list[Chunk]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")                     # CUDA cannot be used in a forked child
    jobs, events = ctx.Queue(), ctx.Queue()
    for c in todo:
        jobs.put(c)
    for _ in range(procs):
        jobs.put(None)
    threads = max(1, (os.cpu_count() or 1) // procs)
    workers = [ctx.Process(target=_worker_main, args=(spec, threads, jobs, events, deadline), daemon=True)
               for _ in range(procs)]
    for p in workers:
        p.start()
    left, pending = len(todo), []
    try:
        while left:
            try:
                kind, c, payload, tb = events.get(timeout=5)
            except queue.Empty:
                if not any(p.is_alive() for p in workers):
                    raise RuntimeError(f"every eval worker exited with {left} chunks unfinished "
                                       f"(exit codes {[p.exitcode for p in workers]})")
                continue
            if kind == "progress":
                counts[c.offset] = payload
                report()
            elif kind == "done":
                finish(c, payload)
                left -= 1
            elif kind == "skipped":
                pending.append(c)
                left -= 1
            else:
                if payload[0] == rejected_type.__name__:
                    raise rejected_type(payload[1])
                raise RuntimeError(f"eval worker failed on {c}:\n{tb}")
    finally:
        for p in workers:
            p.join(timeout=10 if not left else 0)
            if p.is_alive():
                p.terminate()
                p.join()
    return pending
