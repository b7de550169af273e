import numpy as np
import pytest
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression

from selfsup_model.config import BaselineConfig
from selfsup_model.errors import UserError
from selfsup_model.report.metrics import accuracy, macro_f1
from selfsup_model.transfer.baselines import (
    TfidfFeatures,
    logreg_on_features,
    majority_class,
    tfidf_grid,
    tfidf_logreg,
)

FILLER = ["alpha", "beta", "gamma", "delta", "omega", "sigma"]


def order_corpus(n, seed):
    """Both classes use the same words; only the order 'red blue' vs 'blue red' tells them apart.

    Unigram features cannot separate the classes, bigrams can, so validation
    must pick ngram_max = 2.
    """
    rng = np.random.default_rng(seed)
    texts, labels = [], []
    for i in range(n):
        label = "fwd" if i % 2 else "rev"
        pair = "red blue" if label == "fwd" else "blue red"
        words = list(rng.choice(FILLER, 3))
        texts.append(" ".join(words[:2] + [pair] + words[2:]))
        labels.append(label)
    return texts, np.array(labels)


# The word path (character features have tests of their own below).
CFG = BaselineConfig(tfidf_c=(0.1, 10.0), tfidf_ngram_max=(1, 2), tfidf_features=("word",))


def test_tfidf_picks_params_by_validation_only():
    train_x, train_y = order_corpus(60, 0)
    val_x, val_y = order_corpus(20, 1)
    test_a, _ = order_corpus(20, 2)
    test_b = ["completely unrelated words here"] * 7
    a = tfidf_logreg(train_x, train_y, val_x, val_y, {"test": test_a}, CFG)
    b = tfidf_logreg(train_x, train_y, val_x, val_y, {"test": test_b}, CFG)
    # The eval texts are unlabelled and play no part in the choice.
    assert a.params == b.params and a.grid == b.grid and a.val_macro_f1 == b.val_macro_f1
    assert a.params["ngram_max"] == 2
    assert all(g["val_macro_f1"] < 0.8 for g in a.grid if g["ngram_max"] == 1)
    assert len(a.grid) == 4 and len(b.predictions["test"]) == 7
    # The chosen point is the grid's best validation score, recomputed independently.
    best = max(a.grid, key=lambda g: g["val_macro_f1"])
    assert a.val_macro_f1 == best["val_macro_f1"] == pytest.approx(1.0)
    vec = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True).fit(train_x)
    clf = LogisticRegression(C=a.params["C"], solver="saga", max_iter=1000, random_state=0)
    clf.fit(vec.transform(train_x), train_y)
    np.testing.assert_array_equal(a.predictions["test"], clf.predict(vec.transform(test_a)))
    assert macro_f1(val_y, a.val_predictions) == a.val_macro_f1
    assert a.fit_time_s > 0


def test_tfidf_ties_go_to_the_simpler_model():
    train_x = ["apple pie sweet", "apple tart sweet", "salt fish sea", "salt cod sea"]
    train_y = ["sweet", "sweet", "salty", "salty"]
    val_x, val_y = ["apple cake", "salt pork"], ["sweet", "salty"]
    result = tfidf_logreg(train_x, train_y, val_x, val_y, {}, CFG)
    # every grid point is perfect here
    assert result.params == {"C": 0.1, "ngram_max": 1, "features": "word", "sublinear_tf": True}


def test_tfidf_clear_errors():
    with pytest.raises(UserError, match="single label"):
        tfidf_logreg(["aa bb", "cc dd"], ["x", "x"], ["aa"], ["x"], {}, CFG)
    with pytest.raises(UserError, match="training set is empty"):
        tfidf_logreg([], [], ["aa"], ["x"], {}, CFG)
    with pytest.raises(UserError, match="vocabulary"):
        tfidf_logreg(["!", "?"], ["x", "y"], ["aa"], ["x"], {}, CFG)


