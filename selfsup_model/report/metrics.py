"""Classification metrics in numpy: accuracy, macro-F1, confusion, bootstrap intervals.

Labels may be ints or strings; every function compares them by value.

Macro-F1 averages the per-label F1 over the labels present in
``y_true ∪ y_pred`` (scikit-learn's default label set). A label that is only
ever predicted scores F1 = 0 (tp = 0), and a label absent from both sides
does not count at all, so the number depends only on the two arrays given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from selfsup_model.errors import UserError

# Bootstrap resamples are processed in chunks of about this many labels, so a
# big test set times 1000 resamples never materialises gigabytes of indices.
_CHUNK_ELEMENTS = 2_000_000

Metric = Callable[[np.ndarray, np.ndarray], float]


def accuracy(y_true: Sequence, y_pred: Sequence) -> float:
    """Fraction of positions where the prediction equals the label."""
    t, p = _pair(y_true, y_pred)
    return float(np.mean(t == p))


def macro_f1(y_true: Sequence, y_pred: Sequence) -> float:
    """Unweighted mean of per-label F1 over the labels in y_true ∪ y_pred."""
    t, p, k = _codes(y_true, y_pred)
    return float(_batched_macro_f1(t[None, :], p[None, :], k)[0])


def confusion(y_true: Sequence, y_pred: Sequence, labels: Sequence) -> np.ndarray:
    """(K, K) counts, rows = true label, columns = predicted label, in `labels` order."""
    t, p = _pair(y_true, y_pred)
    labels = np.asarray(labels)
    if len(np.unique(labels)) != len(labels):
        raise UserError("confusion(): `labels` contains duplicates")
    order = np.argsort(labels, kind="stable")
    sorted_labels = labels[order]
    k = len(labels)
    codes = []
    for name, y in (("y_true", t), ("y_pred", p)):
        pos = np.searchsorted(sorted_labels, y)
        pos = np.minimum(pos, k - 1)
        unknown = sorted_labels[pos] != y
        if unknown.any():
            raise UserError(
                f"confusion(): {name} holds labels not in `labels`: "
                f"{sorted(set(y[unknown].tolist()))[:5]}"
            )
        codes.append(order[pos])
    flat = np.bincount(codes[0] * k + codes[1], minlength=k * k)
    return flat.reshape(k, k)


def bootstrap_ci(
    y_true: Sequence,
    y_pred: Sequence,
    metric: Metric | str,
    n: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float]:
    """Percentile bootstrap interval of `metric`, resampling documents with replacement.

    `metric` is `accuracy`, `macro_f1` (or their names), which run fully
    vectorised over an (n, N) matrix of resampled indices; any other callable
    `metric(y_true, y_pred) -> float` is applied per resample.
    Same seed and same N -> same resamples, so two methods scored on the same
    test documents (in the same order) get paired intervals.
    """
    if n < 1:
        raise UserError(f"bootstrap_ci(): n must be >= 1 resamples (got {n})")
    if not 0.0 < level < 1.0:
        raise UserError(f"bootstrap_ci(): level must be in (0, 1) (got {level})")
    t, p, k = _codes(y_true, y_pred)
    raw_t, raw_p = np.asarray(y_true), np.asarray(y_pred)
    batched = _batched_metric(metric)
    rng = np.random.default_rng(seed)
    size = len(t)
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // size)
    stats = []
    for start in range(0, n, rows_per_chunk):
        rows = min(rows_per_chunk, n - start)
        idx = rng.integers(0, size, size=(rows, size))  # (R, N)
        if batched is not None:
            stats.append(batched(t[idx], p[idx], k))
        else:
            # A custom metric sees the original labels, not our internal codes.
            stats.append(np.array([metric(raw_t[i], raw_p[i]) for i in idx], dtype=np.float64))
    values = np.concatenate(stats)  # (n,)
    tail = (1.0 - level) / 2.0 * 100.0
    low, high = np.percentile(values, [tail, 100.0 - tail])
    return float(low), float(high)


# ---------------------------------------------------------------- internals


def _pair(y_true: Sequence, y_pred: Sequence) -> tuple[np.ndarray, np.ndarray]:
    t, p = np.asarray(y_true), np.asarray(y_pred)
    if t.ndim != 1 or p.ndim != 1:
        raise UserError(f"labels must be 1-D (got shapes {t.shape} and {p.shape})")
    if len(t) != len(p):
        raise UserError(f"y_true has {len(t)} labels but y_pred has {len(p)}")
    if len(t) == 0:
        raise UserError("cannot score an empty set of predictions")
    return t, p


def _codes(y_true: Sequence, y_pred: Sequence) -> tuple[np.ndarray, np.ndarray, int]:
    """Both label arrays as int codes into their sorted union, and the union's size."""
    t, p = _pair(y_true, y_pred)
    union, inverse = np.unique(np.concatenate([t, p]), return_inverse=True)
    inverse = inverse.reshape(-1)
    return inverse[: len(t)], inverse[len(t):], len(union)


