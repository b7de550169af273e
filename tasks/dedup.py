"""dedup: documents.parquet -> clusters.parquet, near_pairs.parquet, signatures.npy."""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd

from selfsup_model.artifacts import atomic_save_npy, atomic_write_parquet
from selfsup_model.corpus.dedup import find_duplicates
from selfsup_model.corpus.sharding import InMemoryTexts, ParquetTexts
from tasks.stage import RunContext, StageOutput, progress_logger

log = logging.getLogger("selfsup.dedup")


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    path = inputs["ingest/documents.parquet"]
    fan_out = ctx.fan_out
    if fan_out.in_process:
        docs = pd.read_parquet(path, columns=["id", "text"])
        ids, texts = docs["id"].tolist(), InMemoryTexts(docs["text"].tolist())
    else:  # shard tasks read the texts themselves: only the path travels
        ids, texts = pd.read_parquet(path, columns=["id"])["id"].tolist(), ParquetTexts(
            str(path.resolve()))
    result = fan_out.run("dedup", lambda mapper: find_duplicates(
        ids, texts, ctx.config.dedup, progress=progress_logger(log, "dedup signatures"),
        mapper=mapper, shards=fan_out.shards))
    files = [atomic_write_parquet(out / "clusters.parquet", result.clusters).name,
             atomic_write_parquet(out / "near_pairs.parquet", result.pairs).name,
             atomic_save_npy(out / "signatures.npy", result.signatures).name]
    return StageOutput(files, result.counts)

