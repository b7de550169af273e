"""split: kept documents -> assignments.parquet (whole units per split), quarantine.parquet and
the leakage audit. A corpus that extends its last version keeps every earlier document's split
(`selfsup_model.corpus.splitting.extend_splits`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pandas as pd

from selfsup_model.artifacts import atomic_write_json, atomic_write_parquet
from selfsup_model.corpus.splitting import (
    QUARANTINE_COLUMNS,
    SplitCorpus,
    assign_splits,
    extend_splits,
)
from selfsup_model.errors import ArtifactError
from tasks.stage import RunContext, StageOutput, progress_logger
from tasks.versions import extended_snapshot, snapshot_file

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
    audit_progress = progress_logger(log, "split leakage audit: candidate pairs")
    snapshot = extended_snapshot(ctx, inputs["ingest/version.json"])
    if snapshot is None:
        result = assign_splits(
            corpus, ctx.config.split, ctx.config.dedup,
            progress=progress_logger(log, "split units: candidate pairs"),
            audit_progress=audit_progress)
        quarantine = pd.DataFrame(columns=list(QUARANTINE_COLUMNS)).astype("string")
    else:
        version = json.loads(inputs["ingest/version.json"].read_text("utf-8"))
        result, quarantine = extend_splits(
            corpus, pd.read_parquet(snapshot_file(snapshot, "split", "assignments.parquet")),
            _earlier_quarantine(snapshot), ctx.config.split, ctx.config.dedup,
            changed=version.get("changed_ids", []), audit_progress=audit_progress)
        log.info("split: %d new document(s): %d joined earlier units, %d in new units, %d "
                 "quarantined; no earlier document moved", result.counts["new_documents"],
                 result.counts["joined_earlier_units"],
                 result.counts["new_documents"] - result.counts["joined_earlier_units"]
                 - result.counts["quarantined_new"], result.counts["quarantined_new"])
    for warning in result.warnings:
        log.warning("split: %s", warning)
    files = [atomic_write_parquet(out / "assignments.parquet", result.assignments).name,
             atomic_write_parquet(out / "quarantine.parquet", quarantine).name,
             atomic_write_json(out / "audit.json",
                               {"audit": result.audit, "warnings": result.warnings}).name]
    counts = {**result.counts, "warnings": len(result.warnings)}
    return StageOutput(files, counts, metrics={"audit": result.audit}, log_artifacts=["audit.json"])


def _earlier_quarantine(snapshot: Path) -> pd.DataFrame:
    """The last version's quarantine list (none kept before versions were)."""
    try:
        return pd.read_parquet(snapshot_file(snapshot, "split", "quarantine.parquet"))
    except ArtifactError:
        return pd.DataFrame(columns=list(QUARANTINE_COLUMNS)).astype("string")


def optional_strings(column: pd.Series) -> list[str | None]:
    """A nullable string column as a list with None for missing values."""
    return [None if pd.isna(v) else str(v) for v in column.astype(object)]
