"""`selfsup report`: every stage's manifest counts and metrics as one JSON object."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from selfsup_model.artifacts import read_manifest
from tasks.registry import STAGE_NAMES


def collect_report(workdir: str | Path) -> dict[str, Any]:
    wd = Path(workdir)
    stages: dict[str, Any] = {}
    for name in STAGE_NAMES:
        manifest = read_manifest(wd / name)
        if manifest is None:
            stages[name] = {"status": "missing"}
            continue
        stages[name] = {
            "status": "complete", "counts": manifest.counts, "metrics": manifest.metrics,
            "duration_s": manifest.duration_s, "finished_at": manifest.finished_at,
            "code_version": manifest.code_version,
        }
    return {"workdir": str(wd.resolve()), "stages": stages, "accounting": accounting(stages)}


def accounting(stages: dict[str, Any]) -> dict[str, Any]:
    """read = kept + duplicates + rejected, from the ingest, dedup and encode counts."""
    ingest = stages.get("ingest", {}).get("counts")
    if not ingest:
        return {}
    dedup = stages.get("dedup", {}).get("counts") or {}
    encode = stages.get("encode", {}).get("counts") or {}
    # Documents that tokenise to nothing are rejected at encode (reason no_tokens).
    no_tokens = encode.get("empty_docs", 0)
    rejected = ingest["rejected"] - ingest.get("rejected_duplicate_text", 0) + no_tokens
    duplicates = ingest.get("rejected_duplicate_text", 0) + dedup.get("duplicates_removed", 0)
    kept = dedup.get("kept", ingest["kept"]) - no_tokens
    return {
        "read": ingest["read"], "kept": kept, "duplicates": duplicates, "rejected": rejected,
        "balanced": ingest["read"] == kept + duplicates + rejected,
    }
