"""Synthetic token windows shared by the benchmarks (run as scripts: this folder is on sys.path)."""

import numpy as np

from selfsup_model.text.specials import CLS_ID, NUM_SPECIAL, PAD_ID, SEP_ID

# Document lengths in content tokens ~ lognormal(4.3, 1.2), cut like the encode stage (overlap
# max_len // 4, at most 8 windows a document). Fitted to the demo corpus's training split:
# that gives 14% padding at max_len 64 (the corpus: 13.4%, 72% full windows, 47% of documents
# one window) and 29% at max_len 128 (the corpus: ~29%).
DOC_LOG_MEAN, DOC_LOG_SD, MAX_WINDOWS_PER_DOC = 4.3, 1.2, 8


def window_lengths(rng: np.random.Generator, n: int, seq: int) -> np.ndarray:
    """(n,) framed lengths in [3, seq] of the windows cut from lognormal-length documents."""
    content = seq - 2
    stride = content - seq // 4
    lengths: list[np.ndarray] = []
    total = 0
    while total < n:
        docs = np.maximum(1, rng.lognormal(DOC_LOG_MEAN, DOC_LOG_SD, size=n).astype(np.int64))
        windows = np.minimum(MAX_WINDOWS_PER_DOC,
                             1 + np.maximum(0, docs - content + stride - 1) // stride)
        doc = np.repeat(np.arange(len(docs)), windows)  # one row per window
        first = np.concatenate([[0], np.cumsum(windows)[:-1]])
        start = (np.arange(len(doc)) - first[doc]) * stride  # content offset of each window
        lengths.append(np.minimum(content, docs[doc] - start) + 2)
        total += len(doc)
    # Documents stay in order (windows of one document are neighbours); the batcher shuffles.
    return np.concatenate(lengths)[:n]


def synthetic_windows(rng: np.random.Generator, n: int, seq: int, vocab: int,
                      structured: bool = False) -> np.ndarray:
    """(n, seq) int32 windows framed [CLS] ... [SEP] + [PAD]s, with a realistic length mix
    (see `window_lengths`). Tokens are uniform (nothing to learn: for timing), or with
    `structured` a fixed Markov chain (see `markov_tokens`) a model can learn from."""
    ids = (markov_tokens(rng, n, seq, vocab) if structured
           else rng.integers(NUM_SPECIAL, vocab, size=(n, seq), dtype=np.int32))
    real = window_lengths(rng, n, seq)
    ids[np.arange(seq)[None, :] >= real[:, None]] = PAD_ID
    ids[:, 0] = CLS_ID
    ids[np.arange(n), real - 1] = SEP_ID
    return ids


def markov_tokens(rng: np.random.Generator, n: int, seq: int, vocab: int,
                  successors: int = 4, follow: float = 0.9) -> np.ndarray:
    """(n, seq) int32 non-special ids: with probability `follow` a token is one of `successors`
    fixed successors of the one before it (the same table whatever `rng`), else uniform. A masked
    token is then predictable from its neighbours, so a validation MLM loss far below the
    unigram baseline (~ln V) shows the model learns."""
    table = np.random.default_rng(12345).integers(NUM_SPECIAL, vocab, size=(vocab, successors))
    out = np.empty((n, seq), dtype=np.int32)
    out[:, 0] = rng.integers(NUM_SPECIAL, vocab, size=n)
    for i in range(1, seq):
        nxt = table[out[:, i - 1], rng.integers(0, successors, size=n)]
        out[:, i] = np.where(rng.random(n) < follow, nxt,
                             rng.integers(NUM_SPECIAL, vocab, size=n))
    return out


def padding_share(windows: np.ndarray) -> float:
    return float(np.mean(windows == PAD_ID))
