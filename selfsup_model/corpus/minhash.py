"""Vectorised shingling, MinHash signatures and exact Jaccard verification of candidates.

Shingles: a text is folded (`fold_for_shingling`: lowercase, whitespace runs
collapsed to one space), then cut into character n-grams (default 5) or word
n-grams. A text shorter than one shingle yields exactly one shingle: the whole
text. Each shingle becomes a deterministic 32-bit id (a polynomial hash mod
2^64 of its code points or word hashes, then the murmur3 finaliser) - never
Python's salted `hash()`, so ids are stable across processes.

Signatures follow datasketch's default `affine32` scheme: permutation i maps a
shingle id x to (a_i * x + b_i) mod 2^32 with odd a_i (a bijection), and the
signature keeps the minimum over the document's shingles. Everything is numpy
over a whole batch: shingle ids are concatenated, hashed for all permutations
at once and reduced per document with `np.minimum.reduceat`.

Which pairs to check comes from LSH over the signatures (`selfsup_model.corpus.lsh`);
each candidate's exact shingle Jaccard is then computed here, skipping pairs
whose signature agreement already rules the threshold out. Shingle sets are
gathered into 0/1 sparse rows, so the intersection of two sets is scipy's
compiled merge of two sorted lists (`pair_jaccard`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from scipy import sparse

Progress = Callable[[int, int], None]

_BASE = np.uint64(0x100000001B3)  # FNV-64 prime: an odd multiplier for polynomial hashes
_PAD = np.uint64(0xFFFF_FFFF)  # no code point is this large: marks "past the end of the text"
_SPACE = 32
_CHUNK_ELEMENTS = 1 << 21  # (num_perm, chunk) uint32 work buffer of ~8 MiB: stays cache-friendly
# Shingling costs ~80 bytes of transient arrays per character: cap characters per call.
_CHAR_BUDGET = 1 << 18
_GATHER_BUDGET = 1 << 20  # shingles gathered per Jaccard pass (~8 MiB of uint64 keys)


def fold_for_shingling(text: str) -> str:
    """Lowercase and collapse every whitespace run to one space (no leading/trailing space).

    The form that shingling and exact-duplicate detection compare; ingest's
    `normalize_document` is a different, earlier clean-up that keeps case and lines."""
    return " ".join(text.lower().split())


def _identity(text: str) -> str:
    return text


def _fmix32(x: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finaliser on uint64 input (low 32 bits of the result are kept)."""
    x = (x ^ (x >> np.uint64(33))) * np.uint64(0xFF51AFD7ED558CCD)
    x = (x ^ (x >> np.uint64(33))) * np.uint64(0xC4CEB9FE1A85EC53)
    x ^= x >> np.uint64(33)
    return (x & np.uint64(0xFFFF_FFFF)).astype(np.uint32)


def sorted_unique(x: np.ndarray) -> np.ndarray:
    """np.unique by sort + neighbour compare (numpy 2's hash-based unique is far slower here)."""
    x = np.sort(x)
    return x[np.r_[True, x[1:] != x[:-1]]] if len(x) else x


