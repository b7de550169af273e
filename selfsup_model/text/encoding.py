"""Documents -> fixed-length, framed, padded token windows.

A document's content ids are cut into windows of at most `max_len - 2` tokens;
consecutive windows share `overlap` tokens (stride = max_len - 2 - overlap).
Each window is framed `[CLS] content [SEP]` and right-padded with [PAD], so a
window never mixes two documents. At most `max_windows_per_doc` windows are
kept per document; a document cut short is counted in `truncated_docs`.

Token counts (`EncodedSplit.counts`):
  documents       input texts
  kept_docs       documents with at least one token (each has >= 1 window)
  empty_docs      documents that tokenised to nothing (for the caller to reject
                  with reason 'no_tokens'; their indices are in `empty`)
  sequences       windows written
  tokens          non-[PAD] positions of the windows, INCLUDING [CLS]/[SEP] and
                  counting overlap tokens once per window: what a model reads
  content_tokens  tokenizer output of the kept documents, before windowing
  truncated_docs  documents with content beyond their last kept window
  truncated_tokens content tokens covered by no kept window
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from selfsup_model.artifacts import atomic_save_npy
from selfsup_model.config import EncodeConfig
from selfsup_model.corpus.sharding import TextSource
from selfsup_model.text.specials import CLS_ID, PAD_ID, SEP_ID
from selfsup_model.text.tokenization import load_tokenizer

_SUFFIXES = ("windows", "doc_offsets", "kept")
_COUNT_KEYS = ("documents", "kept_docs", "empty_docs", "sequences", "tokens", "content_tokens",
               "truncated_docs", "truncated_tokens")


@dataclasses.dataclass(frozen=True)
class EncodedSplit:
    """One split's windows; rows offsets[i]:offsets[i+1] belong to input text kept[i]."""

    windows: np.ndarray  # (n_windows, max_len) int32
    doc_offsets: np.ndarray  # (n_kept + 1,) int64
    kept: np.ndarray  # (n_kept,) int64 indices into the input texts
    empty: np.ndarray  # (n_empty,) int64 indices of texts with no tokens
    counts: dict[str, int]


def encode_split(tok: Tokenizer, texts: Sequence[str], cfg: EncodeConfig) -> EncodedSplit:
    """Tokenise `texts` in Rust-parallel batches and cut them into framed windows."""
    lengths, n_win, uncovered, windows = [], [], [], []
    # Chunked so peak memory is bounded by one batch of documents, not the split.
    for start in range(0, len(texts), cfg.batch_size):
        chunk_lengths, flat = _tokenize(tok, texts[start : start + cfg.batch_size])
        chunk_win, chunk_uncovered = _window_plan(chunk_lengths, cfg)
        windows.append(_build_windows(flat, chunk_lengths, chunk_win, cfg))
        lengths.append(chunk_lengths)
        n_win.append(chunk_win)
        uncovered.append(chunk_uncovered)
    lengths_a = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    n_win_a = np.concatenate(n_win) if n_win else np.zeros(0, np.int64)
    uncovered_a = np.concatenate(uncovered) if uncovered else np.zeros(0, np.int64)
    windows_a = np.concatenate(windows) if windows else np.zeros((0, cfg.max_len), np.int32)

    kept = np.flatnonzero(lengths_a > 0).astype(np.int64)
    empty = np.flatnonzero(lengths_a == 0).astype(np.int64)
    doc_offsets = np.zeros(len(kept) + 1, dtype=np.int64)
    np.cumsum(n_win_a[kept], out=doc_offsets[1:])
    counts = {
        "documents": len(texts),
        "kept_docs": len(kept),
        "empty_docs": len(empty),
        "sequences": int(windows_a.shape[0]),
        "tokens": int(np.count_nonzero(windows_a != PAD_ID)),
        "content_tokens": int(lengths_a.sum()),
        "truncated_docs": int(np.count_nonzero(uncovered_a)),
        "truncated_tokens": int(uncovered_a.sum()),
    }
    return EncodedSplit(windows_a, doc_offsets, kept, empty, counts)


