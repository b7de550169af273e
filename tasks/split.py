"""split: kept documents -> assignments.parquet (whole units per split) + leakage audit."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE

from selfsup_model.artifacts import atomic_write_json
from selfsup_model.splitting import assign_splits
from tasks.io import optional_strings, progress_logger, read_parquet, write_parquet
from tasks.stage import RunContext, StageOutput, StageResult, StageSpec, run_stage

log = logging.getLogger("selfsup.split")
SPEC = StageSpec(
    "split",
    inputs=("ingest/documents.parquet", "dedup/clusters.parquet", "dedup/signatures.npy"),
    sections=("split", "dedup"),
    version=3,  # v3: higher-recall unit building; the audit bands regrouped signature columns
)


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    docs = read_parquet(inputs["ingest/documents.parquet"], ["id", "text", "label", "group"])
    clusters = read_parquet(inputs["dedup/clusters.parquet"], ["id", "cluster_id", "is_kept"])
    if len(docs) != len(clusters) or not (docs["id"].to_numpy(str) == clusters["id"].to_numpy(str)).all():
        raise RuntimeError("dedup/clusters.parquet is not aligned with ingest/documents.parquet")
    kept = clusters["is_kept"].to_numpy()
    signatures = np.load(inputs["dedup/signatures.npy"], allow_pickle=False)[kept]
    docs = docs[kept].reset_index(drop=True)
    result = assign_splits(
        docs["id"].tolist(), docs["text"].tolist(), optional_strings(docs["label"]), optional_strings(docs["group"]),
        signatures, clusters["cluster_id"].to_numpy()[kept], ctx.config.split, ctx.config.dedup,
        progress=progress_logger(log, "split relatedness"),
    )
    for warning in result.warnings:
        log.warning("split: %s", warning)
    files = [write_parquet(result.assignments, out / "assignments.parquet"),
             atomic_write_json(out / "audit.json", {"audit": result.audit, "warnings": result.warnings}).name]
    counts = {**result.counts, "warnings": len(result.warnings)}
    return StageOutput(files, counts, metrics={"audit": result.audit}, log_artifacts=["audit.json"])


@task(name="split", cache_policy=NO_CACHE, persist_result=False)
def split_task(ctx: RunContext) -> StageResult:
    """Assign whole duplicate clusters, related units and groups to train/val/test; audit leakage."""
    return run_stage(SPEC, ctx, compute)
