"""Where a run's shard tasks execute: here, a thread pool, or Dask - never part of any output.

Sharded stages (`tasks.dedup`, ...) describe their per-document work as shard
functions and hand them to a `Mapper` (`selfsup_model.corpus.sharding`). This module
turns the run's executor choice into one:

- ``local`` (the default): shards run in this process, one after another, with
  no Prefect machinery in between - today's behaviour and speed;
- ``threads``: each sharded stage opens a Prefect sub-flow whose task runner is
  a `ThreadPoolTaskRunner`, and maps one Prefect task per shard;
- ``dask``: the same sub-flow with prefect-dask's `DaskTaskRunner`, either on a
  `distributed.LocalCluster` this run starts once (one single-threaded worker
  process per core, bound to 127.0.0.1) or on an existing scheduler by address.

The driver (the pipeline process) keeps the workdir lock, the manifests and
MLflow; shard tasks get paths, configs and small arrays and return small arrays.
Executor, worker and shard counts are not stage parameters: changing them never
makes a stage stale, because every mapper gives the same bytes.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from selfsup_model.corpus.sharding import FanOut, InProcess, Mapper, Progress
from selfsup_model.errors import UserError

log = logging.getLogger("selfsup.executors")
T = TypeVar("T")
Executor = Literal["local", "threads", "dask"]
EXECUTORS: tuple[str, ...] = ("local", "threads", "dask")


@dataclass(frozen=True)
class Sharding:
    """The run's choice: executor, shard count (None: 1 in-process, else one per worker),
    workers (threads or local Dask workers; None: one per core) and a Dask scheduler address."""

    executor: Executor = "local"
    shards: int | None = None
    workers: int | None = None
    dask_address: str | None = None

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise UserError(f"executor must be one of {', '.join(EXECUTORS)}, "
                            f"got {self.executor!r}")
        for name in ("shards", "workers"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"{name} must be at least 1, got {value}")
        if self.dask_address and self.executor != "dask":
            raise UserError("a Dask scheduler address needs executor 'dask' "
                            "(--executor dask --dask-address tcp://HOST:PORT)")
        if self.dask_address and self.workers:
            raise UserError("workers sizes a local Dask cluster; an existing scheduler at "
                            f"{self.dask_address} has the workers it has")

    @property
    def worker_count(self) -> int:
        return self.workers or os.cpu_count() or 1

    @property
    def shard_count(self) -> int:
        if self.shards is not None:
            return self.shards
        return 1 if self.executor == "local" else self.worker_count


class TaskRunnerFanOut:
    """Shard tasks of each sharded stage mapped in a Prefect sub-flow under a task runner
    (`runner_factory()` builds a fresh one per sub-flow)."""

    in_process = False

    def __init__(self, shards: int, runner_factory: Callable[[], Any],
                 dask_address: str | None = None):
        self.shards = shards
        self.dask_address = dask_address  # the scheduler, when the runner is Dask's
        self._runner_factory = runner_factory

    def run(self, name: str, body: Callable[[Mapper], T]) -> T:
        key = f"{name}-{id(body)}"
        _BODIES[key] = body
        try:
            return _sharded_flow().with_options(name=f"selfsup-{name}-shards",
                                                task_runner=self._runner_factory())(key)
        finally:
            del _BODIES[key]


# The bodies of running sub-flows, by key. A task runner ships the enclosing flow with every
# task it submits, so the sub-flow's function must not close over the stage's data: it is a
# module-level function that finds its body here, in the driver.
_BODIES: dict[str, Callable[[Mapper], Any]] = {}


def _run_body(key: str) -> Any:
    return _BODIES[key](PrefectMapper())


def _sharded_flow():
    from prefect import flow

    return flow(_run_body, persist_result=False, validate_parameters=False)


class PrefectMapper:
    """One Prefect task per shard, submitted to the enclosing flow's task runner; results
    come back in shard order."""

    in_process = False

    def __call__(self, name: str, fn: Callable[..., Any], items: list[dict[str, Any]],
                 progress: Progress | None = None) -> list[Any]:
        from prefect.utilities.annotations import unmapped

        futures = _shard_task().with_options(name=name).map(unmapped(fn), items)
        out = []
        for future in futures:
            out.append(future.result())
            if progress is not None:
                progress(len(out), len(items))
        log.info("%s: %d shard task(s) done", name, len(items))
        return out


def _run_shard(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    return fn(**kwargs)


def _shard_task():
    from prefect import task
    from prefect.cache_policies import NO_CACHE

    # Inputs and results are arrays that live only in memory: never cached or persisted.
    return task(_run_shard, name="shard", cache_policy=NO_CACHE, persist_result=False)


@contextlib.contextmanager
def open_fan_out(sharding: Sharding) -> Iterator[FanOut]:
    """The run's FanOut; a local Dask cluster, when asked for, lives as long as the block."""
    shards = sharding.shard_count
    if sharding.executor == "local":
        yield InProcess(shards)
        return
    if sharding.executor == "threads":
        from prefect.task_runners import ThreadPoolTaskRunner

        workers = sharding.worker_count
        yield TaskRunnerFanOut(shards, lambda: ThreadPoolTaskRunner(max_workers=workers))
        return
    runner_cls = _dask_task_runner()
    if sharding.dask_address:
        log.info("shard tasks go to the Dask scheduler at %s", sharding.dask_address)
        yield TaskRunnerFanOut(shards, lambda: runner_cls(address=sharding.dask_address),
                               sharding.dask_address)
        return
    from distributed import LocalCluster

    # Workers report their task runs to this run's Prefect API; without it each worker
    # process would start a temporary Prefect server of its own.
    with LocalCluster(n_workers=sharding.worker_count, threads_per_worker=1, processes=True,
                      host="127.0.0.1", dashboard_address=None,
                      env={"PREFECT_API_URL": prefect_api_url()}) as cluster:
        log.info("local Dask cluster: %d worker(s) at %s", sharding.worker_count,
                 cluster.scheduler_address)
        address = cluster.scheduler_address
        yield TaskRunnerFanOut(shards, lambda: runner_cls(address=address), address)


def _dask_task_runner():
    try:
        from prefect_dask import DaskTaskRunner
    except ImportError as exc:
        raise UserError("executor 'dask' needs prefect-dask: pip install 'selfsup[dask]'") from exc
    return DaskTaskRunner


def prefect_api_url() -> str:
    """The API this process reports to (a configured server, or its temporary one)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return str(client.api_url)
