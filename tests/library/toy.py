"""A two-class toy corpus of token ids shared by the classification tests."""

import numpy as np

from selfsup_model.text.specials import CLS_ID, PAD_ID, SEP_ID

MAX_LEN = 8


def make_docs(n: int, seed: int, max_len: int = MAX_LEN) -> tuple[np.ndarray, np.ndarray]:
    """[CLS] w.. [SEP] [PAD].. where class 0 draws words 7..12 and class 1 words 13..18."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 2
    ids = np.full((n, max_len), PAD_ID, np.int32)
    for i in range(n):
        length = rng.integers(1, max_len - 1)
        ids[i, 0] = CLS_ID
        ids[i, 1 : length + 1] = rng.integers(7, 13, length) + 6 * y[i]
        ids[i, length + 1] = SEP_ID
    return ids, y
