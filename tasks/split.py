"""split: kept documents -> assignments.parquet (whole units per split) + leakage audit."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd

from selfsup_model.artifacts import atomic_write_json, atomic_write_parquet
from selfsup_model.corpus.splitting import SplitCorpus, assign_splits
from selfsup_model.errors import ArtifactError
from tasks.stage import RunContext, StageOutput, progress_logger

log = logging.getLogger("selfsup.split")


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    docs = pd.read_parquet(inputs["ingest/documents.parquet"],
                           columns=["id", "text", "label", "group"])
    clusters = pd.read_parquet(inputs["dedup/clusters.parquet"],
                               columns=["id", "cluster_id", "is_kept"])
    if (len(docs) != len(clusters)
            or not (docs["id"].to_numpy(str) == clusters["id"].to_numpy(str)).all()):
        raise ArtifactError("dedup/clusters.parquet is not aligned with ingest/documents.parquet; "
                            "rerun with --force dedup")
    kept = clusters["is_kept"].to_numpy()
    signatures = np.load(inputs["dedup/signatures.npy"], allow_pickle=False)[kept]
    docs = docs[kept].reset_index(drop=True)
    corpus = SplitCorpus(docs["id"].tolist(), docs["text"].tolist(),
                         optional_strings(docs["label"]), optional_strings(docs["group"]),
                         signatures, clusters["cluster_id"].to_numpy()[kept])
    result = assign_splits(
        corpus, ctx.config.split, ctx.config.dedup,
        progress=progress_logger(log, "split units: candidate pairs"),
        audit_progress=progress_logger(log, "split leakage audit: candidate pairs"),
    )
    for warning in result.warnings:
        log.warning("split: %s", warning)
    files = [atomic_write_parquet(out / "assignments.parquet", result.assignments).name,
             atomic_write_json(out / "audit.json",
                               {"audit": result.audit, "warnings": result.warnings}).name]
    counts = {**result.counts, "warnings": len(result.warnings)}
    return StageOutput(files, counts, metrics={"audit": result.audit}, log_artifacts=["audit.json"])



def optional_strings(column: pd.Series) -> list[str | None]:
    """A nullable string column as a list with None for missing values."""
    return [None if pd.isna(v) else str(v) for v in column.astype(object)]
