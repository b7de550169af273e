"""Token-weighted cross-entropy: hand-computed values, invariance to unscored positions, pooling."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from keras import ops

from selfsup_model.nn.losses import (
    TokenWeightedLoss,
    WeightedLossAccumulator,
    numpy_weighted_ce_sum,
    token_weighted_loss,
)

LN2, LN4 = math.log(2.0), math.log(4.0)


def _logits_from_probs(probs: np.ndarray) -> np.ndarray:
    # log-probabilities are valid logits: softmax(log p) = p exactly.
    return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


def _two_scored_of_eight():
    """8 positions, V = 4; position 1 gives the target p = 0.5, position 5 gives p = 0.25."""
    probs = np.full((1, 8, 4), 0.25)
    probs[0, 1] = [0.5, 0.2, 0.2, 0.1]
    probs[0, 5] = [0.25, 0.25, 0.25, 0.25]
    targets = np.zeros((1, 8), dtype=np.int32)
    weights = np.zeros((1, 8), dtype=np.float32)
    weights[0, [1, 5]] = 1.0
    return targets, _logits_from_probs(probs), weights


def test_two_scored_tokens_average_over_scored_not_all_positions():
    targets, logits, weights = _two_scored_of_eight()
    expected = (LN2 + LN4) / 2  # 1.03972
    loss = float(ops.convert_to_numpy(token_weighted_loss(targets, logits, weights)))
    assert loss == pytest.approx(expected, abs=1e-6)
    assert loss == pytest.approx(1.03972, abs=1e-5)
    assert abs(loss - (LN2 + LN4) / 8) > 0.7  # the divide-by-all-positions answer, 0.25993
    loss_sum, weight_sum = numpy_weighted_ce_sum(targets, logits, weights)
    assert weight_sum == 2.0
    assert loss_sum / weight_sum == pytest.approx(expected, abs=1e-6)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), extra=st.integers(0, 6), scale=st.floats(0.1, 50.0))
def test_unscored_positions_never_change_the_loss(seed, extra, scale):
    rng = np.random.default_rng(seed)
    b, p, v = 2, 5, 7
    targets = rng.integers(0, v, size=(b, p)).astype(np.int32)
    logits = (rng.normal(size=(b, p, v)) * scale).astype(np.float32)
    weights = (rng.random((b, p)) < 0.5).astype(np.float32)
    weights[0, 0] = 1.0  # at least one scored token
    base = float(ops.convert_to_numpy(token_weighted_loss(targets, logits, weights)))

    # Rewrite every unscored position (targets and logits) and append `extra` padding slots.
    free = weights == 0
    targets2 = np.where(free, rng.integers(0, v, size=(b, p)), targets).astype(np.int32)
    logits2 = np.where(free[..., None], rng.normal(size=(b, p, v)) * 1e3, logits).astype(np.float32)
    pad_t = rng.integers(0, v, size=(b, extra)).astype(np.int32)
    pad_l = (rng.normal(size=(b, extra, v)) * 1e3).astype(np.float32)
    targets2 = np.concatenate([targets2, pad_t], axis=1)
    logits2 = np.concatenate([logits2, pad_l], axis=1)
    weights2 = np.concatenate([weights, np.zeros((b, extra), np.float32)], axis=1)
    moved = float(ops.convert_to_numpy(token_weighted_loss(targets2, logits2, weights2)))
    assert moved == pytest.approx(base, rel=1e-6, abs=1e-6)
    s1, w1 = numpy_weighted_ce_sum(targets, logits, weights)
    s2, w2 = numpy_weighted_ce_sum(targets2, logits2, weights2)
    assert (s2, w2) == pytest.approx((s1, w1), rel=1e-12)
    assert s1 / w1 == pytest.approx(base, rel=1e-5)


def test_zero_weight_batch_gives_zero_not_nan_and_is_counted():
    targets = np.zeros((2, 3), np.int32)
    logits = np.zeros((2, 3, 5), np.float32)
    logits[0, 0, 0] = -np.inf  # even an infinite ce at an unscored position must not leak
    weights = np.zeros((2, 3), np.float32)
    loss = float(ops.convert_to_numpy(token_weighted_loss(targets, logits, weights)))
    assert loss == 0.0
    metric = TokenWeightedLoss(name="mlm_loss")
    metric.update_state(0.0, 0.0)
    metric.update_state(2.0, 4.0)
    result = {k: float(ops.convert_to_numpy(v)) for k, v in metric.result().items()}
    assert result == {"mlm_loss": 0.5, "mlm_loss_sum": 2.0, "scored_tokens": 4.0,
                      "empty_batches": 1.0}


def test_pooled_evaluation_is_not_a_mean_of_batch_means():
    # Batch A scores 1 token at p = 0.5; batch B scores 3 tokens at p = 0.25.
    acc = WeightedLossAccumulator()
    a = np.array([[[0.5, 0.5]]])  # (1, 1, 2)
    acc.add_batch(np.array([[0]]), _logits_from_probs(a), np.array([[1.0]]))
    b = np.tile(np.array([[0.25, 0.75]]), (1, 4, 1))  # (1, 4, 2), last slot unscored
    acc.add_batch(np.array([[0, 0, 0, 1]]), _logits_from_probs(b), np.array([[1.0, 1.0, 1.0, 0.0]]))
    pooled = (LN2 + 3 * LN4) / 4  # 1.21301
    mean_of_means = (LN2 + LN4) / 2  # 1.03972
    assert acc.weight_sum == 4.0
    assert acc.mean_loss == pytest.approx(pooled, abs=1e-6)
    assert abs(acc.mean_loss - mean_of_means) > 0.15
    assert acc.accuracy == pytest.approx(0.25)  # only batch A's argmax (a tie -> index 0) hits


def test_empty_accumulator_is_nan_not_a_division_error():
    acc = WeightedLossAccumulator()
    acc.add_batch(np.zeros((1, 2), np.int32), np.zeros((1, 2, 3), np.float32), np.zeros((1, 2)))
    assert acc.empty_batches == 1
    assert math.isnan(acc.mean_loss)


def test_numpy_and_keras_losses_agree_and_are_stable_for_large_logits():
    rng = np.random.default_rng(0)
    targets = rng.integers(0, 11, size=(3, 6)).astype(np.int32)
    logits = (rng.normal(size=(3, 6, 11)) * 300).astype(np.float32)  # naive exp overflows
    weights = rng.random((3, 6)).astype(np.float32)
    s, w = numpy_weighted_ce_sum(targets, logits, weights)
    assert np.isfinite(s)
    keras_loss = float(ops.convert_to_numpy(token_weighted_loss(targets, logits, weights)))
    assert keras_loss == pytest.approx(s / w, rel=1e-5)
