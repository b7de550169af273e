"""Token embeddings initialised from the training split's co-occurrence statistics.

A short pretraining budget spends many of its steps learning what a count-based method reads
off the corpus in seconds: which tokens occur near which. `cooccurrence_embeddings` counts,
for every pair of real (non-special) tokens within `window` positions of each other in a
training window, a weight of 1/distance; turns the symmetric counts into positive pointwise
mutual information with the context distribution smoothed (counts ** 0.75, Levy, Goldberg and
Dagan 2015); and keeps the top `hidden` dimensions of its truncated SVD (ARPACK, exact),
U * sqrt(S), rescaled to the random initialiser's standard deviation. Tokens that never
co-occur (and the special tokens) keep their random rows.

Counting is vectorised per offset over chunks of windows into a sparse matrix, so memory is
bounded by the distinct pairs, not by vocab_size ** 2. Deterministic for a given input and
seed: the SVD's start vector is seeded and each vector's sign fixed. numpy and scipy only:
the pretraining library does not import scikit-learn (tests/pretraining/test_imports.py).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from scipy.sparse.linalg import svds

from selfsup_model.text.specials import NUM_SPECIAL

CONTEXT_SMOOTHING = 0.75


def cooccurrence_counts(windows, vocab_size: int, window: int, chunk: int = 8192
                        ) -> sp.csr_matrix:
    """(V, V) symmetric float64 counts: sum of 1/d over pairs of real tokens d <= `window`
    positions apart in one row. Special ids (padding included) pair with nothing."""
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    total = sp.csr_matrix((vocab_size, vocab_size), dtype=np.float64)
    for start in range(0, len(windows), chunk):
        block = np.asarray(windows[start:start + chunk], dtype=np.int64)
        rows, cols, weights = [], [], []
        for d in range(1, min(window, block.shape[1] - 1) + 1):
            left, right = block[:, :-d], block[:, d:]
            keep = (left >= NUM_SPECIAL) & (right >= NUM_SPECIAL)
            rows.append(left[keep])
            cols.append(right[keep])
            weights.append(np.full(int(keep.sum()), 1.0 / d))
        if not rows:
            continue
        r, c, w = np.concatenate(rows), np.concatenate(cols), np.concatenate(weights)
        # Both directions: the context of a token is its neighbours on either side.
        total = total + sp.coo_matrix((np.concatenate([w, w]),
                                       (np.concatenate([r, c]), np.concatenate([c, r]))),
                                      shape=(vocab_size, vocab_size)).tocsr()
    total.sum_duplicates()
    return total


def ppmi(counts: sp.csr_matrix) -> sp.csr_matrix:
    """Positive PMI of a symmetric count matrix, with the context distribution smoothed."""
    row = np.asarray(counts.sum(axis=1)).ravel()
    grand = row.sum()
    if grand <= 0:
        return counts
    context = row ** CONTEXT_SMOOTHING
    context /= context.sum()
    coo = counts.tocoo()
    pmi = np.log(coo.data / grand) - np.log(row[coo.row] / grand) - np.log(context[coo.col])
    keep = pmi > 0
    return sp.csr_matrix((pmi[keep], (coo.row[keep], coo.col[keep])), shape=counts.shape)


def cooccurrence_embeddings(windows, vocab_size: int, hidden: int, random_rows: np.ndarray,
                            window: int = 4, seed: int = 0) -> tuple[np.ndarray, int]:
    """(V, H) float32 initial token embeddings and the number of rows set from the counts.

    `random_rows` is the random initialiser's (V, H) matrix: its standard deviation is the
    scale the counted rows are given, and rows without counts are taken from it unchanged.
    """
    random_rows = np.asarray(random_rows, dtype=np.float32)
    if random_rows.shape != (vocab_size, hidden):
        raise ValueError(f"random_rows is {random_rows.shape}, expected ({vocab_size}, {hidden})")
    matrix = ppmi(cooccurrence_counts(windows, vocab_size, window))
    seen = np.flatnonzero(np.diff(matrix.indptr) > 0)
    out = random_rows.copy()
    rank = min(hidden, len(seen) - 1)
    if rank < 1:
        return out, 0
    u, s = top_singular_vectors(matrix[seen][:, seen], rank, seed)
    vectors = u * np.sqrt(s)  # (seen, rank): the symmetric split of the singular values
    full = np.zeros((len(seen), hidden))
    full[:, :rank] = vectors
    scale = float(random_rows.std()) / max(float(full.std()), 1e-12)
    out[seen] = (full * scale).astype(np.float32)
    return out, len(seen)


def top_singular_vectors(matrix, rank: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The `rank` leading left singular vectors (n, rank) and values of a sparse (n, m) matrix,
    largest first: ARPACK from a seeded start vector, so to machine precision and repeatable.
    Each vector's sign makes its largest-magnitude entry positive."""
    start = np.random.default_rng(seed).standard_normal(min(matrix.shape))
    vectors, values, _ = svds(matrix, k=rank, v0=start, solver="arpack")
    order = np.argsort(-values, kind="stable")
    vectors, values = vectors[:, order], values[order]
    signs = np.sign(vectors[np.abs(vectors).argmax(axis=0), np.arange(rank)])
    return vectors * np.where(signs == 0, 1.0, signs), values
