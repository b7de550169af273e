"""Non-neural baselines and the one logistic-regression-on-features routine they share.

- `logreg_on_features`: logistic regression on fixed feature matrices (dense or
  sparse), C chosen by validation macro-F1. Used as is for pretrained sentence
  embeddings (and any other frozen features), and by the TF-IDF baseline.
- `tfidf_logreg`: TF-IDF (word n-grams, character n-grams or both) + `logreg_on_features`,
  with the vectoriser's settings tuned on validation too.
- `majority_class`: the most frequent training label.

None of them sees test labels: validation labels tune, and the named eval sets
are unlabelled inputs that are only predicted, once, after the choice.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from scipy import sparse
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression

from selfsup_model.config import BaselineConfig
from selfsup_model.errors import UserError
from selfsup_model.report.metrics import macro_f1
from selfsup_model.text.windows import documents_owning, mean_over_documents

_TFIDF = "TF-IDF baseline"
# The multinomial model sklearn's default (lbfgs) fits, by faster solvers: on sparse TF-IDF
# rows of words saga (seeded, so deterministic), on dense features and on character n-grams
# Newton-CG (`tfidf_solver`). benchmarks/tfidf.py on
# the demo at 5/25/100% labels: saga 12.2x and Newton-CG 4.5x faster than lbfgs, validation
# macro-F1 within 0.005 of it at every point.
MAX_ITER = 1000
# A C search whose choice lands on an end of its grid goes on past that end, one grid step at a
# time (the ratio of the grid's last, or first, two values), while the new end is chosen, at most
# this many steps per end: the selection stops at a value whose neighbours on both sides were
# tried, or says it hit this bound (the compare stage lists it as an edge). Grids of one or two
# values are fixed settings, not searches, and are not widened. The same for every method that
# selects a C: the probe, TF-IDF and the sentence-embedding baseline. Four: on the second corpus
# (docs/results.md) TF-IDF's validation macro-F1 still rose from C = 100 to 10,000 (0.424 ->
# 0.476 at 5% labels) and levelled off at 100,000 (0.484, as at 1,000,000).
EDGE_STEPS = 4


def logistic_regression(c: float, sparse_rows: bool, solver: str | None = None
                        ) -> LogisticRegression:
    """An unfitted multinomial logistic regression with L2 strength 1/c: saga on sparse rows,
    Newton-CG on dense ones, unless `solver` names one."""
    solver = solver or ("saga" if sparse_rows else "newton-cg")
    # random_state seeds saga's sampling; the other solvers are deterministic and ignore it
    return LogisticRegression(C=c, solver=solver, max_iter=MAX_ITER, random_state=0)


@dataclasses.dataclass(frozen=True)
class LogregResult:
    params: dict[str, Any]  # the chosen point, e.g. {"C": float} or {"C": float, "ngram_max": int}
    val_macro_f1: float
    grid: list[dict[str, Any]]  # every point tried, with its val macro-F1, in the order tried
    val_predictions: np.ndarray  # (n_val,) labels
    predictions: dict[str, np.ndarray]  # eval-set name -> (n,) labels
    fit_time_s: float  # the whole search, the honest cost of this baseline
    model: LogisticRegression = dataclasses.field(repr=False, compare=False)  # fitted, chosen C
    # class probabilities behind the predictions, columns in `model.classes_` order
    val_probabilities: np.ndarray = dataclasses.field(repr=False, compare=False, default=None)
    probabilities: dict[str, np.ndarray] = dataclasses.field(repr=False, compare=False,
                                                             default_factory=dict)
    c_tried: tuple[float, ...] = ()  # every C fitted, ascending: the grid and its widening


def logreg_on_features(
    train_x,
    train_y: Sequence,
    val_x,
    val_y: Sequence,
    eval_x: Mapping[str, Any],
    c_grid: Sequence[float],
    what: str = "logistic regression",
    val_owner: np.ndarray | None = None,
    eval_owners: Mapping[str, np.ndarray] | None = None,
    solver: str | None = None,
) -> LogregResult:
    """Logistic regression on fixed features (n, dim); C chosen by validation macro-F1 only.

    Fits `logistic_regression(c)` for each distinct C in ascending order. Ties go
    to the smaller C (stronger regularisation, the simpler model). A grid of three or more
    values whose choice lands on its largest (smallest) value is widened past that end (see
    `EDGE_STEPS`); `grid` lists the widening's points with `"widened": True`. `eval_x` carry
    no labels: they are predicted once, after the choice. `what` names the caller
    in error messages. `val_owner` / `eval_owners[name]`, when a document has several
    rows: the document of each row (non-decreasing); a document's prediction is then the
    class of highest mean probability over its rows, and `val_y` has one label per document.
    `solver`: as `logistic_regression` (None: by the rows' kind).
    """
    train_y, val_y = np.asarray(train_y), np.asarray(val_y)
    eval_owners = eval_owners or {}
    _check_features(what, train_x, train_y, val_x,
                    val_y if val_owner is None else val_y[np.asarray(val_owner)], eval_x, c_grid)
    start = time.perf_counter()
    fits: dict[float, tuple[float, LogisticRegression, np.ndarray]] = {}

    def fit(c: float, widened: bool) -> None:
        clf = logistic_regression(c, sparse.issparse(train_x), solver).fit(train_x, train_y)
        val_proba = _probabilities(clf, val_x, val_owner)
        fits[c] = (macro_f1(val_y, _labels(clf, val_proba)), clf, val_proba)
        grid.append({"C": c, "val_macro_f1": fits[c][0], **({"widened": True} if widened else {})})

    def best_c() -> float:  # the best validation macro-F1; ties to the smaller C
        return max(sorted(fits), key=lambda c: fits[c][0])

    grid: list[dict[str, Any]] = []
    values = sorted({float(c) for c in c_grid})
    for c in values:
        fit(c, widened=False)
    if len(values) >= 3:
        for end, step in ((-1, values[-1] / values[-2]), (0, values[0] / values[1])):
            for _ in range(EDGE_STEPS):
                tried = sorted(fits)
                if best_c() != tried[end]:
                    break
                fit(float(f"{tried[end] * step:.6g}"), widened=True)  # 1000.0, not 999.99..
    c = best_c()
    f1, clf, val_proba = fits[c]
    fit_time = time.perf_counter() - start
    probabilities = {name: _probabilities(clf, x, eval_owners.get(name))
                     for name, x in eval_x.items()}
    return LogregResult(
        params={"C": c},
        val_macro_f1=f1,
        grid=grid,
        val_predictions=_labels(clf, val_proba),
        predictions={name: _labels(clf, p) for name, p in probabilities.items()},
        fit_time_s=fit_time,
        model=clf,
        val_probabilities=val_proba,
        probabilities=probabilities,
        c_tried=tuple(sorted(fits)),
    )


FEATURES = ("word", "char", "word+char")
CHAR_NGRAMS = (2, 5)  # character n-grams within word boundaries, for "char" features


def tfidf_grid(cfg: BaselineConfig) -> list[dict[str, Any]]:
    """The vectoriser settings the TF-IDF baseline tries, simplest first: features in the
    order of `FEATURES`, then fewer word n-gram orders, then sublinear tf before raw. Character
    features alone have no word n-gram order (`ngram_max` is left out)."""
    if (not cfg.tfidf_c or not cfg.tfidf_ngram_max or not cfg.tfidf_sublinear
            or not cfg.tfidf_features or min(cfg.tfidf_ngram_max) < 1 or min(cfg.tfidf_c) <= 0):
        raise UserError("baseline.tfidf_c must be positive values, baseline.tfidf_ngram_max "
                        "integers >= 1, and baseline.tfidf_sublinear and tfidf_features "
                        "non-empty")
    points = []
    for features in (f for f in FEATURES if f in cfg.tfidf_features):
        orders = sorted(set(cfg.tfidf_ngram_max)) if "word" in features else [None]
        for ngram_max in orders:
            for sublinear in sorted(set(cfg.tfidf_sublinear), reverse=True):
                points.append({"features": features, "sublinear_tf": bool(sublinear),
                               **({"ngram_max": int(ngram_max)} if ngram_max else {})})
    return points


def tfidf_logreg(
    train_texts: Sequence[str],
    train_y: Sequence,
    val_texts: Sequence[str],
    val_y: Sequence,
    eval_texts: Mapping[str, Sequence[str]],
    cfg: BaselineConfig,
) -> LogregResult:
    """Grid over the vectoriser's settings (`tfidf_grid`: word and/or character features, word
    n-gram range 1..n, sublinear tf) x C; keep the best validation macro-F1.

    Ties go to the earlier grid point: the simpler vectoriser first, then smaller C (stronger
    regularisation) — the simpler model. The vectoriser is fitted on the training texts only.
    `params` is {"C", "features", "sublinear_tf"} and, with word features, "ngram_max".
    """
    train_y, val_y = np.asarray(train_y), np.asarray(val_y)
    _check_labelled(_TFIDF, len(train_texts), train_y, len(val_texts), val_y)
    points = tfidf_grid(cfg)
    start = time.perf_counter()
    best: tuple[LogregResult, TfidfFeatures, dict] | None = None
    grid = []
    for point in points:
        vectorizer = TfidfFeatures(**point).fit(train_texts)
        x_train, x_val = vectorizer.transform(train_texts), vectorizer.transform(val_texts)
        res = logreg_on_features(x_train, train_y, x_val, val_y, {}, cfg.tfidf_c, what=_TFIDF,
                                 solver=tfidf_solver(point["features"]))
        grid += [{"C": g["C"], **point, "val_macro_f1": g["val_macro_f1"]} for g in res.grid]
        # strict: a tie keeps the earlier, simpler point (within one, the smaller C)
        if best is None or res.val_macro_f1 > best[0].val_macro_f1:
            best = (res, vectorizer, point)
    res, vectorizer, point = best
    fit_time = time.perf_counter() - start
    probabilities = {name: _probabilities(res.model, vectorizer.transform(texts))
                     for name, texts in eval_texts.items()}
    return dataclasses.replace(
        res,
        params={**res.params, **point},
        grid=grid,
        predictions={name: _labels(res.model, p) for name, p in probabilities.items()},
        probabilities=probabilities,
        fit_time_s=fit_time,
    )


def tfidf_solver(features: str) -> str:
    """The solver for TF-IDF rows of `features`. Character n-grams fill a row with thousands of
    entries, where saga's many passes cost most: on the demo's 25% subset (2,553 documents,
    192,006 character features, C = 100) Newton-CG fitted in 10.4 s against saga's 92.1 s
    (benchmarks/README.md, "TF-IDF's character n-grams"). Word rows are sparse enough for saga
    to stay the faster (`benchmarks/tfidf.py`)."""
    return "newton-cg" if "char" in features else "saga"


class TfidfFeatures:
    """TF-IDF rows of word n-grams (1..ngram_max), character 2-5-grams within word boundaries,
    or both side by side (each block L2-normalised by its own vectoriser)."""

    def __init__(self, features: str = "word", sublinear_tf: bool = True,
                 ngram_max: int | None = None):
        if features not in FEATURES:
            raise UserError(f"baseline.tfidf_features: {features!r} is not one of {FEATURES}")
        self.parts = []
        if "word" in features:
            self.parts.append(TfidfVectorizer(ngram_range=(1, ngram_max or 1),
                                              sublinear_tf=sublinear_tf))
        if "char" in features:
            self.parts.append(TfidfVectorizer(analyzer="char_wb", ngram_range=CHAR_NGRAMS,
                                              sublinear_tf=sublinear_tf))

    def fit(self, texts: Sequence[str]) -> TfidfFeatures:
        for part in self.parts:
            try:
                part.fit(texts)
            except ValueError as exc:  # e.g. "empty vocabulary" when no text has a word token
                raise UserError(f"{_TFIDF} cannot build a vocabulary from the training texts: "
                                f"{exc}") from None
        return self

    def transform(self, texts: Sequence[str]):
        """(n, features) sparse rows; sklearn refuses zero texts, so that (0, features) case
        is built here."""
        width = sum(len(part.vocabulary_) for part in self.parts)
        if len(texts) == 0:
            return sparse.csr_matrix((0, width))
        blocks = [part.transform(texts) for part in self.parts]
        return blocks[0] if len(blocks) == 1 else sparse.hstack(blocks, format="csr")


def majority_class(train_y: Sequence, n: int) -> np.ndarray:
    """`n` copies of the most frequent training label (ties: the smallest label)."""
    values, counts = np.unique(np.asarray(train_y), return_counts=True)
    if len(values) == 0:
        raise UserError("majority-class baseline needs a non-empty training set")
    if n < 0:
        raise UserError(f"majority_class(): n must be >= 0 (got {n})")
    # np.unique sorts and argmax takes the first maximum: ties resolve to the smallest label.
    return np.full(n, values[np.argmax(counts)], dtype=values.dtype)


# ---------------------------------------------------------------- internals


def _probabilities(clf: LogisticRegression, x, owner: np.ndarray | None = None) -> np.ndarray:
    """Class probabilities (columns in `clf.classes_` order) for the rows of `x`, or with
    `owner` for the documents that own them (the mean over a document's rows); zero rows give
    an empty (0, classes) array (sklearn refuses them)."""
    if np.shape(x)[0] == 0:
        return np.zeros((0, len(clf.classes_)))
    proba = clf.predict_proba(x)
    if (n_docs := documents_owning(owner)) is None:  # one row per document
        return proba
    return mean_over_documents(proba, owner, n_docs)


def _labels(clf: LogisticRegression, proba: np.ndarray) -> np.ndarray:
    """The label of highest probability per row of `_probabilities`."""
    return clf.classes_[np.argmax(proba, axis=1)]


def _check_labelled(what: str, n_train: int, train_y, n_val: int, val_y) -> None:
    """The checks on sizes and labels every tuned-on-validation baseline needs."""
    if n_train == 0:
        raise UserError(f"{what}: the training set is empty")
    if n_train != len(train_y) or n_val != len(val_y):
        raise UserError(
            f"{what}: inputs and labels differ in length "
            f"(train {n_train} vs {len(train_y)}, val {n_val} vs {len(val_y)})"
        )
    if n_val == 0:
        raise UserError(f"{what}: the validation set is empty, so nothing can be tuned")
    if len(np.unique(train_y)) < 2:
        raise UserError(f"{what}: the training set holds a single label; need at least 2")


def _check_features(what: str, train_x, train_y, val_x, val_y, eval_x, c_grid) -> None:
    shapes = {"train": np.shape(train_x), "val": np.shape(val_x)}
    shapes.update({name: np.shape(x) for name, x in eval_x.items()})
    # Only an empty set may come as a flat [] (shape (0,)); every other must be (n, dim).
    not_2d = {name: s for name, s in shapes.items() if len(s) != 2 and s[:1] != (0,)}
    if not_2d:
        raise UserError(f"{what}: features must be (n, dim) matrices, got shapes {not_2d}")
    _check_labelled(what, shapes["train"][0], train_y, shapes["val"][0], val_y)
    widths = {name: s[1:] for name, s in shapes.items() if name != "train" and s[0]}
    if any(w != shapes["train"][1:] for w in widths.values()):
        raise UserError(f"{what}: widths {widths} differ from training's {shapes['train'][1:]}")
    if not c_grid or min(c_grid) <= 0:
        raise UserError(f"{what}: the C grid must be non-empty positive values")
