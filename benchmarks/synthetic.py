"""Synthetic token windows shared by the benchmarks (run as scripts: this folder is on sys.path)."""

import numpy as np

from selfsup_model.specials import CLS_ID, NUM_SPECIAL, PAD_ID, SEP_ID


def synthetic_windows(rng: np.random.Generator, n: int, seq: int, vocab: int) -> np.ndarray:
    """(n, seq) int32 framed windows: a third fill the window, the rest have uniform lengths
    in [8, seq]."""
    ids = rng.integers(NUM_SPECIAL, vocab, size=(n, seq), dtype=np.int32)
    real = np.where(rng.random(n) < 1 / 3, seq, rng.integers(8, seq + 1, size=n))
    ids[np.arange(seq)[None, :] >= real[:, None]] = PAD_ID
    ids[:, 0] = CLS_ID
    ids[np.arange(n), real - 1] = SEP_ID
    return ids
