"""Scoring new documents with a run's classifier: read them, judge them as ingest does,
predict, and write one predictions table.

Inputs: a folder of `.txt` files (any depth; id = path relative to the folder),
a CSV/JSONL/Parquet table read with ingest's column options, or lines (one
document per line, e.g. from stdin; id = `line-<n>`). Each record is judged by
ingest's own rules (`judge_record`: UTF-8, no NUL bytes, not empty after
normalisation, at most `ingest.max_chars`), except that no minimum length
applies: a short text can still be classified. A record is either scored or
listed in `rejects` with its reason; ``read == scored + rejected`` always.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from selfsup_model.artifacts import atomic_write_parquet, atomic_write_text
from selfsup_model.config import IngestConfig
from selfsup_model.corpus.ingest import TABLE_SUFFIXES, RawRecord, iter_table, judge_record
from selfsup_model.errors import UserError

if TYPE_CHECKING:  # the classifier (and keras) load only when something is scored
    from selfsup_model.serving.inference import ClassifierBundle

OUTPUT_SUFFIXES = (".parquet", ".jsonl", ".csv")
REJECT_COLUMNS = ["source", "id", "reason", "detail"]


@dataclasses.dataclass(frozen=True)
class ScoringInput:
    documents: pd.DataFrame  # id, text (normalised), source
    rejects: pd.DataFrame  # REJECT_COLUMNS
    read: int


def iter_text_files(root: Path) -> Iterator[RawRecord]:
    """Every file under `root`, sorted; anything but `*.txt` is a record rejected as not_txt."""
    files = sorted(p for p in root.rglob("*") if not p.is_dir())
    if not files:
        raise UserError(f"input folder {str(root)!r} holds no files")
    for path in files:
        rel = path.relative_to(root).as_posix()
        if path.suffix.lower() != ".txt":
            yield RawRecord(rel, rel, None, error="not_txt", detail="only .txt files are read")
            continue
        try:
            data = path.read_bytes()
        except OSError as exc:
            yield RawRecord(rel, rel, None, error="unreadable", detail=str(exc.strerror))
            continue
        yield RawRecord(rel, rel, data)


def iter_lines(lines: Iterable[bytes]) -> Iterator[RawRecord]:
    """One document per line (raw bytes, so invalid UTF-8 is judged per line)."""
    for n, line in enumerate(lines, start=1):
        yield RawRecord(f"line {n}", f"line-{n}", line.rstrip(b"\r\n"))


def read_inputs(source: str, cfg: IngestConfig, lines: Iterable[bytes] | None = None
                ) -> ScoringInput:
    """Judge every record of `source` (a folder, a table, or "-" for `lines`)."""
    if source == "-":
        if lines is None:
            raise ValueError("source '-' needs the lines to read")
        records = iter_lines(lines)
    else:
        path = Path(source)
        if path.is_dir():
            records = iter_text_files(path)
        elif path.suffix.lower() in TABLE_SUFFIXES:
            records = iter_table(path, cfg)  # its own clear errors: missing, unreadable, column
        elif not path.exists():
            raise UserError(f"input {source!r} does not exist (give a folder of .txt files, a "
                            ".csv/.jsonl/.parquet table, or - for lines on stdin)")
        else:
            raise UserError(f"cannot read {source!r}: give a folder of .txt files, a table ending "
                            f"in {', '.join(sorted(TABLE_SUFFIXES))}, or - for stdin")
    return judge_inputs(records, cfg)


def judge_inputs(records: Iterable[RawRecord], cfg: IngestConfig) -> ScoringInput:
    cfg = cfg.model_copy(update={"min_chars": 1})
    docs, rejects, seen, read = [], [], set(), 0
    for rec in records:
        read += 1
        text, reason, detail = judge_record(rec, cfg)
        if reason is None and rec.id in seen:
            reason, detail = "duplicate_id", f"id {rec.id!r} already used by an earlier document"
        if reason is not None:
            rejects.append((rec.source, rec.id, reason, detail))
            continue
        seen.add(rec.id)
        docs.append((rec.id, text, rec.source))
    return ScoringInput(pd.DataFrame(docs, columns=["id", "text", "source"]),
                        pd.DataFrame(rejects, columns=REJECT_COLUMNS), read)


def score(bundle: ClassifierBundle, inputs: ScoringInput, batch_size: int = 256,
          progress: Callable[[int, int], None] | None = None
          ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(predictions, rejects): one row per scored document with its id, the predicted label,
    its probability and one `p_<class>` column per class in class order; documents with no
    tokens join the rejects as no_tokens."""
    docs = inputs.documents
    probs, kept = bundle.predict_proba(docs["text"].tolist(), batch_size, progress)
    frame = prediction_frame(probs, bundle.classes)
    frame.insert(0, "id", docs["id"].to_numpy()[kept])
    empty = np.setdiff1d(np.arange(len(docs)), kept)
    no_tokens = pd.DataFrame({"source": docs["source"].to_numpy()[empty],
                              "id": docs["id"].to_numpy()[empty], "reason": "no_tokens",
                              "detail": "the tokenizer produced no tokens"},
                             columns=REJECT_COLUMNS)
    rejects = pd.concat([inputs.rejects, no_tokens], ignore_index=True) if len(empty) \
        else inputs.rejects
    return frame, rejects


def prediction_frame(probs: np.ndarray, classes: list[str]) -> pd.DataFrame:
    """label, probability and one p_<class> column per class, from (n, C) probabilities."""
    best = probs.argmax(axis=1)  # (n,)
    frame = pd.DataFrame({"label": np.asarray(classes)[best],
                          "probability": probs[np.arange(len(best)), best]})
    for k, name in enumerate(classes):
        frame[f"p_{name}"] = probs[:, k]
    return frame


def check_output_path(path: str) -> Path:
    out = Path(path)
    if out.suffix.lower() not in OUTPUT_SUFFIXES:
        raise UserError(f"--out {path!r}: the file type comes from its extension; use one of "
                        f"{', '.join(OUTPUT_SUFFIXES)}")
    if not out.parent.is_dir():
        raise UserError(f"--out {path!r}: folder {str(out.parent)!r} does not exist")
    return out


def write_predictions(frame: pd.DataFrame, path: str | Path) -> Path:
    """Atomically write the predictions as Parquet, JSONL or CSV (by the extension)."""
    path = check_output_path(str(path))
    kind = path.suffix.lower()
    if kind == ".parquet":
        return atomic_write_parquet(path, frame)
    if kind == ".jsonl":
        return atomic_write_text(path, frame.to_json(orient="records", lines=True,
                                                     force_ascii=False))
    return atomic_write_text(path, frame.to_csv(index=False))


def format_table(frame: pd.DataFrame, limit: int = 50) -> str:
    """A terminal table of the first `limit` predictions (id, label, probability)."""
    shown = frame[["id", "label", "probability"]].head(limit)
    text = shown.to_string(index=False, float_format=lambda v: f"{v:.3f}")
    if len(frame) > limit:
        text += f"\n... and {len(frame) - limit} more (write them all with --out FILE)"
    return text
