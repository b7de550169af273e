"""Corpus ingest: read a corpus, normalise text, keep or reject each document with a reason.

Three corpus kinds (see DESIGN.md "Corpora"):
- ``folder``: one sub-folder per class of ``.txt`` files; label = folder name.
- ``table``: CSV, JSONL or Parquet with a text column and optional id/label/group.
- ``pydocs``: the embedded default (see `selfsup_model.corpus.pydocs`).

Every record read ends up in exactly one of `documents` or `rejects`, so
``read == kept + sum(rejected by reason)`` always holds.

Judging (reading a folder's files, decoding, normalising, hashing) is per-document
work cut into shards (`judge_shard`) that the run's executor places; the driver
lists the records and keeps the first document of every id and every text, in
record order, so the result never depends on the shard count.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
import tempfile
import unicodedata
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from selfsup_model.artifacts import sha256_json
from selfsup_model.config import CorpusFormat, IngestConfig
from selfsup_model.corpus.sharding import FanOut, InProcess, Progress, shard_bounds
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
_SURROGATE = re.compile("[\ud800-\udfff]")


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


def list_folder(root: Path) -> list[RawRecord]:
    """Records of a folder-per-class corpus, in sorted path order, without their data: the
    judging shards read the files (`FileData`). A file outside a class folder is a record
    with its reject reason already set."""
    if not root.is_dir():
        raise CorpusError(f"corpus folder {str(root)!r} does not exist or is not a folder")
    # Not only regular files: a dangling link or special file named *.txt is reported, not skipped.
    files = sorted(p for p in root.rglob("*.txt") if not p.is_dir())
    if not files:
        raise CorpusError(
            f"corpus folder {str(root)!r} holds no .txt files (expected <folder>/<label>/*.txt)"
        )
    records = []
    for path in files:
        rel = path.relative_to(root)
        name = rel.as_posix()
        if len(rel.parts) < 2:
            records.append(RawRecord(name, name, None, error="outside_class_folder",
                                     detail="files must sit in <folder>/<label>/"))
        else:
            records.append(RawRecord(name, name, None, label=rel.parts[0]))
    return records


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


def _cells(frame: pd.DataFrame, column: str) -> list[str | None]:
    """A column's cells as `_cell` reads them (all None if there is no such column); strings,
    nearly every cell, take the short path."""
    if column not in frame.columns:
        return [None] * len(frame)
    return [(v.strip() or None) if type(v) is str else _cell(v) for v in frame[column].tolist()]


def iter_table(path: Path, cfg: IngestConfig) -> Iterator[RawRecord]:
    frame = read_table(path, cfg)
    ids, labels, groups = (_cells(frame, c)
                           for c in (cfg.id_column, cfg.label_column, cfg.group_column))
    for i, text in enumerate(frame[cfg.text_column].tolist()):
        data = text if isinstance(text, str) else None
        yield RawRecord(f"{path.name}:{i}", ids[i] or f"row-{i}", data, labels[i], groups[i])


def iter_pydocs(cfg: IngestConfig) -> Iterator[RawRecord]:
    from selfsup_model.corpus.pydocs import harvest

    frame = harvest(
        cfg.pydocs_libraries, workers=cfg.workers, max_per_library=cfg.pydocs_max_per_library
    )
    for doc_id, text, label, group in frame.itertuples(index=False, name=None):
        yield RawRecord(group, doc_id, text, label, group)


def judge_record(rec: RawRecord, cfg: IngestConfig) -> tuple[str | None, str | None, str]:
    """(normalised text or None, reject reason or None, detail)."""
    if rec.error:
        return None, rec.error, rec.detail
    return judge_data(rec.data, cfg)


def judge_data(data: bytes | str | None, cfg: IngestConfig) -> tuple[str | None, str | None, str]:
    """(normalised text or None, reject reason or None, detail) of one record's data."""
    if data is None:
        return None, "empty", "missing text"
    if isinstance(data, bytes):
        if b"\x00" in data[:8192]:
            return None, "binary", "NUL byte in the first 8 KiB"
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            return None, "not_utf8", f"invalid UTF-8 at byte {exc.start}"
    else:
        found = _SURROGATE.search(data)
        if found is not None:  # escaped undecodable bytes (CSV), or a lone surrogate (JSON)
            bad = ord(found.group())
            return None, "not_utf8", ("invalid UTF-8 bytes" if bad >= 0xDC80
                                      else f"lone surrogate U+{bad:04X}")
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


