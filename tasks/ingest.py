"""ingest: corpus -> documents.parquet + rejects.parquet."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from selfsup_model.ingest import corpus_fingerprint, ingest_corpus
from tasks.io import write_parquet
from tasks.stage import RunContext, StageOutput, StageResult, StageSpec, run_stage


def _corpus_params(ctx: RunContext) -> dict:
    return {"corpus": corpus_fingerprint(ctx.corpus, ctx.corpus_format, ctx.config.ingest)}


SPEC = StageSpec("ingest", inputs=(), sections=("ingest",), extra_params=_corpus_params)


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    result = ingest_corpus(ctx.corpus, ctx.corpus_format, ctx.config.ingest)
    files = [write_parquet(result.documents, out / "documents.parquet"),
             write_parquet(result.rejects, out / "rejects.parquet")]
    return StageOutput(files, result.counts)


@task(name="ingest", cache_policy=NO_CACHE, persist_result=False)
def ingest_task(ctx: RunContext) -> StageResult:
    """Read the corpus, normalise, reject with reasons."""
    return run_stage(SPEC, ctx, compute)
