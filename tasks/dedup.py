"""dedup: documents.parquet -> clusters.parquet, near_pairs.parquet, signatures.npy."""

from __future__ import annotations

import logging
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from selfsup_model.dedup import find_duplicates
from tasks.io import progress_logger, read_parquet, write_npy, write_parquet
from tasks.stage import RunContext, StageOutput, StageResult, StageSpec, run_stage

log = logging.getLogger("selfsup.dedup")
SPEC = StageSpec("dedup", inputs=("ingest/documents.parquet",), sections=("dedup",))


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    docs = read_parquet(inputs["ingest/documents.parquet"], ["id", "text"])
    result = find_duplicates(docs["id"].tolist(), docs["text"].tolist(), ctx.config.dedup,
                             progress=progress_logger(log, "dedup signatures"))
    files = [write_parquet(result.clusters, out / "clusters.parquet"),
             write_parquet(result.pairs, out / "near_pairs.parquet"),
             write_npy(result.signatures, out / "signatures.npy")]
    return StageOutput(files, result.counts)


@task(name="dedup", cache_policy=NO_CACHE, persist_result=False)
def dedup_task(ctx: RunContext) -> StageResult:
    """Remove exact and MinHash-verified near duplicates."""
    return run_stage(SPEC, ctx, compute)
