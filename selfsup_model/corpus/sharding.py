"""Shards of per-document work, and who runs them.

A sharded stage is a driver plus shard functions. Shard functions are plain
module-level functions of small, picklable arguments - a path to read from, a
row range, a config, a chunk of index pairs - that return numpy arrays; the
driver never hands a corpus to a scheduler. The driver calls a `Mapper` to run
one shard function over a list of argument sets and gets the results back in
order. `local_map` runs them here, one after another (the default: today's
behaviour and speed); the flows package provides mappers that submit them as
Prefect tasks to a thread pool or a Dask cluster (`flows.executors`). Results
are combined in shard order, so they never depend on which mapper ran them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

Progress = Callable[[int, int], None]
T = TypeVar("T")


class Mapper(Protocol):
    """Runs `fn(**kwargs)` for every kwargs in `items`; results in the order of `items`.

    `in_process` says whether the calls run in this process (so a shard may take
    a progress callback) or elsewhere (so its arguments must pickle cheaply)."""

    in_process: bool

    def __call__(self, name: str, fn: Callable[..., Any], items: list[dict[str, Any]],
                 progress: Progress | None = None) -> list[Any]: ...


class LocalMapper:
    """Every shard in this process, in order."""

    in_process = True

    def __call__(self, name: str, fn: Callable[..., Any], items: list[dict[str, Any]],
                 progress: Progress | None = None) -> list[Any]:
        out = []
        for item in items:
            out.append(fn(**item))
            if progress is not None:
                progress(len(out), len(items))
        return out


local_map = LocalMapper()


class FanOut(Protocol):
    """A run's executor as a stage sees it: how many shards to cut, whether they run in this
    process, and `run(name, body)`, which calls `body(mapper)` with a mapper that sends shard
    tasks wherever the run's executor says."""

    shards: int
    in_process: bool

    def run(self, name: str, body: Callable[[Mapper], T]) -> T: ...


@dataclass(frozen=True)
class InProcess:
    """Shards run here, in order (the default executor)."""

    shards: int = 1
    in_process: bool = True

    def run(self, name: str, body: Callable[[Mapper], T]) -> T:
        return body(local_map)


def shard_bounds(n: int, shards: int) -> list[tuple[int, int]]:
    """[lo, hi) row ranges cutting n rows into `shards` contiguous, near-equal, non-empty parts
    (fewer when n < shards)."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    edges = np.linspace(0, n, min(shards, max(n, 1)) + 1).round().astype(np.int64)
    return [(int(lo), int(hi)) for lo, hi in itertools.pairwise(edges) if hi > lo]


class TextSource(Protocol):
    """Where shard functions read texts from: by row range or by row numbers."""

    def slice(self, lo: int, hi: int) -> list[str]: ...

    def take(self, rows: np.ndarray) -> list[str]: ...


@dataclass(frozen=True)
class InMemoryTexts:
    """Texts already in this process (only for in-process mappers: they pickle whole)."""

    texts: Sequence[str]

    def __len__(self) -> int:
        return len(self.texts)

    def slice(self, lo: int, hi: int) -> list[str]:
        return list(self.texts[lo:hi])

    def take(self, rows: np.ndarray) -> list[str]:
        return [self.texts[i] for i in rows]


@dataclass(frozen=True)
class ParquetTexts:
    """One string column of a parquet file, read by whoever runs the shard: only the path
    travels. A worker on another machine needs the same path (a shared filesystem)."""

    path: str
    column: str = "text"

    def __len__(self) -> int:
        import pyarrow.parquet as pq

        return pq.ParquetFile(self.path).metadata.num_rows

    def _column(self):
        import pyarrow.parquet as pq

        return pq.read_table(self.path, columns=[self.column]).column(0)

    def slice(self, lo: int, hi: int) -> list[str]:
        return self._column().slice(lo, hi - lo).to_pylist()

    def take(self, rows: np.ndarray) -> list[str]:
        return self._column().take(np.asarray(rows, dtype=np.int64)).to_pylist()


def pair_chunks(pairs: np.ndarray, shards: int, budget: int = 1 << 16) -> list[np.ndarray]:
    """Cut (m, 2) pairs into at least `shards` chunks (when there are that many pairs) of at
    most `budget` pairs, in order."""
    if not len(pairs):
        return []
    parts = max(shards, -(-len(pairs) // budget))
    return [c for c in np.array_split(pairs, min(parts, len(pairs))) if len(c)]
