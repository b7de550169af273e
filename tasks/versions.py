"""What the corpus stages share about versions: which earlier version this run extends.

The ingest stage decides, and writes `ingest/version.json`; dedup and split read it as an
input, so a run never mixes a fresh ingest with an extended dedup (or the reverse). The
earlier version is a snapshot folder of the workdir (`flows.versions`), shaped like a workdir,
whose files are loaded only while they match the sha256 their stages recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from selfsup_model.pretraining.continued import recorded_file
from tasks.stage import RunContext

VERSION_FILE = "version.json"


def extended_snapshot(ctx: RunContext, version_json: Path) -> Path | None:
    """The snapshot folder of the version this run's corpus extends, or None (a fresh one)."""
    extends = json.loads(version_json.read_text("utf-8")).get("extends")
    return None if extends is None else ctx.workdir / extends


def snapshot_file(snapshot: Path, stage: str, name: str) -> Path:
    """A file of the earlier version, verified against its stage's manifest there."""
    return recorded_file(snapshot, stage, name, "the last corpus version")[0]


def snapshot_documents(snapshot: Path, columns: list[str]) -> pd.DataFrame:
    return pd.read_parquet(snapshot_file(snapshot, "ingest", "documents.parquet"),
                           columns=columns)
