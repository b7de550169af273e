"""Corpus versions of a workdir: the lineage a grown corpus extends, and the version switch.

`<workdir>/versions/lineage.json` names the workdir's corpus lineage and lists its complete
versions; `<workdir>/versions/<lineage>/vNNNN/` holds each version's stage outputs and
manifests (hard links, so a snapshot costs no space), shaped like a workdir. A run starts from
the last complete version (`open_lineage`): its ingest puts that version's documents first,
and dedup and split extend it (`selfsup_model.corpus.versions` has the policy). When the run
has finished, `commit_version` snapshots the stages and then rewrites lineage.json: that write
is the version switch, the last thing a run does, so a run killed at any moment leaves the
last complete version as it was, and a rerun makes the new version again.

Settings that shape which documents there are, their duplicates, splits or tokens (the ingest,
dedup, split and tokenizer sections, and the corpus format) belong to a lineage: changing one
starts a new lineage (said before any work), as does `new_lineage=True`
(`selfsup run --new-lineage`) or a corpus that keeps less than half of the last version.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from selfsup_model.artifacts import (
    MANIFEST_NAME,
    atomic_write_json,
    cached_sha256,
    read_manifest,
    sha256_json,
    verify_outputs,
)
from selfsup_model.config import CorpusFormat, PipelineConfig
from selfsup_model.errors import ArtifactError
from tasks.registry import STAGE_NAMES
from tasks.stage import fault_point

log = logging.getLogger("selfsup.versions")
VERSIONS_DIR = "versions"
LINEAGE_FILE = "lineage.json"
SHAPING_SECTIONS = ("ingest", "dedup", "split", "tokenizer")


@dataclasses.dataclass(frozen=True)
class LineageStart:
    """Where a run stands: its lineage id, the last complete version (its number, 0 when there
    is none), and the snapshot folder the corpus stages extend: that version's, when the
    corpus differs from it; None for a first version, a new lineage, or the very corpus of the
    last version (which is that version, as it was made)."""

    lineage: str
    extends: Path | None
    version: int
    settings: dict[str, Any]


# Settings of those sections that change how fast, never what: not part of a lineage.
_NOT_SHAPING = {"ingest": {"workers"}, "dedup": {"batch_size"}}


def _shaping(config: PipelineConfig, corpus_format: CorpusFormat) -> dict[str, Any]:
    return {"corpus_format": corpus_format,
            **{s: {k: v for k, v in getattr(config, s).model_dump(mode="json").items()
                   if k not in _NOT_SHAPING.get(s, ())} for s in SHAPING_SECTIONS}}


def read_lineage(workdir: Path) -> dict[str, Any] | None:
    path = workdir / VERSIONS_DIR / LINEAGE_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text("utf-8"))
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{path} is unreadable ({exc}); move it away to start a new corpus "
                            "lineage") from None


def _changed(before: dict[str, Any], after: dict[str, Any], prefix: str = "") -> list[str]:
    if isinstance(before, dict) and isinstance(after, dict):
        return [k for key in sorted(before.keys() | after.keys())
                for k in _changed(before.get(key), after.get(key), f"{prefix}{key}.")]
    return [] if before == after else [prefix[:-1]]


def open_lineage(workdir: Path, config: PipelineConfig, corpus: str,
                 corpus_format: CorpusFormat, new_lineage: bool = False,
                 quiet: bool = False) -> LineageStart:
    """The lineage this run grows; says in one line what it extends, or why it starts anew
    (unless `quiet`: a status check)."""
    say = (lambda *a: None) if quiet else log.info
    settings = _shaping(config, corpus_format)
    state = read_lineage(workdir)
    if state is None:
        lineage = sha256_json(settings)[:12]
        say("corpus versions: none yet in this workdir; this run makes version 1 of lineage %s",
            lineage)
        return LineageStart(lineage, None, 0, settings)
    last = state["versions"][-1]["version"] if state["versions"] else 0
    why = None
    if new_lineage:
        why = "as asked (--new-lineage)"
    elif state["settings"] != settings:
        keys = _changed(state["settings"], settings)
        shown = ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")
        why = f"settings that shape the documents, duplicates, splits or tokens changed ({shown})"
    if why is not None or not last:
        lineage = f"{sha256_json(settings)[:12]}-{int(state.get('lineages', 1)) + 1}"
        say("corpus versions: starting new lineage %s %s: its first version is built as for a "
            "new corpus, nothing extends lineage %s", lineage, why or "", state["lineage"])
        return LineageStart(lineage, None, 0, settings)
    snapshot = workdir / VERSIONS_DIR / state["lineage"] / f"v{last:04d}"
    made = read_manifest(snapshot / "ingest")
    from selfsup_model.corpus.ingest import corpus_fingerprint

    if made is not None and made.params.get("corpus") == corpus_fingerprint(
            corpus, corpus_format, config.ingest):
        extends = made.params.get("extends")  # this corpus is that version: as it was made
        extends = None if extends is None else workdir / extends
        say("corpus versions: lineage %s, version %d: the corpus is unchanged since",
            state["lineage"], last)
    else:
        extends = snapshot
        say("corpus versions: lineage %s, version %d is the last complete one; a grown corpus "
            "extends it and no document changes split", state["lineage"], last)
    return LineageStart(state["lineage"], extends, last, settings)


def _valid_stages(workdir: Path) -> list[str]:
    """Stages whose manifest and outputs are intact, in pipeline order."""
    done = []
    for stage in STAGE_NAMES:
        manifest = read_manifest(workdir / stage)
        if manifest is not None and not verify_outputs(workdir / stage, manifest,
                                                        hasher=cached_sha256):
            done.append(stage)
    return done


def _link_tree(workdir: Path, stages: list[str], target: Path) -> None:
    """Hard-link each stage's recorded outputs and manifest into target/<stage>/ (a copy where
    the filesystem cannot link)."""
    for stage in stages:
        manifest = read_manifest(workdir / stage)
        (target / stage).mkdir(parents=True, exist_ok=True)
        for name in [*manifest.outputs, MANIFEST_NAME]:
            src, dst = workdir / stage / name, target / stage / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)


def commit_version(workdir: Path, start: LineageStart) -> int | None:
    """After a finished run: snapshot its stages as a version of the lineage, then switch.

    Nothing happens unless ingest, dedup and split are complete. The documents of the last
    version refresh its snapshot (later stages may have been added); a corpus that extends it
    makes the next version; a fresh one makes version 1 of this run's lineage (or of a new
    one, when the corpus itself left the lineage: it kept too little of the last version).
    Returns the version number, or None."""
    stages = _valid_stages(workdir)
    if not {"ingest", "dedup", "split"} <= set(stages):
        return None
    ingest = read_manifest(workdir / "ingest")
    version_info = json.loads((workdir / "ingest" / "version.json").read_text("utf-8"))
    digest = ingest.outputs["documents.parquet"].sha256
    state = read_lineage(workdir)
    lineage, versions = start.lineage, []
    if state is not None and state["lineage"] == lineage:
        versions = list(state["versions"])
    if versions and versions[-1]["documents_sha256"] == digest:
        number = versions[-1]["version"]
        versions[-1] = {**versions[-1], "stages": stages}
    else:
        extends = version_info.get("extends")
        if extends is not None and (start.extends is None
                                    or extends != start.extends.relative_to(workdir).as_posix()):
            return None  # made from another version than this lineage's last: not ours
        if extends is None and versions:  # the corpus left the lineage (ingest said why)
            lineage, versions = f"{lineage}-r{versions[-1]['version'] + 1}", []
        number = versions[-1]["version"] + 1 if versions else 1
        versions.append({
            "version": number, "documents_sha256": digest, "extends": extends,
            "counts": {k: version_info[k] for k in ("unchanged", "new", "changed", "retired")
                       if k in version_info} | {"documents": ingest.counts.get("kept")},
            "dedup": _pick(read_manifest(workdir / "dedup").counts,
                           ("kept", "duplicates_removed", "new_kept",
                            "new_duplicates_of_earlier")),
            "split": _pick(read_manifest(workdir / "split").counts,
                           ("docs_per_split", "quarantined", "quarantined_new",
                            "joined_earlier_units", "new_units")),
            "created_at": dt.datetime.now(dt.UTC).isoformat(), "stages": stages})
    root = workdir / VERSIONS_DIR / lineage
    final, staging = root / f"v{number:04d}", root / f"v{number:04d}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    _link_tree(workdir, stages, staging)
    shutil.rmtree(final, ignore_errors=True)  # a snapshot of this version, refreshed
    staging.rename(final)
    fault_point("version-switch")
    same = state is not None and state["lineage"] == lineage
    atomic_write_json(workdir / VERSIONS_DIR / LINEAGE_FILE, {  # the switch: the last write
        "lineage": lineage, "settings": start.settings,
        "lineages": int(state.get("lineages", 1)) + (0 if same else 1) if state else 1,
        "versions": versions})
    if not same or number != start.version:
        log.info("corpus versions: version %d of lineage %s is complete (%s)", number, lineage,
                 ", ".join(f"{k} {v}" for k, v in versions[-1]["counts"].items()))
    return number


def _pick(counts: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: counts[k] for k in keys if k in counts}
