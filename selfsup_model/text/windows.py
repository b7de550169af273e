"""Operations on framed token windows, in numpy only (no tokenizer needed).

A window is one row of `encode`'s output: `[CLS] content [SEP]` right-padded
with [PAD]. Pretraining, evaluation and classification all start from such
rows, so the ways of reading them live here once: the causal shift, a document's
first window cut to a classifier's length, all of a document's windows, and the
mean of per-window outputs over each document.
"""

from __future__ import annotations

import numpy as np

from selfsup_model.text.specials import BOS_ID, CLS_ID, EOS_ID, PAD_ID, SEP_ID


def causal_framing(windows: np.ndarray) -> np.ndarray:
    """[CLS] ... [SEP] rows -> [BOS] ... [EOS] rows, the framing a causal encoder is trained on."""
    x = np.asarray(windows, dtype=np.int32)
    return np.where(x == CLS_ID, BOS_ID, np.where(x == SEP_ID, EOS_ID, x)).astype(np.int32)


def frame_windows(windows: np.ndarray, causal: bool) -> np.ndarray:
    """[CLS] ... [SEP] windows as int32, reframed [BOS] ... [EOS] when `causal` (a classifier on
    a causal encoder reads its windows as that encoder was pretrained on them)."""
    windows = np.asarray(windows, dtype=np.int32)
    return causal_framing(windows) if causal else windows


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax of (n, C) logits (per-window class probabilities), in float64 then
    float32."""
    z = np.asarray(logits, np.float64)
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    return (z / z.sum(axis=-1, keepdims=True)).astype(np.float32)


def causal_lm_batch(windows: np.ndarray) -> dict[str, np.ndarray]:
    """Next-token inputs/targets from framed windows (B, L): shifted here, exactly once.

    The framing becomes [BOS] ... [EOS]; `input_ids` = x[:, :-1] and
    `target_ids` = x[:, 1:], both (B, L-1), so position t predicts token t+1.
    `loss_weights` is 1.0 where the target is a real token (content or [EOS])
    and 0.0 where it is [PAD] or the [BOS] of the next window packed into the row
    (nothing predicts where another document starts). Consumers must NOT shift again.
    """
    x = np.asarray(windows, dtype=np.int32)
    if x.ndim != 2 or x.shape[1] < 2:
        raise ValueError(f"windows must be (batch, length >= 2), got shape {x.shape}")
    x = causal_framing(x)
    targets = x[:, 1:]
    return {
        "input_ids": np.ascontiguousarray(x[:, :-1]),  # (B, L-1)
        "target_ids": np.ascontiguousarray(targets),  # (B, L-1)
        "loss_weights": ((targets != PAD_ID) & (targets != BOS_ID)).astype(np.float32),
    }


def truncate_windows(windows: np.ndarray, max_len: int | None) -> np.ndarray:
    """First `max_len` positions of [CLS] ... [SEP] rows; a row cut short ends in [SEP] again."""
    if max_len is None or max_len >= windows.shape[1]:
        return windows
    out = np.array(windows[:, :max_len])  # (n, max_len)
    cut = out[:, -1] != PAD_ID
    out[cut, -1] = SEP_ID
    return out


def first_windows(windows: np.ndarray, doc_offsets: np.ndarray, rows: np.ndarray | None = None,
                  max_len: int | None = None) -> np.ndarray:
    """(n, max_len) int32: each document's first window, cut to `max_len` tokens.

    Document i owns windows doc_offsets[i]:doc_offsets[i + 1]; `rows` selects
    documents (a boolean mask or indices), all of them by default. This is what
    every classification method reads of a document.
    """
    starts = np.asarray(doc_offsets)[:-1]
    if rows is not None:
        starts = starts[rows]
    return truncate_windows(np.asarray(windows[starts], dtype=np.int32), max_len)


def document_windows(windows: np.ndarray, doc_offsets: np.ndarray, docs: np.ndarray,
                     max_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Every window of documents `docs` (indices), cut to `max_len` tokens, in the order given:
    (windows (m, max_len) int32, position in `docs` of each row's document (m,) int64).

    Document i owns windows doc_offsets[i]:doc_offsets[i + 1]. Only the rows asked for are
    read, so `windows` may be a memory map of a whole split.
    """
    docs = np.asarray(docs, dtype=np.int64)
    offsets = np.asarray(doc_offsets, dtype=np.int64)
    starts, counts = offsets[docs], offsets[docs + 1] - offsets[docs]
    owner = np.repeat(np.arange(len(docs), dtype=np.int64), counts)
    # row k of document j is starts[j] + k: the running index minus where j's rows begin
    begin = np.cumsum(counts) - counts
    rows = starts[owner] + np.arange(len(owner), dtype=np.int64) - begin[owner]
    return truncate_windows(np.asarray(windows[rows], dtype=np.int32), max_len), owner


def mean_over_documents(values: np.ndarray, owner: np.ndarray, n_docs: int) -> np.ndarray:
    """(n_docs, ...) mean of the rows of `values` (m, ...) each document owns; `owner` (m,)
    gives each row's document, in non-decreasing order (as `document_windows` returns them for
    documents in order), and every document owns at least one row."""
    values, owner = np.asarray(values), np.asarray(owner, dtype=np.int64)
    if len(owner) != len(values) or (len(owner) and np.any(np.diff(owner) < 0)):
        raise ValueError("owner must give each row's document, in non-decreasing order")
    starts = np.searchsorted(owner, np.arange(n_docs))
    counts = np.diff(np.append(starts, len(owner)))
    if n_docs and (counts.min() == 0 or owner[-1] >= n_docs):
        raise ValueError(f"every one of {n_docs} documents must own at least one row, "
                         "and no row another document")
    if n_docs == 0:
        return np.zeros((0, *values.shape[1:]), values.dtype)
    sums = np.add.reduceat(values.astype(np.float64, copy=False), starts, axis=0)
    shape = (n_docs,) + (1,) * (values.ndim - 1)
    return (sums / counts.reshape(shape)).astype(values.dtype, copy=False)


def documents_owning(owner: np.ndarray | None) -> int | None:
    """How many documents `owner` (each row's document, as for `mean_over_documents`) names, or
    None when there is nothing to average: no owner, or each row its own document, in order."""
    if owner is None:
        return None
    owner = np.asarray(owner)
    if np.array_equal(owner, np.arange(len(owner))):
        return None
    return int(owner[-1]) + 1
