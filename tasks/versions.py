"""What the stages share about versions: which earlier version this run extends, and whether its
pretraining continues that version's encoder.

The ingest stage decides, and writes `ingest/version.json`; dedup and split read it as an
input, so a run never mixes a fresh ingest with an extended dedup (or the reverse). The
earlier version is a snapshot folder of the workdir (`flows.versions`), shaped like a workdir,
whose files are loaded only while they match the sha256 their stages recorded.

Light on imports: the stage table asks `warm_start` for a stage's parameters, and `selfsup
stages` must not load pandas or Keras to check a workdir.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from selfsup_model.artifacts import read_manifest
from tasks.stage import RunContext

if TYPE_CHECKING:
    import pandas as pd

VERSION_FILE = "version.json"
RECORD_FILE = "version_metrics.json"  # compare's record of a version's scores
# What must match for a checkpoint to continue (`continued.check_compatible` checks the same).
_ARCHITECTURE = ("hidden", "layers", "heads", "ff", "norm", "tie_embeddings")


def version_number(snapshot: Path) -> int:
    """The number of a version's snapshot folder (versions/<lineage>/vNNNN)."""
    return int(snapshot.name.removeprefix("v"))


def extended_snapshot(ctx: RunContext, version_json: Path) -> Path | None:
    """The snapshot folder of the version this run's corpus extends, or None (a fresh one)."""
    extends = json.loads(version_json.read_text("utf-8")).get("extends")
    return None if extends is None else ctx.workdir / extends


def snapshot_file(snapshot: Path, stage: str, name: str) -> Path:
    """A file of the earlier version, verified against its stage's manifest there."""
    from selfsup_model.pretraining.continued import recorded_file

    return recorded_file(snapshot, stage, name, "the last corpus version")[0]


def snapshot_documents(snapshot: Path, columns: list[str]) -> pd.DataFrame:
    import pandas as pd

    return pd.read_parquet(snapshot_file(snapshot, "ingest", "documents.parquet"),
                           columns=columns)


def warm_start(ctx: RunContext) -> tuple[Path | None, str]:
    """(snapshot, "") of the earlier corpus version whose encoder this run's pretraining
    continues (`pretrain.versions=continue`, the default), or (None, why it starts from random
    initialisation instead; "" for a first version or an init_from run, which say their own)."""
    cfg = ctx.config.pretrain
    version_json = ctx.workdir / "ingest" / VERSION_FILE
    if cfg.init_from or not version_json.is_file():
        return None, ""
    snapshot = extended_snapshot(ctx, version_json)
    if snapshot is None:
        return None, ""
    name = f"corpus version {version_number(snapshot)}"
    if cfg.versions == "scratch":
        return None, f"pretrain.versions=scratch: not continuing {name}'s encoder"
    made = read_manifest(snapshot / "pretrain")
    if made is None:
        return None, f"{name} was not pretrained, so there is no encoder to continue"
    model = made.params.get("model", {})
    before = {**{f"model.{k}": model.get(k) for k in _ARCHITECTURE},
              "pretrain.objective": made.params.get("pretrain", {}).get("objective")}
    now = {**{f"model.{k}": getattr(ctx.config.model, k) for k in _ARCHITECTURE},
           "pretrain.objective": cfg.objective}
    differ = [f"{k}={now[k]} ({before[k]} there)" for k in now if now[k] != before[k]]
    encoded = read_manifest(snapshot / "encode")
    max_len = encoded.params.get("encode", {}).get("max_len") if encoded else None
    if max_len is not None and ctx.config.encode.max_len > max_len:
        differ.append(f"encode.max_len={ctx.config.encode.max_len} ({max_len} there)")
    if differ:
        return None, f"{name}'s encoder has other settings: {', '.join(differ)}"
    return snapshot, ""


def warm_start_params(ctx: RunContext) -> dict:
    """The pretrain stage's parameters when it continues an earlier version: which encoder, and
    what the window selection reads (the earlier training split, this one's documents); all
    from manifests, nothing hashed here."""
    snapshot, _ = warm_start(ctx)
    if snapshot is None:
        return {}
    made = read_manifest(snapshot / "pretrain")
    earlier = read_manifest(snapshot / "split")
    encoded = read_manifest(ctx.workdir / "encode")
    return {"continues": {
        "version": snapshot.relative_to(ctx.workdir).as_posix(),
        "pretrain_model_sha256": made.outputs["pretrain_model.keras"].sha256,
        "earlier_assignments_sha256": earlier.outputs["assignments.parquet"].sha256,
        "train_docs_sha256": (encoded.outputs["train_docs.parquet"].sha256
                              if encoded and "train_docs.parquet" in encoded.outputs else None)}}


def earlier_versions(ctx: RunContext) -> list[Path]:
    """The snapshots of the lineage's versions before this run's, oldest first ([] for a first
    version): version 1 up to the one this run's corpus extends."""
    version_json = ctx.workdir / "ingest" / VERSION_FILE
    snapshot = extended_snapshot(ctx, version_json) if version_json.is_file() else None
    if snapshot is None:
        return []
    return [snapshot.parent / f"v{k:04d}" for k in range(1, version_number(snapshot) + 1)]


def comparison_params(ctx: RunContext) -> dict:
    """The compare stage's parameters about versions: this one's number and lineage, the first
    test set (version 1's split) and the earlier versions' records, from manifests."""
    earlier = earlier_versions(ctx)
    first = read_manifest(earlier[0] / "split") if earlier else None
    records = [read_manifest(s / "compare") for s in earlier]
    return {"versions": {
        "version": len(earlier) + 1,
        "lineage": earlier[0].parent.name if earlier else ctx.lineage,
        "first_split": first.outputs["assignments.parquet"].sha256 if first else None,
        "earlier_records": [m.outputs[RECORD_FILE].sha256
                            if m is not None and RECORD_FILE in m.outputs else None
                            for m in records]}}