# Where a judging shard finds its records' data. Each is small to ship: file names, or a
# row group of a file the driver staged, or (in-process only) the values themselves.

@dataclasses.dataclass(frozen=True)
class FileData:
    """A folder corpus' files, read by the shard; None for a record judged at listing."""

    root: str
    names: tuple[str | None, ...]

    def load(self) -> Iterator[bytes | str | None | tuple[str, str]]:
        for name in self.names:
            if name is None:
                yield ("listed", "")  # the driver keeps the listing's reason
                continue
            try:
                yield (Path(self.root) / name).read_bytes()
            except OSError as exc:
                yield ("unreadable", str(exc.strerror))


@dataclasses.dataclass(frozen=True)
class StagedData:
    """Row group `group` of a parquet file the driver wrote (`stage_data`): texts as UTF-8
    with surrogates passed through, so every str comes back exactly as it was."""

    path: str
    group: int

    def load(self) -> Iterator[str | None]:
        import pyarrow.parquet as pq

        column = pq.ParquetFile(self.path).read_row_group(self.group, columns=["data"])
        for value in column.column(0).to_pylist():
            yield None if value is None else value.decode("utf-8", "surrogatepass")


@dataclasses.dataclass(frozen=True)
class HeldData:
    """The data values themselves (for shards that run in this process)."""

    values: tuple[bytes | str | None, ...]

    def load(self) -> Iterator[bytes | str | None]:
        return iter(self.values)


