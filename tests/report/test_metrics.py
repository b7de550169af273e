import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import accuracy_score, confusion_matrix, f1_score

from selfsup_model.errors import UserError
from selfsup_model.report.metrics import (
    accuracy,
    bootstrap_ci,
    confusion,
    macro_f1,
    paired_bootstrap_diff,
)

label_pairs = st.integers(1, 60).flatmap(
    lambda n: st.tuples(
        st.lists(st.sampled_from("abcde"), min_size=n, max_size=n),
        st.lists(st.sampled_from("abcdef"), min_size=n, max_size=n),
    )
)


@settings(max_examples=60, deadline=None)
@given(label_pairs)
def test_macro_f1_and_accuracy_match_sklearn(pair):
    y_true, y_pred = pair
    assert macro_f1(y_true, y_pred) == pytest.approx(
        f1_score(y_true, y_pred, average="macro", zero_division=0)
    )
    assert accuracy(y_true, y_pred) == pytest.approx(accuracy_score(y_true, y_pred))


def test_macro_f1_hand_computed():
    # F1 = 2tp / (2tp + fp + fn). a: tp=1 fp=0 fn=1 -> 2/3; b: tp=1 fp=1 fn=1 -> 1/2;
    # c is only predicted: tp=0 fp=1 -> 0, and it counts (it is in y_true ∪ y_pred).
    y_true = ["a", "a", "b", "b"]
    y_pred = ["a", "b", "b", "c"]
    assert macro_f1(y_true, y_pred) == pytest.approx((2 / 3 + 0.5 + 0.0) / 3)


def test_confusion_matches_sklearn_and_rejects_unknown_labels():
    rng = np.random.default_rng(0)
    y_true, y_pred = rng.integers(0, 4, 100), rng.integers(0, 4, 100)
    labels = [3, 1, 0, 2]
    np.testing.assert_array_equal(
        confusion(y_true, y_pred, labels), confusion_matrix(y_true, y_pred, labels=labels)
    )
    with pytest.raises(UserError, match="not in `labels`"):
        confusion([0, 5], [0, 0], [0, 1])


def test_bootstrap_ci_contains_estimate_and_is_deterministic():
    rng = np.random.default_rng(1)
    y_true = rng.integers(0, 3, 300)
    y_pred = np.where(rng.random(300) < 0.7, y_true, rng.integers(0, 3, 300))
    for metric in (accuracy, macro_f1, "macro_f1"):
        low, high = bootstrap_ci(y_true, y_pred, metric, n=300, seed=4)
        point = metric(y_true, y_pred) if callable(metric) else macro_f1(y_true, y_pred)
        assert low <= point <= high
        assert 0.02 < high - low < 0.25  # about ±1.96 * sqrt(p(1-p)/n) ≈ ±0.05
        assert (low, high) == bootstrap_ci(y_true, y_pred, metric, n=300, seed=4)


def test_bootstrap_vectorised_path_equals_per_resample_loop():
    rng = np.random.default_rng(2)
    y_true, y_pred = rng.integers(0, 4, 50), rng.integers(0, 4, 50)

    def slow_macro_f1(t, p):  # not the registered function, so the generic loop runs
        return f1_score(t, p, average="macro", zero_division=0)

    fast = bootstrap_ci(y_true, y_pred, macro_f1, n=200, seed=9)
    slow = bootstrap_ci(y_true, y_pred, slow_macro_f1, n=200, seed=9)
    assert fast == pytest.approx(slow)


def test_clear_errors():
    with pytest.raises(UserError, match="empty"):
        accuracy([], [])
    with pytest.raises(UserError, match="3 labels but y_pred has 2"):
        macro_f1([1, 2, 3], [1, 2])
    with pytest.raises(UserError, match="unknown metric"):
        bootstrap_ci([1], [1], "auc", n=10, seed=0)


def test_paired_bootstrap_difference_by_hand():
    y = np.array(list("aabb"))
    perfect, all_a = y.copy(), np.array(list("aaaa"))
    # macro-F1(perfect) = 1; macro-F1(all "a") = (F1_a + F1_b)/2 = (2*2/(4+2) + 0)/2 = 1/3.
    diff, low, high = paired_bootstrap_diff(y, perfect, all_a, "macro_f1", n=500, seed=0)
    assert diff == pytest.approx(2 / 3)
    assert 0.0 <= low <= diff <= high <= 1.0  # a perfect predictor is never worse on any draw
    assert paired_bootstrap_diff(y, all_a, all_a, "macro_f1", n=50, seed=0) == (0.0, 0.0, 0.0)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("xyz"), st.sampled_from("xyz"), st.sampled_from("xyz")),
                min_size=2, max_size=40), st.integers(0, 2**16))
def test_paired_bootstrap_is_antisymmetric(rows, seed):
    y, a, b = (np.array(col) for col in zip(*rows))
    d1, lo1, hi1 = paired_bootstrap_diff(y, a, b, "accuracy", n=200, seed=seed)
    d2, lo2, hi2 = paired_bootstrap_diff(y, b, a, "accuracy", n=200, seed=seed)
    assert d1 == pytest.approx(-d2) and lo1 == pytest.approx(-hi2) and hi1 == pytest.approx(-lo2)
    assert lo1 <= hi1
