"""dedup: documents.parquet -> clusters.parquet, near_pairs.parquet, signatures.npy, digests.npy.

A corpus that extends its last version (`ingest/version.json`) is deduplicated incrementally:
only the new documents are signed and judged, against the documents kept so far
(`selfsup_model.corpus.dedup.extend_duplicates`); that runs in this process."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd

from selfsup_model.artifacts import atomic_save_npy, atomic_write_parquet
from selfsup_model.corpus.dedup import DedupResult, extend_duplicates, find_duplicates
from selfsup_model.corpus.sharding import InMemoryTexts, ParquetTexts
from selfsup_model.corpus.versions import diff_versions
from tasks.stage import RunContext, StageOutput, progress_logger
from tasks.versions import extended_snapshot, snapshot_documents, snapshot_file

log = logging.getLogger("selfsup.dedup")


def _extend(ctx: RunContext, snapshot: Path, docs: pd.DataFrame) -> DedupResult:
    before = snapshot_documents(snapshot, ["id", "text"])
    digests = snapshot_file(snapshot, "dedup", "digests.npy")
    previous = DedupResult(
        pd.read_parquet(snapshot_file(snapshot, "dedup", "clusters.parquet")),
        np.load(snapshot_file(snapshot, "dedup", "signatures.npy"), allow_pickle=False),
        pairs=pd.read_parquet(snapshot_file(snapshot, "dedup", "near_pairs.parquet")),
        digests=np.load(digests, allow_pickle=False))
    diff = diff_versions(before, docs)
    log.info("dedup: %d new document(s) against the %d kept so far", int((diff.prev_rows < 0)
             .sum()), int(previous.clusters["is_kept"].sum()))
    return extend_duplicates(previous, diff.prev_rows, docs["id"].tolist(),
                             docs["text"].tolist(), ctx.config.dedup,
                             progress=progress_logger(log, "dedup signatures"))


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    path = inputs["ingest/documents.parquet"]
    fan_out = ctx.fan_out
    snapshot = extended_snapshot(ctx, inputs["ingest/version.json"])
    if snapshot is not None:
        result = _extend(ctx, snapshot, pd.read_parquet(path, columns=["id", "text"]))
    else:
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
             atomic_save_npy(out / "signatures.npy", result.signatures).name,
             atomic_save_npy(out / "digests.npy", result.digests).name]
    return StageOutput(files, result.counts)
