"""A TP group's ranks take their torch threads from OMP_NUM_THREADS where the deployment set it, else from the
group's CPUs divided among the ranks: the worker's and builder's `cpus` setting (REDKNOT_CPUS, the pod's share, from
the Helm chart) where given, else the cores this process may run on (services/common/tp.py `rank_threads`). Real rank
processes (spawned, gloo)."""
import json
import os

import pydantic
import pytest
import torch

from services.common.tp import launch, rank_threads


def _record(group, out_dir: str) -> None:
    with open(f"{out_dir}/rank{group.rank}.json", "w") as fh:
        json.dump(torch.get_num_threads(), fh)


def test_ranks_take_omp_num_threads_where_it_is_set(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert launch(2, _record, (str(tmp_path),)) == 0
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)] == [3, 3]


def test_without_it_the_cores_are_divided_among_the_ranks(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert rank_threads(1) == cores and rank_threads(2) == max(1, cores // 2) and rank_threads(4 * cores) == 1
    for junk in ("", "0", "two"):                     # not a count of threads: the default
        monkeypatch.setenv("OMP_NUM_THREADS", junk)
        assert rank_threads(2) == max(1, cores // 2)


def test_the_pods_cpu_share_is_divided_among_the_ranks(tmp_path, monkeypatch):
    """`cpus` (the chart's downward-API value of the pod's CPU limit or request) stands for the host's cores, in the
    spawned ranks too; OMP_NUM_THREADS, where set, still wins."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert rank_threads(1, 12) == 12 and rank_threads(4, 12) == 3 and rank_threads(16, 12) == 1
    assert launch(2, _record, (str(tmp_path),), cpus=6) == 0
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)] == [3, 3]
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert rank_threads(4, 12) == 5


def test_the_cpus_setting_reaches_the_worker_and_the_builder():
    from services.builder.settings import BuilderSettings
    from services.worker.settings import WorkerSettings
    for cls in (WorkerSettings, BuilderSettings):
        assert cls.from_args(env={"REDKNOT_CPUS": "24"}).cpus == 24 and cls.from_args(env={}).cpus == 0
        for bad in ("-2", "1.5", "all"):                 # a clear error naming the setting, at start
            with pytest.raises(pydantic.ValidationError, match="cpus"):
                cls.from_args(env={"REDKNOT_CPUS": bad})