def sorted_member(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """Mask (m,): which of `values` occur in the sorted array `sorted_set` (np.isin, no sort)."""
    if not len(sorted_set):
        return np.zeros(len(values), dtype=bool)
    pos = np.minimum(np.searchsorted(sorted_set, values), len(sorted_set) - 1)
    return sorted_set[pos] == values


def merge_sorted(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Union of two sorted arrays with no value in common, sorted (no re-sort of `a`)."""
    return np.insert(a, np.searchsorted(a, b), b)


class SortedCodes:
    """A growing set of int64 codes kept as two sorted runs: a large one and a recent one.

    Each `add` merges into the recent run; the recent run merges into the large one only once
    it holds an eighth of it, so a set grown by many batches is rewritten a few times per
    doubling, not once per batch (one run rewritten on every add moved the whole set ~140
    times in a grown corpus' split)."""

    _RECENT_SHARE = 8

    def __init__(self) -> None:
        self._large = np.empty(0, dtype=np.int64)
        self._recent = np.empty(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._large) + len(self._recent)

    def contains(self, values: np.ndarray) -> np.ndarray:
        """Mask (m,): which of `values` are held."""
        return sorted_member(values, self._large) | sorted_member(values, self._recent)

    def add(self, values: np.ndarray) -> None:
        """Hold sorted `values`, none of which is held yet."""
        self._recent = merge_sorted(self._recent, values)
        if len(self._recent) * self._RECENT_SHARE > len(self._large):
            self._large = merge_sorted(self._large, self._recent)
            self._recent = np.empty(0, dtype=np.int64)


def ragged_arange(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + l) for every (s, l): (sum(lengths),) int64."""
    lengths = np.asarray(lengths, dtype=np.int64)
    ends = np.cumsum(lengths)
    shift = np.repeat(np.asarray(starts, dtype=np.int64) - (ends - lengths), lengths)
    return np.arange(int(ends[-1]) if len(ends) else 0, dtype=np.int64) + shift


def budget_chunks(weights: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of consecutive items whose weights sum to about `budget` (>= 1 item)."""
    cum = np.cumsum(weights)
    bounds, lo = [], 0
    while lo < len(weights):
        base = cum[lo - 1] if lo else 0
        hi = max(int(np.searchsorted(cum, base + budget, side="right")), lo + 1)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def _word_tokens(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """One 64-bit hash per word of folded texts: (words,) uint64 and (n,) word counts."""
    counts = np.array([t.count(" ") + 1 if t else 0 for t in texts], dtype=np.int64)
    cp = np.frombuffer(
        " ".join(texts).encode("utf-32-le", "surrogatepass"), dtype=np.uint32
    ).astype(np.uint64)
    is_char = cp != _SPACE
    # A word starts at a non-space whose left neighbour is a space (or the string start).
    starts = np.flatnonzero(is_char & ~np.r_[False, is_char[:-1]])
    pos = np.flatnonzero(is_char)  # (chars,) positions of word characters
    word_of = np.searchsorted(starts, pos, side="right") - 1
    rel = pos - starts[word_of]  # offset of each character inside its word
    powers = np.cumprod(np.full(int(rel.max(initial=0)) + 1, _BASE, dtype=np.uint64))
    hashes = (
        np.add.reduceat(cp[pos] * powers[rel], np.searchsorted(pos, starts)) if len(pos) else pos
    )
    return hashes.astype(np.uint64) ^ np.uint64(0x9E3779B97F4A7C15), counts


def _char_tokens(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Code points of folded texts: (chars,) uint64 and (n,) lengths."""
    lengths = np.array([len(t) for t in texts], dtype=np.int64)
    cp = np.frombuffer("".join(texts).encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    return cp.astype(np.uint64), lengths


def shingle_ids(
    texts: Sequence[str], kind: str = "char", size: int = 5
) -> tuple[np.ndarray, np.ndarray]:
    """Shingle ids of folded texts: ids (S,) uint32 and offsets (n + 1,) int64.

    Document d owns ids[offsets[d]:offsets[d + 1]] (in text order, repeats kept);
    every document owns at least one id.
    """
    if kind not in ("char", "word"):
        raise ValueError(f"shingle kind must be 'char' or 'word', got {kind!r}")
    if not len(texts):
        return np.empty(0, dtype=np.uint32), np.zeros(1, dtype=np.int64)
    tokens, counts = (_char_tokens if kind == "char" else _word_tokens)(texts)
    # Lay each document out as its tokens followed by size - 1 pads, so every
    # window starting inside a document stays inside it and a short document's
    # single window is its whole text plus pads (an empty one: all pads).
    block = np.maximum(counts, 1) + size - 1
    block_start = np.cumsum(block) - block
    padded = np.full(int(block.sum()), _PAD, dtype=np.uint64)
    padded[ragged_arange(block_start, counts)] = tokens
    width = len(padded) - size + 1
    poly = np.zeros(width, dtype=np.uint64)  # (positions,) polynomial hash of every window
    for j in range(size):
        poly = poly * _BASE + padded[j : j + width]
    n_windows = np.maximum(counts - size + 1, 1)
    ids = _fmix32(poly[ragged_arange(block_start, n_windows)])
    return ids, np.r_[0, np.cumsum(n_windows)].astype(np.int64)


def shingle_sets(
    texts: Sequence[str], kind: str = "char", size: int = 5
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique shingle ids per folded text: values (U,) uint32, offsets (n + 1,)."""
    ids, offsets = shingle_ids(texts, kind, size)
    doc = np.repeat(np.arange(len(texts), dtype=np.uint64), np.diff(offsets))
    key = sorted_unique((doc << np.uint64(32)) | ids)  # (U,) sorted by (document, id)
    doc_of = (key >> np.uint64(32)).astype(np.int64)
    values = (key & np.uint64(0xFFFF_FFFF)).astype(np.uint32)
    return values, np.searchsorted(doc_of, np.arange(len(texts) + 1)).astype(np.int64)


def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded affine permutation parameters a (odd) and b: two (num_perm,) uint32 arrays."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 1 << 31, num_perm, dtype=np.uint32) * np.uint32(2) + np.uint32(1)
    b = rng.integers(0, 1 << 32, num_perm, dtype=np.uint64).astype(np.uint32)
    return a, b


def _signatures_of_ids(
    ids: np.ndarray, offsets: np.ndarray, a: np.ndarray, b: np.ndarray
) -> np.ndarray:
    """Min over each document's shingles of every permutation: (num_perm, n) uint32."""
    num_perm, n = len(a), len(offsets) - 1
    out = np.full((num_perm, n), np.iinfo(np.uint32).max, dtype=np.uint32)
    chunk = max(_CHUNK_ELEMENTS // num_perm, 1)
    buf = np.empty((num_perm, chunk), dtype=np.uint32)
    for lo in range(0, len(ids), chunk):
        hi = min(lo + chunk, len(ids))
        # Documents overlapping [lo, hi): a long one may span chunks, so merge with np.minimum.
        d0 = int(np.searchsorted(offsets, lo, side="right")) - 1
        d1 = int(np.searchsorted(offsets, hi, side="left"))
        seg = np.maximum(offsets[d0:d1], lo) - lo
        view = buf[:, : hi - lo]
        np.multiply(a[:, None], ids[None, lo:hi], out=view)  # uint32 wraps: mod 2^32
        np.add(view, b[:, None], out=view)
        np.minimum(out[:, d0:d1], np.minimum.reduceat(view, seg, axis=1), out=out[:, d0:d1])
    return out


def minhash_signatures(
    texts: Sequence[str],
    *,
    num_perm: int = 128,
    seed: int = 1,
    kind: str = "char",
    size: int = 5,
    batch_size: int = 2048,
    progress: Progress | None = None,
    folded: bool = False,
) -> np.ndarray:
    """MinHash signatures of raw texts (folded here unless `folded`): (n, num_perm) uint32."""
    a, b = permutations(num_perm, seed)
    sig = np.empty((len(texts), num_perm), dtype=np.uint32)
    fold = _identity if folded else fold_for_shingling
    for lo in range(0, len(texts), batch_size):
        batch = [fold(t) for t in texts[lo : lo + batch_size]]
        # A batch of long documents is cut further so shingling transients stay bounded.
        for start, stop in budget_chunks(np.array([len(t) for t in batch]), _CHAR_BUDGET):
            ids, offsets = shingle_ids(batch[start:stop], kind, size)
            sig[lo + start : lo + stop] = _signatures_of_ids(ids, offsets, a, b).T
        if progress is not None:
            progress(lo + len(batch), len(texts))
    return sig


def _rows_matrix(values: np.ndarray, offsets: np.ndarray, rows: np.ndarray) -> sparse.csr_matrix:
    """Sets `rows` of back-to-back sorted uint32 sets as a 0/1 CSR matrix (k, 2^32).

    Sets are stored as uint32 (4 bytes a shingle); only a gathered chunk is widened
    to the int64 column indices scipy needs for 2^32 columns."""
    sizes = np.diff(offsets)[rows]
    cols = values[ragged_arange(offsets[rows], sizes)].astype(np.int64)
    indptr = np.r_[0, np.cumsum(sizes)].astype(np.int64)
    data = np.ones(len(cols), dtype=np.int8)
    return sparse.csr_matrix((data, cols, indptr), shape=(len(rows), 1 << 32), copy=False)


def pair_jaccard(
    values: np.ndarray, offsets: np.ndarray, left: np.ndarray, right: np.ndarray
) -> np.ndarray:
    """Exact Jaccard of shingle sets (from `shingle_sets`) for each (left, right): (m,) float64.

    Rows become sparse 0/1 rows a chunk at a time, so each intersection is scipy's
    compiled merge of two sorted lists (the row-wise product), with no sort here."""
    left, right = np.asarray(left, dtype=np.int64), np.asarray(right, dtype=np.int64)
    sizes = np.diff(offsets)
    out = np.empty(len(left), dtype=np.float64)
    for lo, hi in budget_chunks(sizes[left] + sizes[right], _GATHER_BUDGET):
        lft, rgt = left[lo:hi], right[lo:hi]
        both = _rows_matrix(values, offsets, lft).multiply(_rows_matrix(values, offsets, rgt))
        inter = both.getnnz(axis=1)  # (chunk,) shared shingles
        out[lo:hi] = inter / (sizes[lft] + sizes[rgt] - inter)
    return out


def shingle_rows(
    texts: Sequence[str],
    docs: np.ndarray,
    kind: str = "char",
    size: int = 5,
    folded: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique shingle ids of texts[docs] (folded here unless `folded`), back to back:
    values (U,) uint32 and per-document counts (k,) int64.

    Shingled a budget of characters at a time; only the compact sets are kept,
    so memory follows the documents asked for, not the corpus."""
    raw_lengths = np.array([len(texts[i]) for i in docs], dtype=np.int64)  # bound the folded
    fold = _identity if folded else fold_for_shingling
    parts, sizes = [], []
    for lo, hi in budget_chunks(raw_lengths, _CHAR_BUDGET):
        chunk = [fold(texts[i]) for i in docs[lo:hi]]
        values, offsets = shingle_sets(chunk, kind, size)
        parts.append(values)
        sizes.append(np.diff(offsets))
    values = np.concatenate(parts) if parts else np.empty(0, dtype=np.uint32)
    return values, (np.concatenate(sizes) if sizes else np.empty(0, dtype=np.int64))


def verify_pairs(texts: Sequence[str], pairs: np.ndarray, kind: str = "char",
                 size: int = 5) -> np.ndarray:
    """Exact Jaccard of each (i, j) row of `pairs` over raw `texts`: (m,) float64.

    Only the documents named by a pair are shingled (`shingle_rows`): memory
    follows the candidates, not the corpus.
    """
    if not len(pairs):
        return np.empty(0, dtype=np.float64)
    involved = sorted_unique(pairs.ravel())  # (k,) sorted document indices
    values, counts = shingle_rows(texts, involved, kind, size)
    offsets = np.r_[0, np.cumsum(counts)].astype(np.int64)
    local = np.searchsorted(involved, pairs)  # (m, 2) rows into the shingled subset
    return pair_jaccard(values, offsets, local[:, 0], local[:, 1])


_SAFETY_SIGMAS = 6.0
_AGREEMENT_CHUNK = 1 << 13  # pairs per pass: the gathered (chunk, num_perm) signatures stay ~4 MiB


def plausible_pairs(signatures: np.ndarray, pairs: np.ndarray, threshold: float) -> np.ndarray:
    """Mask (m,): pairs whose signature agreement leaves Jaccard >= threshold plausible.

    Agreement estimates Jaccard without bias, with standard error
    sqrt(J(1-J)/num_perm); a pair truly at the threshold lands 6 standard
    errors below it with probability < 1e-8, so skipping those pairs only skips
    exact checks that would fail - at a 0.5 threshold most LSH candidates are such.
    """
    return agreement_at_least(signatures, pairs, agreement_floor(threshold, signatures.shape[1]))


def agreement_floor(threshold: float, num_perm: int) -> float:
    """Fewest agreeing signature columns a pair at Jaccard >= threshold plausibly shows."""
    sigma = np.sqrt(threshold * (1.0 - threshold) / num_perm)
    return (threshold - _SAFETY_SIGMAS * sigma) * num_perm


def agreement_at_least(signatures: np.ndarray, pairs: np.ndarray, floor: float) -> np.ndarray:
    """Mask (m,): pairs whose signatures agree in >= floor columns (any integer dtype)."""
    out = np.empty(len(pairs), dtype=bool)
    for lo in range(0, len(pairs), _AGREEMENT_CHUNK):
        part = pairs[lo : lo + _AGREEMENT_CHUNK]
        same = (signatures[part[:, 0]] == signatures[part[:, 1]]).sum(axis=1)  # (chunk,)
        out[lo : lo + len(part)] = same >= floor
    return out


_LOW7 = np.uint64(0x7F7F_7F7F_7F7F_7F7F)


def byte_agreement_at_least(packed: np.ndarray, pairs: np.ndarray, floor: float) -> np.ndarray:
    """`agreement_at_least` over uint8 signatures viewed as (n, num_perm / 8) uint64 words.

    Equal bytes are counted eight at a time: a byte x of a ^ b is zero exactly when
    ((x & 0x7F) + 0x7F) | x has its high bit clear (no carry crosses bytes), so one
    popcount per word counts the unequal ones. Buffers are reused across passes."""
    out = np.empty(len(pairs), dtype=bool)
    words = packed.shape[1]
    x = np.empty((min(_AGREEMENT_CHUNK, len(pairs)), words), dtype=np.uint64)
    y = np.empty_like(x)
    for lo in range(0, len(pairs), _AGREEMENT_CHUNK):
        part = pairs[lo : lo + _AGREEMENT_CHUNK]
        xv, yv = x[: len(part)], y[: len(part)]
        np.take(packed, part[:, 0], axis=0, out=xv)
        np.take(packed, part[:, 1], axis=0, out=yv)
        np.bitwise_xor(xv, yv, out=xv)
        np.bitwise_and(xv, _LOW7, out=yv)
        yv += _LOW7
        yv |= xv
        yv &= ~_LOW7  # the high bit of every nonzero byte
        unequal = np.bitwise_count(yv).sum(axis=1, dtype=np.int64)
        out[lo : lo + len(part)] = words * 8 - unequal >= floor
    return out


def verify_candidates(
    texts: Sequence[str],
    signatures: np.ndarray,
    pairs: np.ndarray,
    threshold: float,
    kind: str = "char",
    size: int = 5,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Candidates whose exact Jaccard is >= threshold: pairs (k, 2), jaccard (k,), and the
    number skipped because their signatures made that implausible (`plausible_pairs`)."""
    plausible = plausible_pairs(signatures, pairs, threshold)
    checked = pairs[plausible]
    jac = verify_pairs(texts, checked, kind, size)
    ok = jac >= threshold
    return checked[ok], jac[ok], int((~plausible).sum())
