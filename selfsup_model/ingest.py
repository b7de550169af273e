"""Corpus ingest: read a corpus, normalise text, keep or reject each document with a reason.

Three corpus kinds (see DESIGN.md "Corpora"):
- ``folder``: one sub-folder per class of ``.txt`` files; label = folder name.
- ``table``: CSV, JSONL or Parquet with a text column and optional id/label/group.
- ``pydocs``: the embedded default (see `selfsup_model.pydocs`).

Every record read ends up in exactly one of `documents` or `rejects`, so
``read == kept + sum(rejected by reason)`` always holds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import pandas as pd

from selfsup_model.artifacts import sha256_json
from selfsup_model.config import CorpusFormat, IngestConfig
from selfsup_model.errors import CorpusError

TABLE_SUFFIXES = {
    ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".pq": "parquet",
}
REJECT_REASONS = (
    "not_utf8", "binary", "empty", "too_short", "too_long", "duplicate_id", "duplicate_text",
    "unreadable", "outside_class_folder",
)
DOC_COLUMNS = ["id", "text", "label", "group", "source"]
REJECT_COLUMNS = ["source", "id", "reason", "detail"]

_HSPACE = re.compile(r"[^\S\n]+")
_BLANK_RUNS = re.compile(r"\n{3,}")


@dataclasses.dataclass(frozen=True)
class RawRecord:
    """One document as read, before normalisation. `data` is bytes when decoding is still to do."""

    source: str
    id: str
    data: bytes | str | None
    label: str | None = None
    group: str | None = None
    error: str | None = None  # a reason already known at read time (e.g. unreadable)
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class IngestResult:
    documents: pd.DataFrame
    rejects: pd.DataFrame
    counts: dict[str, int]


def normalize_document(text: str) -> str:
    """NFC, unified newlines, runs of spaces/tabs collapsed, at most one blank line, stripped."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(_HSPACE.sub(" ", line).strip() for line in text.split("\n"))
    return _BLANK_RUNS.sub("\n\n", text).strip()


def detect_format(path: str | os.PathLike, fmt: CorpusFormat = "auto") -> CorpusFormat:
    if fmt != "auto":
        return fmt
    if str(path) == "pydocs":
        return "pydocs"
    p = Path(path)
    if p.is_dir():
        return "folder"
    if p.suffix.lower() in TABLE_SUFFIXES:
        return "table"
    if not p.exists():
        raise CorpusError(
            f"corpus path {str(path)!r} does not exist "
            "(use a folder, a .csv/.jsonl/.parquet file, or 'pydocs')"
        )
    raise CorpusError(
        f"cannot tell the format of {str(path)!r}; pass --format folder|table|pydocs "
        f"(tables must end in {', '.join(sorted(TABLE_SUFFIXES))})"
    )


def iter_folder(root: Path) -> Iterator[RawRecord]:
    """Records of a folder-per-class corpus, in sorted path order."""
    if not root.is_dir():
        raise CorpusError(f"corpus folder {str(root)!r} does not exist or is not a folder")
    # Not only regular files: a dangling link or special file named *.txt is reported, not skipped.
    files = sorted(p for p in root.rglob("*.txt") if not p.is_dir())
    if not files:
        raise CorpusError(
            f"corpus folder {str(root)!r} holds no .txt files (expected <folder>/<label>/*.txt)"
        )
    for path in files:
        rel = path.relative_to(root).as_posix()
        if len(path.relative_to(root).parts) < 2:
            yield RawRecord(rel, rel, None, error="outside_class_folder",
                            detail="files must sit in <folder>/<label>/")
            continue
        label = path.relative_to(root).parts[0]
        try:
            data = path.read_bytes()
        except OSError as exc:
            yield RawRecord(rel, rel, None, label=label, error="unreadable",
                            detail=str(exc.strerror))
            continue
        yield RawRecord(rel, rel, data, label=label, group=None)