def stage_data(values: list[bytes | str | None], bounds: list[tuple[int, int]],
               path: Path) -> list[StagedData]:
    """Write str/None values to `path`, one row group per shard, for shards elsewhere."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with pq.ParquetWriter(path, pa.schema([("data", pa.binary())])) as writer:
        for lo, hi in bounds:
            chunk = [None if v is None else v.encode("utf-8", "surrogatepass")
                     for v in values[lo:hi]]
            writer.write_table(pa.table({"data": pa.array(chunk, pa.binary())}),
                               row_group_size=max(hi - lo, 1))
    return [StagedData(str(path), i) for i in range(len(bounds))]


@dataclasses.dataclass(frozen=True)
class JudgedShard:
    """One shard's verdicts in record order. The normalised text of each record (None when
    rejected) is in `texts`, or in the parquet file `spill` when the shard ran elsewhere
    (texts never travel through a scheduler)."""

    reasons: list[str | None]
    details: list[str]
    digests: np.ndarray  # (n,) V16: blake2b-128 of each kept text (zeros when rejected)
    texts: list[str | None] | None
    spill: str | None

    def texts_in_order(self) -> list[str | None]:
        """One normalised text or None per record, in record order."""
        if self.texts is not None:
            return self.texts
        import pyarrow.parquet as pq

        return pq.read_table(self.spill).column("text").to_pylist()


def judge_shard(data: FileData | StagedData | HeldData, cfg: IngestConfig,
                spill: str | None = None, known: frozenset[str] = frozenset()) -> JudgedShard:
    """Read, decode, normalise and hash one shard's records (a shard task).

    A text in `known` (kept by the last version of a grown corpus, under the same settings)
    is kept as it is without judging it again: judging a kept text gives it back unchanged
    (normalisation is idempotent; tests/corpus/test_ingest.py)."""
    texts, reasons, details, digests = [], [], [], []
    for value in data.load():
        if isinstance(value, tuple):
            text, reason, detail = None, *value
        elif isinstance(value, str) and value in known:
            text, reason, detail = value, None, ""
        else:
            text, reason, detail = judge_data(value, cfg)
        texts.append(text)
        reasons.append(reason)
        details.append(detail)
        digests.append(hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()
                       if text is not None else bytes(16))
    digest_array = np.frombuffer(b"".join(digests), dtype="V16")
    if spill is None:
        return JudgedShard(reasons, details, digest_array, texts, None)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), spill)
    return JudgedShard(reasons, details, digest_array, None, spill)


def ingest_records(
    records: Iterable[RawRecord], cfg: IngestConfig, corpus_name: str, *,
    root: Path | None = None, fan_out: FanOut | None = None, scratch: Path | None = None,
    progress: Progress | None = None, first_ids: Sequence[str] = (),
    known_texts: Iterable[str] = (),
) -> IngestResult:
    """Judge every record; the first document with a given id (or identical text) wins.

    `root`: the records name files under this folder, read by the judging shards (their
    `data` is unused). `fan_out` places the shards (default: here, as one shard); when they
    run elsewhere, the driver stages table/pydocs texts and the shards spill their kept
    texts to files under `scratch` (a path every worker can read; default: a temporary
    folder), which are removed before returning.

    Byte-identical copies (after normalisation) are rejected here as duplicate_text,
    naming the kept document; copies that differ only in case or punctuation, and
    near-duplicates, are the dedup stage's job.

    `first_ids` (a grown corpus: the last version's documents, in its order) are placed
    first, so an earlier document keeps its id and text against any newcomer. `known_texts`
    (that version's kept texts) are not judged again where the shards run here (`judge_shard`).
    """
    records = list(records)
    fan_out = fan_out or InProcess()
    bounds = shard_bounds(len(records), fan_out.shards)
    with tempfile.TemporaryDirectory(prefix="selfsup-ingest-", dir=scratch) as tmp:
        spill = None if fan_out.in_process else Path(tmp)
        if root is not None:
            parts = [FileData(str(root), tuple(None if r.error else r.source
                                               for r in records[lo:hi])) for lo, hi in bounds]
        elif spill is None:
            parts = [HeldData(tuple(r.data for r in records[lo:hi])) for lo, hi in bounds]
        else:
            parts = stage_data([r.data for r in records], bounds, spill / "data.parquet")
        known = frozenset(known_texts) if fan_out.in_process else frozenset()
        items = [{"data": part, "cfg": cfg,
                  "spill": None if spill is None else str(spill / f"kept-{i:05d}.parquet"),
                  **({"known": known} if known else {})}
                 for i, part in enumerate(parts)]
        judged = fan_out.run("ingest", lambda mapper: mapper("ingest-judge", judge_shard, items,
                                                             progress))
        texts = [t for shard in judged for t in shard.texts_in_order()]
    reasons = [r for shard in judged for r in shard.reasons]
    details = [d for shard in judged for d in shard.details]
    digests = np.concatenate([s.digests for s in judged]) if judged else np.zeros(0, "V16")
    if len(first_ids):
        rank = pd.Index(pd.Series(list(first_ids), dtype=object)).get_indexer(
            pd.Series([r.id for r in records], dtype=object))
        order = np.lexsort((np.arange(len(records)), np.where(rank >= 0, rank, len(first_ids))))
        records = [records[i] for i in order]
        texts, reasons, details = ([seq[i] for i in order] for seq in (texts, reasons, details))
        digests = digests[order]
    return _first_occurrences(records, texts, reasons, details, digests, corpus_name)


def _first_occurrences(records: list[RawRecord], texts: list[str | None],
                       reasons: list[str | None], details: list[str], digests: np.ndarray,
                       corpus_name: str) -> IngestResult:
    """Documents and rejects from judged records, in record order: a record's listing error
    wins over its judgement, then the first use of an id or a text."""
    docs, rejects = [], []
    seen_ids: set[str] = set()
    seen_text: dict[bytes, str] = {}
    for rec, text, reason, detail, digest in zip(records, texts, reasons, details,
                                                 digests.tolist(), strict=True):
        if rec.error:
            reason, detail = rec.error, rec.detail
        elif reason is None and rec.id in seen_ids:
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
    read = len(records)
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


def ingest_corpus(corpus: str, fmt: CorpusFormat, cfg: IngestConfig, *,
                  fan_out: FanOut | None = None, scratch: Path | None = None,
                  progress: Progress | None = None, first_ids: Sequence[str] = (),
                  known_texts: Iterable[str] = ()) -> IngestResult:
    """Read and judge a whole corpus (folder, table or 'pydocs'); see `ingest_records`."""
    kind = detect_format(corpus, fmt)
    root = None
    if kind == "pydocs":
        records = iter_pydocs(cfg)
    elif kind == "folder":
        root = Path(corpus)
        records = list_folder(root)
    else:
        records = iter_table(Path(corpus), cfg)
    return ingest_records(records, cfg, corpus, root=root, fan_out=fan_out, scratch=scratch,
                          progress=progress, first_ids=first_ids, known_texts=known_texts)


def corpus_fingerprint(corpus: str, fmt: CorpusFormat, cfg: IngestConfig) -> dict[str, object]:
    """What identifies the corpus' current content cheaply.

    File sizes and mtimes for a folder or table, library versions for pydocs."""
    kind = detect_format(corpus, fmt)
    if kind == "pydocs":
        from selfsup_model.corpus.pydocs import library_versions

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
