"""Non-neural baselines: TF-IDF + logistic regression (tuned on validation) and majority class.

The TF-IDF baseline never sees test labels: it takes validation labels for
tuning and returns predictions for unlabelled `eval_texts`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression

from selfsup_model.config import BaselineConfig
from selfsup_model.errors import UserError
from selfsup_model.metrics import macro_f1


@dataclasses.dataclass(frozen=True)
class TfidfResult:
    params: dict[str, Any]  # {"C": float, "ngram_max": int}, chosen on validation
    val_macro_f1: float
    grid: list[dict[str, Any]]  # every (C, ngram_max) tried with its val macro-F1
    val_predictions: np.ndarray  # (n_val,) labels
    predictions: dict[str, np.ndarray]  # eval-set name -> (n,) labels
    fit_time_s: float  # the whole search, the honest cost of this baseline


def tfidf_logreg(
    train_texts: Sequence[str],
    train_y: Sequence,
    val_texts: Sequence[str],
    val_y: Sequence,
    eval_texts: Mapping[str, Sequence[str]],
    cfg: BaselineConfig,
) -> TfidfResult:
    """Grid over word n-gram range (1..n) x C; keep the best validation macro-F1.

    Ties go to the earlier grid point: fewer n-gram orders first, then smaller
    C (stronger regularisation) — the simpler model. The vectoriser is fitted
    on the training texts only.
    """
    train_y, val_y = np.asarray(train_y), np.asarray(val_y)
    _check_inputs(train_texts, train_y, val_texts, val_y, cfg)
    start = time.perf_counter()
    best: tuple[float, dict[str, Any], Any, Any] | None = None
    grid = []
    for ngram_max in sorted(set(cfg.tfidf_ngram_max)):
        vectorizer = _fit_vectorizer(train_texts, ngram_max)
        x_train, x_val = vectorizer.transform(train_texts), vectorizer.transform(val_texts)
        for c in sorted(set(cfg.tfidf_c)):
            clf = LogisticRegression(C=c, max_iter=2000).fit(x_train, train_y)
            f1 = macro_f1(val_y, clf.predict(x_val))
            params = {"C": float(c), "ngram_max": int(ngram_max)}
            grid.append({**params, "val_macro_f1": f1})
            if best is None or f1 > best[0]:
                best = (f1, params, vectorizer, clf)
    f1, params, vectorizer, clf = best
    fit_time = time.perf_counter() - start
    return TfidfResult(
        params=params,
        val_macro_f1=f1,
        grid=grid,
        val_predictions=clf.predict(vectorizer.transform(val_texts)),
        predictions={name: _predict(vectorizer, clf, texts) for name, texts in eval_texts.items()},
        fit_time_s=fit_time,
    )


def majority_class(train_y: Sequence, n: int) -> np.ndarray:
    """`n` copies of the most frequent training label (ties: the smallest label)."""
    values, counts = np.unique(np.asarray(train_y), return_counts=True)
    if len(values) == 0:
        raise UserError("majority-class baseline needs a non-empty training set")
    if n < 0:
        raise UserError(f"majority_class(): n must be >= 0 (got {n})")
    # np.unique sorts and argmax takes the first maximum: ties resolve to the smallest label.
    return np.full(n, values[np.argmax(counts)], dtype=values.dtype)


def _fit_vectorizer(texts: Sequence[str], ngram_max: int) -> TfidfVectorizer:
    vectorizer = TfidfVectorizer(ngram_range=(1, ngram_max), sublinear_tf=True)
    try:
        return vectorizer.fit(texts)
    except ValueError as exc:  # e.g. "empty vocabulary" when no text has a word token
        raise UserError(f"TF-IDF baseline cannot build a vocabulary from the training texts: {exc}") from None


def _predict(vectorizer: TfidfVectorizer, clf: LogisticRegression, texts: Sequence[str]) -> np.ndarray:
    if len(texts) == 0:
        return np.asarray([], dtype=clf.classes_.dtype)
    return clf.predict(vectorizer.transform(texts))


def _check_inputs(train_texts, train_y, val_texts, val_y, cfg: BaselineConfig) -> None:
    if len(train_texts) == 0:
        raise UserError("TF-IDF baseline: the training set is empty")
    if len(train_texts) != len(train_y) or len(val_texts) != len(val_y):
        raise UserError("TF-IDF baseline: texts and labels differ in length")
    if len(val_texts) == 0:
        raise UserError("TF-IDF baseline: the validation set is empty, so nothing can be tuned")
    if len(np.unique(train_y)) < 2:
        raise UserError("TF-IDF baseline: the training set holds a single label; need at least 2")
    if not cfg.tfidf_c or not cfg.tfidf_ngram_max or min(cfg.tfidf_ngram_max) < 1 or min(cfg.tfidf_c) <= 0:
        raise UserError("baseline.tfidf_c must be positive values and baseline.tfidf_ngram_max integers >= 1")
