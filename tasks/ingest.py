"""ingest: corpus -> documents.parquet + rejects.parquet.

Records are judged in shards placed by the run's executor; shards that run elsewhere
spill their texts into a temporary folder inside this stage's directory."""

from __future__ import annotations

import logging
from pathlib import Path

from selfsup_model.artifacts import atomic_write_parquet
from selfsup_model.corpus.ingest import ingest_corpus
from tasks.stage import RunContext, StageOutput, progress_logger

log = logging.getLogger("selfsup.ingest")


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    result = ingest_corpus(ctx.corpus, ctx.corpus_format, ctx.config.ingest,
                           fan_out=ctx.fan_out, scratch=out.resolve(),
                           progress=progress_logger(log, "ingest shards"))
    files = [atomic_write_parquet(out / "documents.parquet", result.documents).name,
             atomic_write_parquet(out / "rejects.parquet", result.rejects).name]
    return StageOutput(files, result.counts)