def read_table(path: Path, cfg: IngestConfig) -> pd.DataFrame:
    kind = TABLE_SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise CorpusError(
            f"table {str(path)!r} must end in one of {', '.join(sorted(TABLE_SUFFIXES))}"
        )
    try:
        if kind == "csv":
            # surrogateescape keeps undecodable bytes so each bad row is rejected on its own
            frame = pd.read_csv(path, dtype=str, keep_default_na=False, na_values=[""],
                                encoding="utf-8", encoding_errors="surrogateescape")
        elif kind == "jsonl":
            frame = pd.read_json(path, lines=True, dtype=False, encoding="utf-8",
                                 encoding_errors="surrogateescape")
        else:
            frame = pd.read_parquet(path)
    except FileNotFoundError:
        raise CorpusError(f"corpus table {str(path)!r} does not exist") from None
    except PermissionError:
        raise CorpusError(
            f"corpus table {str(path)!r} is not readable (permission denied)"
        ) from None
    except (ValueError, OSError, UnicodeError) as exc:
        raise CorpusError(
            f"cannot read corpus table {str(path)!r} as {kind}: {str(exc).splitlines()[0]}"
        ) from None
    if cfg.text_column not in frame.columns:
        raise CorpusError(
            f"corpus table {str(path)!r} has no {cfg.text_column!r} column (columns: "
            f"{', '.join(map(str, frame.columns))}); set ingest.text_column"
        )
    return frame


def _cell(value: object) -> str | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    text = str(value).strip()
    return text or None


def iter_table(path: Path, cfg: IngestConfig) -> Iterator[RawRecord]:
    frame = read_table(path, cfg)
    cols = {c: (frame[c].tolist() if c in frame.columns else [None] * len(frame))
            for c in (cfg.id_column, cfg.label_column, cfg.group_column)}
    for i, text in enumerate(frame[cfg.text_column].tolist()):
        doc_id = _cell(cols[cfg.id_column][i]) or f"row-{i}"
        data = text if isinstance(text, str) else None
        yield RawRecord(f"{path.name}:{i}", doc_id, data, _cell(cols[cfg.label_column][i]),
                        _cell(cols[cfg.group_column][i]))


def iter_pydocs(cfg: IngestConfig) -> Iterator[RawRecord]:
    from selfsup_model.pydocs import harvest

    frame = harvest(
        cfg.pydocs_libraries, workers=cfg.workers, max_per_library=cfg.pydocs_max_per_library
    )
    for doc_id, text, label, group in frame.itertuples(index=False, name=None):
        yield RawRecord(group, doc_id, text, label, group)


def judge_record(rec: RawRecord, cfg: IngestConfig) -> tuple[str | None, str | None, str]:
    """(normalised text or None, reject reason or None, detail)."""
    if rec.error:
        return None, rec.error, rec.detail
    data = rec.data
    if data is None:
        return None, "empty", "missing text"
    if isinstance(data, bytes):
        if b"\x00" in data[:8192]:
            return None, "binary", "NUL byte in the first 8 KiB"
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            return None, "not_utf8", f"invalid UTF-8 at byte {exc.start}"
    elif any(0xDC80 <= ord(c) <= 0xDCFF for c in data if ord(c) >= 0xD800):
        return None, "not_utf8", "invalid UTF-8 bytes"
    if "\x00" in data:
        return None, "binary", "NUL character"
    if len(data) > cfg.max_chars * 4:  # cheap guard before normalising a huge string
        return None, "too_long", f"{len(data)} characters > ingest.max_chars={cfg.max_chars}"
    text = normalize_document(data)
    if not text:
        return None, "empty", "empty or whitespace only"
    if len(text) < cfg.min_chars:
        return None, "too_short", f"{len(text)} characters < ingest.min_chars={cfg.min_chars}"
    if len(text) > cfg.max_chars:
        return None, "too_long", f"{len(text)} characters > ingest.max_chars={cfg.max_chars}"
    return text, None, ""


