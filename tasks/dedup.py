"""dedup: documents.parquet -> clusters.parquet, near_pairs.parquet, signatures.npy."""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd

from selfsup_model.artifacts import atomic_save_npy, atomic_write_parquet
from selfsup_model.dedup import find_duplicates
from tasks.stage import RunContext, StageOutput, progress_logger

log = logging.getLogger("selfsup.dedup")


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    docs = pd.read_parquet(inputs["ingest/documents.parquet"], columns=["id", "text"])
    result = find_duplicates(docs["id"].tolist(), docs["text"].tolist(), ctx.config.dedup,
                             progress=progress_logger(log, "dedup signatures"))
    files = [atomic_write_parquet(out / "clusters.parquet", result.clusters).name,
             atomic_write_parquet(out / "near_pairs.parquet", result.pairs).name,
             atomic_save_npy(out / "signatures.npy", result.signatures).name]
    return StageOutput(files, result.counts)