def suffix_corpus(n, seed):
    """Each document is words never seen elsewhere, whose endings tell the class: a word
    vocabulary learns nothing that carries to new documents, character n-grams do."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghilmnoprstu"))
    texts, labels = [], []
    for i in range(n):
        label = "q" if i % 2 else "w"
        ending = "qzv" if label == "q" else "wjk"
        words = ["".join(rng.choice(letters, 6)) + ending for _ in range(3)]
        texts.append(" ".join(words))
        labels.append(label)
    return texts, np.array(labels)


def test_the_grid_runs_simplest_first_and_character_features_win_where_they_read_better():
    cfg = BaselineConfig(tfidf_c=(1.0, 10.0), tfidf_ngram_max=(1, 2),
                         tfidf_sublinear=(False, True), tfidf_features=("char", "word"))
    assert tfidf_grid(cfg) == [
        {"features": "word", "sublinear_tf": True, "ngram_max": 1},
        {"features": "word", "sublinear_tf": False, "ngram_max": 1},
        {"features": "word", "sublinear_tf": True, "ngram_max": 2},
        {"features": "word", "sublinear_tf": False, "ngram_max": 2},
        {"features": "char", "sublinear_tf": True},
        {"features": "char", "sublinear_tf": False}]
    train_x, train_y = suffix_corpus(40, 0)
    val_x, val_y = suffix_corpus(20, 1)
    result = tfidf_logreg(train_x, train_y, val_x, val_y, {}, cfg)
    assert result.params["features"] == "char" and result.val_macro_f1 == pytest.approx(1.0)
    assert result.model.solver == "newton-cg"  # character rows: Newton-CG (tfidf_solver)
    assert max(g["val_macro_f1"] for g in result.grid if g["features"] == "word") < 0.8
    assert len(result.grid) == 6 * 2


def test_word_and_character_features_sit_side_by_side():
    texts = ["alpha betaqzv", "gammawjk delta"]
    both = TfidfFeatures("word+char", ngram_max=1).fit(texts)
    word, char = TfidfFeatures("word", ngram_max=1).fit(texts), TfidfFeatures("char").fit(texts)
    rows = both.transform(texts).toarray()
    np.testing.assert_allclose(rows, np.hstack([word.transform(texts).toarray(),
                                                char.transform(texts).toarray()]))
    assert both.transform([]).shape == (0, rows.shape[1])


def test_majority_class():
    np.testing.assert_array_equal(majority_class(["b", "a", "b", "c"], 3), ["b", "b", "b"])
    # A tie resolves to the smallest label, deterministically.
    np.testing.assert_array_equal(majority_class([2, 1, 1, 2], 2), [1, 1])
    with pytest.raises(UserError, match="non-empty"):
        majority_class([], 3)


def test_tfidf_is_logreg_on_features_at_the_chosen_ngram_range():
    train_x, train_y = order_corpus(60, 0)
    val_x, val_y = order_corpus(20, 1)
    test_x, _ = order_corpus(20, 2)
    a = tfidf_logreg(train_x, train_y, val_x, val_y, {"test": test_x, "none": []}, CFG)
    vec = TfidfVectorizer(ngram_range=(1, a.params["ngram_max"]), sublinear_tf=True).fit(train_x)
    b = logreg_on_features(vec.transform(train_x), train_y, vec.transform(val_x), val_y,
                           {"test": vec.transform(test_x)}, CFG.tfidf_c)
    word2 = {"features": "word", "sublinear_tf": True, "ngram_max": 2}
    assert a.params == {**b.params, **word2} and a.val_macro_f1 == b.val_macro_f1
    assert a.model.solver == b.model.solver == "saga"  # word rows stay with saga
    assert [g for g in a.grid if g["ngram_max"] == 2] == [{**g, **word2} for g in b.grid]
    np.testing.assert_array_equal(a.val_predictions, b.val_predictions)
    np.testing.assert_array_equal(a.predictions["test"], b.predictions["test"])
    assert a.predictions["none"].shape == (0,) and a.predictions["none"].dtype == train_y.dtype


# ---------------------------------------------------------------- logistic regression on features


def probe_data(seed=0):
    """Two overlapping Gaussian blobs in 6 dims: close enough that C changes the val score."""
    rng = np.random.default_rng(seed)

    def blob(n):
        y = np.arange(n) % 2
        return rng.normal(size=(n, 6)) + y[:, None] * np.array([1.5, -1.5, 0, 0, 0, 0]), y

    return blob(40), blob(30), blob(20)


def test_logreg_on_features_selects_c_on_validation_only():
    (tr, tr_y), (va, va_y), (te, te_y) = probe_data()
    grid = (0.001, 0.1, 10.0)
    a = logreg_on_features(tr, tr_y, va, va_y, {"test": te}, grid)
    b = logreg_on_features(tr, tr_y, va, va_y, {"test": te[:3] * 100.0, "other": te[::-1]}, grid)
    assert a.params == b.params and a.grid == b.grid
    scores = [g["val_macro_f1"] for g in a.grid]
    assert [g["C"] for g in a.grid] == sorted(grid) and len(set(scores)) > 1  # C matters here
    # The first (smallest) C with the best validation score, whatever the eval sets hold.
    assert a.params["C"] == sorted(grid)[scores.index(max(scores))]
    assert a.val_macro_f1 == max(scores)
    assert a.predictions["test"].shape == (20,) and set(a.predictions) == {"test"}
    assert accuracy(te_y, a.predictions["test"]) > 0.6
    np.testing.assert_array_equal(b.predictions["other"], a.predictions["test"][::-1])
    clf = LogisticRegression(C=a.params["C"], solver="newton-cg", max_iter=1000).fit(tr, tr_y)
    np.testing.assert_array_equal(a.val_predictions, clf.predict(va))
    assert a.fit_time_s > 0


def test_logreg_on_features_tie_keeps_smaller_c_and_rejects_bad_input():
    (tr, tr_y), _, _ = probe_data()
    # Validation = training blobs far apart: every C scores 1.0, so the smallest must win.
    far = tr + tr_y[:, None] * 50.0
    assert logreg_on_features(far, tr_y, far, tr_y, {}, (10.0, 1.0)).params == {"C": 1.0}
    with pytest.raises(UserError, match="sentence probe: the training set holds a single label"):
        logreg_on_features(tr, np.zeros(40, int), tr, tr_y, {}, (1.0,), what="sentence probe")
    with pytest.raises(UserError, match="widths"):
        logreg_on_features(tr, tr_y, tr[:, :3], tr_y, {}, (1.0,))
    with pytest.raises(UserError, match="widths"):
        logreg_on_features(tr, tr_y, tr, tr_y, {"test": tr[:, :3]}, (1.0,))
    with pytest.raises(UserError, match="validation set is empty"):
        logreg_on_features(tr, tr_y, tr[:0], tr_y[:0], {}, (1.0,))
    with pytest.raises(UserError, match="differ in length"):
        logreg_on_features(tr, tr_y[:-1], tr, tr_y, {}, (1.0,))
    with pytest.raises(UserError, match="C grid"):
        logreg_on_features(tr, tr_y, tr, tr_y, {}, ())
    with pytest.raises(UserError, match=r"\(n, dim\)"):
        logreg_on_features(tr[:, 0], tr_y, tr, tr_y, {}, (1.0,))
    # An empty eval set is fine: it gets an empty prediction of the labels' dtype.
    empty = logreg_on_features(tr, tr_y, tr, tr_y, {"none": []}, (1.0,)).predictions["none"]
    assert empty.shape == (0,) and empty.dtype == tr_y.dtype


def test_logreg_predicts_a_document_from_the_mean_probability_of_its_rows():
    # 1-D features, "a" below zero and "b" above. Validation document 0 owns one row that is
    # clearly "a" and two that lean "b": its mean probability says "a", though most rows (and
    # its last) say "b". Document 1 owns one row.
    train_x = np.array([[-2.0], [-1.0], [1.0], [2.0]])
    train_y = ["a", "a", "b", "b"]
    val_x = np.array([[-10.0], [0.2], [0.2], [3.0]])
    owner = np.array([0, 0, 0, 1])
    res = logreg_on_features(train_x, train_y, val_x, ["a", "b"], {"test": val_x}, (1.0,),
                             val_owner=owner, eval_owners={"test": owner})
    p_b = res.model.predict_proba(val_x)[:, 1]
    assert p_b[0] < 0.01 and 0.5 < p_b[1] < 0.75  # the rows vote b, b over a ...
    assert res.model.predict(val_x).tolist() == ["a", "b", "b", "b"]
    assert res.predictions["test"].tolist() == ["a", "b"]  # ... the mean says a
    assert res.val_predictions.tolist() == ["a", "b"] and res.val_macro_f1 == 1.0


def test_mlflow_gets_the_numeric_selections_and_the_report_the_named_ones():
    from selfsup_model.transfer.protocol import summary_metrics

    summary = {"method": "tfidf_logreg", "fraction": 0.05, "val_macro_f1": 0.5,
               "params": {"C": 10.0, "ngram_max": 2, "features": "char", "sublinear_tf": False}}
    key = "tfidf_logreg/fraction_0.05/"
    assert summary_metrics([summary]) == {f"{key}val_macro_f1": 0.5, f"{key}selected_C": 10.0,
                                          f"{key}selected_ngram_max": 2.0,
                                          f"{key}selected_sublinear_tf": 0.0}


class _RightFirst:
    """A stand-in classifier whose C decides how many validation rows it gets right: the rows
    whose number (column 1) is below `right[C]` get their class (column 0), the rest the other."""

    def __init__(self, right: dict[float, int], c: float):
        self.k = right[c]

    def fit(self, x, y):
        self.classes_ = np.unique(y)
        return self

    def predict_proba(self, x):
        true = x[:, 0].astype(int)
        return np.eye(2)[np.where(x[:, 1] < self.k, true, 1 - true)]


@pytest.mark.parametrize(("right", "grid", "chosen", "tried"), [
    # the top of the grid wins, and so does each step past it: the bound (2 steps here) stops it
    ({0.1: 2, 1.0: 4, 10.0: 6, 100.0: 8, 1000.0: 10}, (0.1, 1.0, 10.0), 1000.0,
     (0.1, 1.0, 10.0, 100.0, 1000.0)),
    # one step past the top wins, the next loses: the choice has neighbours on both sides
    ({0.1: 2, 1.0: 4, 10.0: 6, 100.0: 10, 1000.0: 8}, (0.1, 1.0, 10.0), 100.0,
     (0.1, 1.0, 10.0, 100.0, 1000.0)),
    # the bottom wins; a tie one step further goes to the smaller C, as everywhere
    ({0.001: 10, 0.01: 10, 0.1: 8, 1.0: 6, 10.0: 4}, (0.1, 1.0, 10.0), 0.001,
     (0.001, 0.01, 0.1, 1.0, 10.0)),
    # inside the grid: nothing more is fitted
    ({0.1: 2, 1.0: 10, 10.0: 6}, (0.1, 1.0, 10.0), 1.0, (0.1, 1.0, 10.0)),
    # two values are a fixed pair, not a search: never widened
    ({1.0: 4, 10.0: 6}, (1.0, 10.0), 10.0, (1.0, 10.0)),
])
def test_a_c_search_widens_past_the_end_it_chose(monkeypatch, right, grid, chosen, tried):
    from selfsup_model.transfer import baselines

    monkeypatch.setattr(baselines, "logistic_regression", lambda c, *_: _RightFirst(right, c))
    monkeypatch.setattr(baselines, "EDGE_STEPS", 2)  # the bound, small enough to write out
    x = np.stack([np.arange(10) % 2, np.arange(10)], axis=1).astype(float)
    y = np.arange(10) % 2
    res = logreg_on_features(x, y, x, y, {}, grid)
    assert res.params == {"C": chosen} and res.c_tried == tried
    # By hand: with the first k of 10 alternating rows right, each class has k/2 true
    # positives, (10 - k)/2 false positives and as many false negatives: F1 = k / 10.
    assert {g["C"]: g["val_macro_f1"] for g in res.grid} == pytest.approx(
        {c: right[c] / 10 for c in tried})
    assert sorted(g["C"] for g in res.grid) == list(tried)
    assert all(g.get("widened", False) == (g["C"] not in grid) for g in res.grid)
    assert res.val_macro_f1 == pytest.approx(right[chosen] / 10)


def test_the_widening_bound_is_four_steps_per_end(monkeypatch):
    from selfsup_model.transfer import baselines

    # every larger C gets one more row right: the search runs until the bound stops it
    right = {10.0 ** e: 2 * (e + 2) for e in range(-1, 8)}  # of 20 rows: F1 = k / 20, rising
    monkeypatch.setattr(baselines, "logistic_regression", lambda c, *_: _RightFirst(right, c))
    x = np.stack([np.arange(20) % 2, np.arange(20)], axis=1).astype(float)
    res = logreg_on_features(x, np.arange(20) % 2, x, np.arange(20) % 2, {}, (0.1, 1.0, 10.0))
    assert res.c_tried == (0.1, 1.0, 10.0, 100.0, 1000.0, 1e4, 1e5)  # 4 steps past 10
    assert res.params == {"C": 1e5} and res.val_macro_f1 == pytest.approx(14 / 20)
