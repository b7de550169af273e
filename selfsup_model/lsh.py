"""LSH banding over MinHash signatures: which pairs are worth an exact Jaccard check.

A signature's columns are cut into `bands` bands of `rows` columns; two
documents become a candidate pair when any band hashes to the same 64-bit key.
(bands, rows) come from datasketch's optimiser, weighting a missed pair above
a false candidate: every candidate is verified exactly afterwards
(`minhash.verify_candidates`), so an extra candidate costs one check while a
miss loses a duplicate or lets a near-copy leak across splits. Everything is
numpy over all documents: keys are sorted per band and equal keys paired.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from datasketch.lsh import _optimal_param

from selfsup_model.minhash import ragged_arange, sorted_unique

# Every candidate is verified exactly, so a false positive costs one Jaccard
# computation while a false negative silently loses a duplicate (or lets a
# near-copy leak across splits): misses are weighted 19 to 1.
MISS_WEIGHT = 0.95
# Related pairs decide the split, so unit building and the leakage audit weigh LSH misses 99:1
# against extra candidates (verification removes those): at a 0.5 threshold and 128
# permutations that is 39 bands of 3 rows, and a J=0.5 pair becomes a candidate with
# probability 0.995.
UNIT_MISS_WEIGHT = 0.99


@lru_cache(maxsize=64)
def lsh_params(
    threshold: float, num_perm: int, miss_weight: float = MISS_WEIGHT
) -> tuple[int, int]:
    """(bands, rows) minimising the weighted false-positive + false-negative areas (datasketch)."""
    return _optimal_param(threshold, num_perm, 1.0 - miss_weight, miss_weight)


def _band_keys(signatures: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """One 64-bit key per (band, document): (bands, n) uint64.

    Key collisions only add candidates, and every candidate is verified."""
    sig = signatures[:, : bands * rows].reshape(len(signatures), bands, rows)  # a view
    keys = np.zeros((bands, len(signatures)), dtype=np.uint64)
    for r in range(rows):
        row = sig[:, :, r].T.astype(np.uint64)  # (bands, n): one row at a time keeps memory small
        keys = (keys ^ row) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(r + 1)
    return keys ^ (keys >> np.uint64(29))


def _pairs_in_runs(keys: np.ndarray) -> np.ndarray:
    """All (i, j) pairs of positions whose keys are equal: (m, 2) int64."""
    order = np.argsort(keys, kind="stable")
    k = keys[order]
    new_run = np.r_[True, k[1:] != k[:-1]]
    run_end = np.r_[np.flatnonzero(new_run)[1:], len(k)][np.cumsum(new_run) - 1]
    after = run_end - np.arange(len(k)) - 1  # members of the run after this position
    idx = np.flatnonzero(after > 0)
    out, step = [], 1
    while len(idx):  # step d pairs every member with the one d places later in its run
        out.append(np.stack([order[idx], order[idx + step]], axis=1))
        step += 1
        idx = idx[after[idx] >= step]
    return np.concatenate(out) if out else np.empty((0, 2), dtype=np.int64)


def candidate_pairs(
    signatures: np.ndarray, threshold: float, bands_rows: tuple[int, int] | None = None
) -> np.ndarray:
    """LSH candidate pairs within one set: (m, 2) int64, i < j, sorted, unique."""
    n = len(signatures)
    bands, rows = bands_rows or lsh_params(threshold, signatures.shape[1])
    found = [_pairs_in_runs(keys) for keys in _band_keys(signatures, bands, rows)]
    pairs = np.concatenate(found) if found else np.empty((0, 2), dtype=np.int64)
    code = sorted_unique(
        np.minimum(pairs[:, 0], pairs[:, 1]) * n + np.maximum(pairs[:, 0], pairs[:, 1])
    )
    return np.stack([code // n, code % n], axis=1) if n else np.empty((0, 2), dtype=np.int64)


def cross_candidate_pairs(
    index_sig: np.ndarray, query_sig: np.ndarray, threshold: float, miss_weight: float = MISS_WEIGHT
) -> np.ndarray:
    """LSH candidates (query_row, index_row) between two sets: (m, 2) int64, sorted, unique."""
    bands, rows = lsh_params(threshold, index_sig.shape[1], miss_weight)
    n_index = max(len(index_sig), 1)
    index_keys = _band_keys(index_sig, bands, rows)
    query_keys = _band_keys(query_sig, bands, rows)
    codes = []
    for ik, qk in zip(index_keys, query_keys, strict=True):
        order = np.argsort(ik, kind="stable")
        lo = np.searchsorted(ik[order], qk, side="left")
        hi = np.searchsorted(ik[order], qk, side="right")
        q = np.repeat(np.arange(len(qk)), hi - lo)
        codes.append(q * n_index + order[ragged_arange(lo, hi - lo)])
    code = sorted_unique(np.concatenate(codes)) if codes else np.empty(0, dtype=np.int64)
    return np.stack([code // n_index, code % n_index], axis=1)
