import numpy as np
import pytest
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression

from selfsup_model.baselines import majority_class, tfidf_logreg
from selfsup_model.config import BaselineConfig
from selfsup_model.errors import UserError
from selfsup_model.metrics import macro_f1

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


CFG = BaselineConfig(tfidf_c=(0.1, 10.0), tfidf_ngram_max=(1, 2))


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
    clf = LogisticRegression(C=a.params["C"], max_iter=2000).fit(vec.transform(train_x), train_y)
    np.testing.assert_array_equal(a.predictions["test"], clf.predict(vec.transform(test_a)))
    assert macro_f1(val_y, a.val_predictions) == a.val_macro_f1
    assert a.fit_time_s > 0


def test_tfidf_ties_go_to_the_simpler_model():
    train_x = ["apple pie sweet", "apple tart sweet", "salt fish sea", "salt cod sea"]
    train_y = ["sweet", "sweet", "salty", "salty"]
    val_x, val_y = ["apple cake", "salt pork"], ["sweet", "salty"]
    result = tfidf_logreg(train_x, train_y, val_x, val_y, {}, CFG)
    assert result.params == {"C": 0.1, "ngram_max": 1}  # every grid point is perfect here


def test_tfidf_clear_errors():
    with pytest.raises(UserError, match="single label"):
        tfidf_logreg(["aa bb", "cc dd"], ["x", "x"], ["aa"], ["x"], {}, CFG)
    with pytest.raises(UserError, match="training set is empty"):
        tfidf_logreg([], [], ["aa"], ["x"], {}, CFG)
    with pytest.raises(UserError, match="vocabulary"):
        tfidf_logreg(["!", "?"], ["x", "y"], ["aa"], ["x"], {}, CFG)


def test_majority_class():
    np.testing.assert_array_equal(majority_class(["b", "a", "b", "c"], 3), ["b", "b", "b"])
    # A tie resolves to the smallest label, deterministically.
    np.testing.assert_array_equal(majority_class([2, 1, 1, 2], 2), [1, 1])
    with pytest.raises(UserError, match="non-empty"):
        majority_class([], 3)
