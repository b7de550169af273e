"""The labelled documents every classification method sees: same ids, same first windows, same classes."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np

from selfsup_model.specials import PAD_ID, SEP_ID
from selfsup_model.splitting import SPLITS
from tasks.io import read_parquet

log = logging.getLogger("selfsup.labelled")

ENCODED_INPUTS = tuple(
    f"encode/{split}_{suffix}" for split in SPLITS
    for suffix in ("windows.npy", "doc_offsets.npy", "docs.parquet")
)


@dataclasses.dataclass(frozen=True)
class LabelledSplit:
    ids: np.ndarray  # (n,) str
    labels: np.ndarray  # (n,) str
    windows: np.ndarray  # (n, L) int32: each document's first (truncated) window

    def select(self, mask: np.ndarray) -> LabelledSplit:
        return LabelledSplit(self.ids[mask], self.labels[mask], self.windows[mask])


@dataclasses.dataclass(frozen=True)
class LabelledData:
    classes: list[str]  # sorted labels of the training split
    splits: dict[str, LabelledSplit]
    counts: dict[str, int]

    def y(self, split: str) -> np.ndarray:
        """Class index per document (-1 for a label the training split never saw)."""
        index = {c: i for i, c in enumerate(self.classes)}
        return np.array([index.get(label, -1) for label in self.splits[split].labels], dtype=np.int64)


def truncate_windows(windows: np.ndarray, max_len: int | None) -> np.ndarray:
    """First `max_len` positions of [CLS] ... [SEP] rows; a row cut short ends in [SEP] again."""
    if max_len is None or max_len >= windows.shape[1]:
        return windows
    out = np.array(windows[:, :max_len])  # (n, max_len)
    cut = out[:, -1] != PAD_ID
    out[cut, -1] = SEP_ID
    return out


def load_labelled(inputs: dict[str, Path], max_len: int | None = None) -> LabelledData | None:
    """Labelled documents per split, or None (with the reason logged) when there is nothing to classify."""
    splits, counts = {}, {}
    for split in SPLITS:
        docs = read_parquet(inputs[f"encode/{split}_docs.parquet"])
        offsets = np.load(inputs[f"encode/{split}_doc_offsets.npy"], allow_pickle=False)
        windows = np.load(inputs[f"encode/{split}_windows.npy"], mmap_mode="r", allow_pickle=False)
        has_label = docs["label"].notna().to_numpy()
        first = truncate_windows(np.asarray(windows[offsets[:-1][has_label]], dtype=np.int32), max_len)
        splits[split] = LabelledSplit(docs["id"].to_numpy(str)[has_label],
                                      docs["label"].to_numpy(str)[has_label], first)
        counts[f"{split}_labelled"] = int(has_label.sum())
        counts[f"{split}_unlabelled"] = int((~has_label).sum())
    classes = sorted(set(splits["train"].labels.tolist()))
    if len(classes) < 2:
        log.warning("classification skipped: the training split has %d label(s); need at least 2", len(classes))
        return None
    data = LabelledData(classes, splits, counts)
    for split in ("val", "test"):
        unseen = int((data.y(split) < 0).sum())
        counts[f"{split}_unseen_label_docs"] = unseen
        if unseen:
            log.warning("%d %s documents carry labels absent from training; they count as errors", unseen, split)
    counts["classes"] = len(classes)
    return data


def prediction_rows(method: str, fraction: float, split: LabelledSplit, predicted: np.ndarray,
                    classes: list[str]) -> list[tuple]:
    """(id, method, fraction, label, prediction) rows; `predicted` holds class indices or labels."""
    names = np.asarray(classes)[predicted] if np.issubdtype(np.asarray(predicted).dtype, np.integer) else predicted
    return [(i, method, float(fraction), lab, str(p)) for i, lab, p in zip(split.ids, split.labels, names)]


def result_key(method: str, fraction: float, metric: str) -> str:
    """An MLflow-safe metric name for one method at one label fraction."""
    return f"{method}/fraction_{fraction:g}/{metric}"