def ingest_records(
    records: Iterable[RawRecord], cfg: IngestConfig, corpus_name: str
) -> IngestResult:
    """Judge every record; the first document with a given id (or identical text) wins.

    Byte-identical copies (after normalisation) are rejected here as duplicate_text,
    naming the kept document; copies that differ only in case or punctuation, and
    near-duplicates, are the dedup stage's job.
    """
    docs, rejects = [], []
    seen_ids: set[str] = set()
    seen_text: dict[bytes, str] = {}
    read = 0
    for rec in records:
        read += 1
        text, reason, detail = judge_record(rec, cfg)
        digest = hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest() if text else b""
        if reason is None and rec.id in seen_ids:
            reason, detail = "duplicate_id", f"id {rec.id!r} already used by an earlier document"
        elif reason is None and digest in seen_text:
            reason, detail = "duplicate_text", f"same text as kept document {seen_text[digest]!r}"
        if reason is not None:
            rejects.append((rec.source, rec.id, reason, detail))
            continue
        seen_ids.add(rec.id)
        seen_text[digest] = rec.id
        docs.append((rec.id, text, rec.label, rec.group, rec.source))
    documents = pd.DataFrame(docs, columns=DOC_COLUMNS).astype(
        {"id": "string", "text": "string", "label": "string", "group": "string",
         "source": "string"})
    reject_frame = pd.DataFrame(rejects, columns=REJECT_COLUMNS).astype("string")
    by_reason = Counter(reject_frame["reason"].tolist())
    counts = {"read": read, "kept": len(documents), "rejected": len(reject_frame)}
    counts.update({f"rejected_{r}": by_reason.get(r, 0) for r in REJECT_REASONS})
    counts["labelled"] = int(documents["label"].notna().sum())
    if counts["kept"] == 0:
        summary = ", ".join(f"{r}={n}" for r, n in sorted(by_reason.items())) or "no records"
        raise CorpusError(
            f"corpus {corpus_name!r} yielded no usable documents "
            f"({read} read; rejected: {summary})"
        )
    assert counts["read"] == counts["kept"] + sum(by_reason.values())
    return IngestResult(documents, reject_frame, counts)


def check_corpus(corpus: str, fmt: CorpusFormat, cfg: IngestConfig) -> CorpusFormat:
    """Fail fast, before any work, on a corpus that cannot be read: a missing path, a folder
    without .txt files, a table without the text column (read from its header only)."""
    kind = detect_format(corpus, fmt)
    path = Path(corpus)
    if kind == "folder":
        if not path.is_dir():
            raise CorpusError(f"corpus folder {corpus!r} does not exist or is not a folder")
        if next((p for p in path.rglob("*.txt") if not p.is_dir()), None) is None:
            raise CorpusError(f"corpus folder {corpus!r} holds no .txt files "
                              "(expected <folder>/<label>/*.txt)")
    elif kind == "table":
        columns = _table_columns(path)
        if cfg.text_column not in columns:
            raise CorpusError(f"corpus table {corpus!r} has no {cfg.text_column!r} column "
                              f"(columns: {', '.join(map(str, columns))}); set ingest.text_column")
    return kind


def _table_columns(path: Path) -> list[str]:
    """Column names from a table's header (CSV), first record (JSONL) or schema (Parquet)."""
    kind = TABLE_SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise CorpusError(f"table {str(path)!r} must end in one of "
                          f"{', '.join(sorted(TABLE_SUFFIXES))}")
    if not path.is_file():
        raise CorpusError(f"corpus table {str(path)!r} does not exist")
    try:
        if kind == "csv":
            return list(pd.read_csv(path, nrows=0, encoding="utf-8",
                                    encoding_errors="surrogateescape").columns)
        if kind == "jsonl":
            first = pd.read_json(path, lines=True, nrows=1, dtype=False,
                                 encoding_errors="surrogateescape")
            return list(first.columns)
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    except (ValueError, OSError, UnicodeError) as exc:
        raise CorpusError(f"cannot read corpus table {str(path)!r} as {kind}: "
                          f"{str(exc).splitlines()[0]}") from None


def ingest_corpus(corpus: str, fmt: CorpusFormat, cfg: IngestConfig) -> IngestResult:
    """Read and judge a whole corpus (folder, table or 'pydocs')."""
    kind = detect_format(corpus, fmt)
    if kind == "pydocs":
        records = iter_pydocs(cfg)
    elif kind == "folder":
        records = iter_folder(Path(corpus))
    else:
        records = iter_table(Path(corpus), cfg)
    return ingest_records(records, cfg, corpus)


def corpus_fingerprint(corpus: str, fmt: CorpusFormat, cfg: IngestConfig) -> dict[str, object]:
    """What identifies the corpus' current content cheaply.

    File sizes and mtimes for a folder or table, library versions for pydocs."""
    kind = detect_format(corpus, fmt)
    if kind == "pydocs":
        from selfsup_model.pydocs import library_versions

        return {"kind": kind, "libraries": library_versions(cfg.pydocs_libraries)}
    root = Path(corpus)
    paths = sorted(root.rglob("*")) if root.is_dir() else [root]
    files = [
        (p.relative_to(root).as_posix() if root.is_dir() else p.name, p.stat().st_size,
         p.stat().st_mtime_ns)
        for p in paths if p.is_file()
    ]
    return {"kind": kind, "path": str(root.resolve()), "files": len(files),
            "listing_sha256": sha256_json(files)}