def encode_shard(source: TextSource, rows: np.ndarray, tokenizer: str,
                 cfg: EncodeConfig) -> EncodedSplit:
    """One shard of a split: the texts at `rows` of `source`, encoded with the tokenizer file
    at `tokenizer` (the shard task of the encode stage; see `merge_encoded`)."""
    return encode_split(load_tokenizer(tokenizer), source.take(rows), cfg)


def merge_encoded(parts: Sequence[EncodedSplit], max_len: int) -> EncodedSplit:
    """Consecutive shards of one split's texts, encoded apart, as if encoded together."""
    if not parts:
        return EncodedSplit(np.zeros((0, max_len), np.int32), np.zeros(1, np.int64),
                            np.zeros(0, np.int64), np.zeros(0, np.int64),
                            dict.fromkeys(_COUNT_KEYS, 0))
    doc_base = np.cumsum([0] + [p.counts["documents"] for p in parts[:-1]])
    win_base = np.cumsum([0] + [len(p.windows) for p in parts[:-1]])
    return EncodedSplit(
        np.concatenate([p.windows for p in parts]),
        np.concatenate([np.zeros(1, np.int64)]
                       + [p.doc_offsets[1:] + w for p, w in zip(parts, win_base, strict=True)]),
        np.concatenate([p.kept + d for p, d in zip(parts, doc_base, strict=True)]),
        np.concatenate([p.empty + d for p, d in zip(parts, doc_base, strict=True)]),
        {key: sum(p.counts[key] for p in parts) for key in _COUNT_KEYS},
    )


def _tokenize(tok: Tokenizer, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Per-document token counts (n_docs,) int64 and the content ids concatenated (T,) int32."""
    ids = [e.ids for e in tok.encode_batch(list(texts), add_special_tokens=False)]
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
    return lengths, flat


def _window_plan(lengths: np.ndarray, cfg: EncodeConfig) -> tuple[np.ndarray, np.ndarray]:
    """Windows kept per document and content tokens left uncovered, both (n_docs,) int64."""
    content = cfg.max_len - 2
    stride = content - cfg.overlap
    # Windows needed to cover n tokens: 1 if n <= content, else 1 + ceil((n - content) / stride).
    needed = np.where(lengths > 0, 1 + -(-np.maximum(lengths - content, 0) // stride), 0)
    n_win = np.minimum(needed, cfg.max_windows_per_doc)
    covered = np.where(n_win > 0, (n_win - 1) * stride + content, 0)
    return n_win, np.maximum(lengths - covered, 0)


def _build_windows(
    flat: np.ndarray, lengths: np.ndarray, n_win: np.ndarray, cfg: EncodeConfig
) -> np.ndarray:
    """(n_windows, max_len) int32 framed windows, documents in input order."""
    content = cfg.max_len - 2
    stride = content - cfg.overlap
    total = int(n_win.sum())
    doc_start = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=doc_start[1:])
    doc = np.repeat(np.arange(len(lengths)), n_win)  # (W,) owning document
    first = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(n_win[:-1], out=first[1:])
    k = np.arange(total) - first[doc]  # (W,) window index within its document
    begin = k * stride  # (W,) offset of the window's first content token in its document
    length = np.minimum(content, lengths[doc] - begin)  # (W,) content tokens in the window

    out = np.full((total, cfg.max_len), PAD_ID, dtype=np.int32)
    out[:, 0] = CLS_ID
    col = np.arange(content)
    valid = col[None, :] < length[:, None]  # (W, content)
    src = doc_start[doc][:, None] + begin[:, None] + col[None, :]  # (W, content)
    out[:, 1 : content + 1][valid] = flat[src[valid]]
    out[np.arange(total), length + 1] = SEP_ID
    return out


def split_file_names(split: str) -> list[str]:
    return [f"{split}_{suffix}.npy" for suffix in _SUFFIXES]


def write_encoded(encoded: EncodedSplit, directory: str | os.PathLike, split: str) -> list[str]:
    """Atomically write `{split}_windows.npy`, `_doc_offsets.npy`, `_kept.npy`; return the names."""
    arrays = (encoded.windows, encoded.doc_offsets, encoded.kept)
    names = split_file_names(split)
    for name, array in zip(names, arrays, strict=True):
        atomic_save_npy(Path(directory) / name, array)
    return names
