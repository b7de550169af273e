"""ingest: corpus -> documents.parquet + rejects.parquet."""

from __future__ import annotations

from pathlib import Path

from selfsup_model.artifacts import atomic_write_parquet
from selfsup_model.ingest import ingest_corpus
from tasks.stage import RunContext, StageOutput


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    result = ingest_corpus(ctx.corpus, ctx.corpus_format, ctx.config.ingest)
    files = [atomic_write_parquet(out / "documents.parquet", result.documents).name,
             atomic_write_parquet(out / "rejects.parquet", result.rejects).name]
    return StageOutput(files, result.counts)

