"""Small artifact readers/writers shared by the stage tasks (all writes atomic)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from selfsup_model.artifacts import atomic_path


def write_parquet(frame: pd.DataFrame, path: Path) -> str:
    """Write a table atomically; returns the file name for the stage's output list."""
    with atomic_path(path) as tmp:
        frame.to_parquet(tmp, index=False)
    return path.name


def read_parquet(path: Path, columns: list[str] | None = None) -> pd.DataFrame:
    return pd.read_parquet(path, columns=columns)


def write_npy(array, path: Path) -> str:
    """np.save atomically (through a file handle, so no '.npy' is appended to the temp name)."""
    import numpy as np

    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        np.save(fh, np.ascontiguousarray(array), allow_pickle=False)
    return path.name


def progress_logger(log, what: str, every_s: float = 5.0):
    """A `progress(done, total)` callback that logs at most every `every_s` seconds."""
    import time

    last = [0.0]

    def _progress(done: int, total: int) -> None:
        now = time.monotonic()
        if done >= total or now - last[0] >= every_s:
            last[0] = now
            log.info("%s: %d/%d (%.0f%%)", what, done, total, 100.0 * done / max(total, 1))

    return _progress


def optional_strings(column: pd.Series) -> list[str | None]:
    """A nullable string column as a list with None for missing values."""
    return [None if pd.isna(v) else str(v) for v in column.astype(object)]