def _batched_accuracy(t: np.ndarray, p: np.ndarray, k: int) -> np.ndarray:
    return np.mean(t == p, axis=1)  # (R,)


def _batched_macro_f1(t: np.ndarray, p: np.ndarray, k: int) -> np.ndarray:
    """Macro-F1 of each row of (R, N) code matrices, over the labels present in that row."""
    r = t.shape[0]
    offset = (np.arange(r) * k)[:, None]  # (R, 1): one block of k bins per row
    true_n = np.bincount((offset + t).ravel(), minlength=r * k).reshape(r, k)
    pred_n = np.bincount((offset + p).ravel(), minlength=r * k).reshape(r, k)
    hit = t == p
    tp = np.bincount((offset + t)[hit], minlength=r * k).reshape(r, k)
    # 2tp + fp + fn == true count + predicted count; > 0 exactly for present labels.
    denom = true_n + pred_n
    present = denom > 0
    f1 = np.divide(2.0 * tp, denom, out=np.zeros((r, k)), where=present)
    return f1.sum(axis=1) / present.sum(axis=1)  # (R,)


_BATCHED = {"accuracy": _batched_accuracy, "macro_f1": _batched_macro_f1}


def _batched_metric(metric: Metric | str):
    if isinstance(metric, str):
        if metric not in _BATCHED:
            raise UserError(f"unknown metric {metric!r}; choose one of {', '.join(_BATCHED)}")
        return _BATCHED[metric]
    if metric is accuracy:
        return _batched_accuracy
    if metric is macro_f1:
        return _batched_macro_f1
    return None


def paired_bootstrap_diff(y_true: Sequence, pred_a: Sequence, pred_b: Sequence,
                          metric: str = "macro_f1", n: int = 1000, seed: int = 0,
                          level: float = 0.95) -> tuple[float, float, float]:
    """metric(a) - metric(b) on the same documents, and a paired percentile bootstrap interval.

    Each resample draws documents with replacement and scores both prediction
    sets on that same draw, so the interval is the spread of the gap itself,
    not of two separate scores.
    """
    if metric not in _BATCHED:
        raise UserError(f"unknown metric {metric!r}; choose one of {', '.join(_BATCHED)}")
    if n < 1 or not 0.0 < level < 1.0:
        raise UserError(f"paired bootstrap needs n >= 1 and 0 < level < 1 (got {n}, {level})")
    t, a = _pair(y_true, pred_a)
    _, b = _pair(y_true, pred_b)
    size = len(t)
    _, codes = np.unique(np.concatenate([t, a, b]), return_inverse=True)
    t, a, b = codes[:size], codes[size : 2 * size], codes[2 * size :]
    k, score = int(codes.max()) + 1, _BATCHED[metric]
    point = float(score(t[None], a[None], k)[0] - score(t[None], b[None], k)[0])
    rng = np.random.default_rng(seed)
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // size)
    diffs = []
    for start in range(0, n, rows_per_chunk):
        idx = rng.integers(0, size, size=(min(rows_per_chunk, n - start), size))  # (R, N)
        diffs.append(score(t[idx], a[idx], k) - score(t[idx], b[idx], k))
    tail = (1.0 - level) / 2.0 * 100.0
    low, high = np.percentile(np.concatenate(diffs), [tail, 100.0 - tail])
    return point, float(low), float(high)
