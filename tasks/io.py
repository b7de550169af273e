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
