"""ingest: corpus -> documents.parquet + rejects.parquet + version.json.

Records are judged in shards placed by the run's executor; shards that run elsewhere
spill their texts into a temporary folder inside this stage's directory. When the run
extends the workdir's last corpus version (`ctx.previous`), that version's documents come
first, in their order, so none of them loses its id or text to a newcomer, and version.json
counts what is new, changed and retired (`selfsup_model.corpus.versions`)."""

from __future__ import annotations

import logging
from pathlib import Path

from selfsup_model.artifacts import atomic_write_json, atomic_write_parquet
from selfsup_model.corpus.ingest import ingest_corpus
from selfsup_model.corpus.versions import MIN_SHARED, diff_versions
from tasks.stage import RunContext, StageOutput, progress_logger
from tasks.versions import VERSION_FILE, snapshot_documents

log = logging.getLogger("selfsup.ingest")


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    previous = (None if ctx.previous is None
                else snapshot_documents(ctx.previous, ["id", "text"]))

    def ingest(first_ids=(), known_texts=()):
        return ingest_corpus(ctx.corpus, ctx.corpus_format, ctx.config.ingest,
                             fan_out=ctx.fan_out, scratch=out.resolve(),
                             progress=progress_logger(log, "ingest shards"), first_ids=first_ids,
                             known_texts=known_texts)

    result = (ingest() if previous is None
              else ingest(previous["id"].tolist(), previous["text"].tolist()))
    version: dict = {"extends": None}
    counts = dict(result.counts)
    if previous is not None:
        diff = diff_versions(previous, result.documents)
        shared = diff.shared(len(previous))
        if shared < MIN_SHARED:
            log.warning("ingest: only %.0f%% of the last corpus version's %d documents are here "
                        "unchanged (< %.0f%%): this is a new corpus, not a new version; starting "
                        "a new lineage", 100 * shared, len(previous), 100 * MIN_SHARED)
            version["new_lineage"] = f"shares {shared:.0%} of the last version"
            result = ingest()
            counts = dict(result.counts)
        else:
            version.update({"extends": ctx.previous.relative_to(ctx.workdir).as_posix(),
                            **diff.counts(), "changed_ids": diff.changed,
                            "retired_ids": diff.retired})
            counts.update({f"version_{k}": v for k, v in diff.counts().items()})
            log.info("ingest: extends %s: %s", version["extends"],
                     ", ".join(f"{k} {v}" for k, v in diff.counts().items()))
    files = [atomic_write_parquet(out / "documents.parquet", result.documents).name,
             atomic_write_parquet(out / "rejects.parquet", result.rejects).name,
             atomic_write_json(out / VERSION_FILE, version).name]
    return StageOutput(files, counts)
