"""Token-weighted cross-entropy: sum(w * ce) / sum(w), never a mean over all positions.

Keras' built-in loss reductions divide by the element count, which makes the
loss (and the gradient scale) depend on how many padded or unscored positions
a batch happens to hold. Everything here divides by the scored-token count,
explicitly, once.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import ops

from selfsup_model.nn.saving import serializable


def weighted_ce_parts(targets, logits, weights):
    """(sum(w * ce), sum(w)) as float32 scalars; targets/weights (B, P), logits (B, P, V)."""
    logits = ops.cast(logits, "float32")
    ce = ops.sparse_categorical_crossentropy(targets, logits, from_logits=True)  # (B, P)
    weights = ops.cast(weights, "float32")
    # Zero-weight positions contribute exactly 0, even if their ce were inf or NaN.
    ce = ops.where(weights != 0, ce, ops.zeros_like(ce))
    return ops.sum(weights * ce), ops.sum(weights)


def weighted_bce_parts(targets, logits, weights):
    """(sum(w * bce), sum(w)) as float32 scalars; targets (0/1), logits, weights all (B, L)."""
    logits = ops.cast(logits, "float32")
    bce = ops.binary_crossentropy(ops.cast(targets, "float32"), logits, from_logits=True)
    weights = ops.cast(weights, "float32")
    bce = ops.where(weights != 0, bce, ops.zeros_like(bce))
    return ops.sum(weights * bce), ops.sum(weights)


def safe_divide(numerator, denominator):
    """numerator / denominator, and 0 where the denominator is 0 (an unscored batch)."""
    positive = denominator > 0
    return ops.where(positive, numerator / ops.where(positive, denominator, 1.0), 0.0)


def token_weighted_loss(targets, logits, weights, metric: TokenWeightedLoss | None = None):
    """sum(w * ce) / sum(w); a batch with sum(w) = 0 gives 0, not NaN (and no gradient).

    This is the loss pretraining optimises (`PretrainingModel.compute_loss`).
    With `metric`, the batch's two sums are also added to that running
    `TokenWeightedLoss`, so reports can pool batches and divide once.
    """
    loss_sum, weight_sum = weighted_ce_parts(targets, logits, weights)
    if metric is not None:
        metric.update_state(loss_sum, weight_sum)
    return safe_divide(loss_sum, weight_sum)


def token_weighted_bce(targets, logits, weights, metric: TokenWeightedLoss | None = None):
    """sum(w * bce) / sum(w) of per-token binary predictions (replaced-token detection's
    loss), 0 for a batch with nothing scored; with `metric`, its two sums are added there."""
    loss_sum, weight_sum = weighted_bce_parts(targets, logits, weights)
    if metric is not None:
        metric.update_state(loss_sum, weight_sum)
    return safe_divide(loss_sum, weight_sum)


@serializable
class TokenWeightedLoss(keras.metrics.Metric):
    """Accumulates loss*weight and weight (and unscored batches) between resets.

    `result()` reports the running sums as well as their ratio so a callback
    can take differences between two reports and divide once, whatever the
    number of steps in between (Keras' own `loss` is a mean of batch means).
    """

    def __init__(self, name: str = "token_loss", counts_prefix: str = "", **kwargs):
        super().__init__(name=name, **kwargs)
        # A second loss of one model reports its counts under its own names.
        self.counts_prefix = counts_prefix
        self.loss_sum = self.add_variable((), initializer="zeros", name="loss_sum")
        self.weight_sum = self.add_variable((), initializer="zeros", name="weight_sum")
        self.empty_batches = self.add_variable((), initializer="zeros", name="empty_batches")

    def update_state(self, loss_sum, weight_sum):
        self.loss_sum.assign_add(ops.cast(loss_sum, self.dtype))
        self.weight_sum.assign_add(ops.cast(weight_sum, self.dtype))
        self.empty_batches.assign_add(ops.cast(weight_sum <= 0, self.dtype))

    def result(self):
        loss_sum, weight_sum = (ops.convert_to_tensor(self.loss_sum),
                                ops.convert_to_tensor(self.weight_sum))
        return {
            self.name: safe_divide(loss_sum, weight_sum),
            f"{self.name}_sum": loss_sum,
            f"{self.counts_prefix}scored_tokens": weight_sum,
            f"{self.counts_prefix}empty_batches": ops.convert_to_tensor(self.empty_batches),
        }

    def get_config(self):
        return {**super().get_config(), "counts_prefix": self.counts_prefix}

    def reset_state(self):
        for variable in (self.loss_sum, self.weight_sum, self.empty_batches):
            variable.assign(ops.zeros((), dtype=self.dtype))


# ----------------------------------------------------------------------------- numpy (evaluation)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = np.asarray(logits, dtype=np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def numpy_weighted_ce_sum(targets, logits, weights) -> tuple[float, float]:
    """(sum(w * ce), sum(w)) in float64 with a stable log-softmax; logits (..., V)."""
    weights = np.asarray(weights, dtype=np.float64)
    scored = weights != 0
    if not scored.any():
        return 0.0, 0.0
    # Only scored rows go through the softmax: most positions of a (B, L, V) block are not.
    log_probs = _log_softmax(np.asarray(logits)[scored])  # (N, V)
    picked = log_probs[np.arange(log_probs.shape[0]), np.asarray(targets)[scored]]
    return float(-(weights[scored] * picked).sum()), float(weights[scored].sum())


def numpy_weighted_correct(targets, logits, weights) -> float:
    """sum(w * [argmax == target]) for token accuracy."""
    weights = np.asarray(weights, dtype=np.float64)
    scored = weights != 0
    if not scored.any():
        return 0.0
    hit = np.asarray(logits)[scored].argmax(axis=-1) == np.asarray(targets)[scored]
    return float((weights[scored] * hit).sum())


class WeightedLossAccumulator:
    """Pools sum(w * ce), sum(w * correct) and sum(w) over batches; divides once at the end."""

    def __init__(self) -> None:
        self.loss_sum = 0.0
        self.correct_sum = 0.0
        self.weight_sum = 0.0
        self.batches = 0
        self.empty_batches = 0

    def add(self, loss_sum: float, weight_sum: float, correct_sum: float = 0.0) -> None:
        self.loss_sum += float(loss_sum)
        self.weight_sum += float(weight_sum)
        self.correct_sum += float(correct_sum)
        self.batches += 1
        self.empty_batches += int(weight_sum <= 0)

    def add_batch(self, targets, logits, weights) -> None:
        loss_sum, weight_sum = numpy_weighted_ce_sum(targets, logits, weights)
        self.add(loss_sum, weight_sum, numpy_weighted_correct(targets, logits, weights))

    @property
    def mean_loss(self) -> float:
        """Token-weighted mean; NaN when nothing was scored (an undefined mean, not 0)."""
        return self.loss_sum / self.weight_sum if self.weight_sum > 0 else float("nan")

    @property
    def accuracy(self) -> float:
        return self.correct_sum / self.weight_sum if self.weight_sum > 0 else float("nan")


def paired_info_nce(pooled, temperature: float):
    """Symmetric InfoNCE over (2N, H) vectors whose rows 2i and 2i+1 are a positive pair.

    Each row is L2-normalised; the N x N cosine similarities of the even rows against the odd
    ones, over `temperature`, are scored with cross-entropy towards the diagonal, both ways,
    and averaged: log(N) at chance, 0 when every pair is told apart from the rest. In
    float32 whatever the compute dtype.
    """
    z = ops.cast(pooled, "float32")
    z = z / ops.maximum(ops.sqrt(ops.sum(z * z, axis=-1, keepdims=True)), 1e-6)
    pairs = ops.reshape(z, (-1, 2, ops.shape(z)[-1]))  # (N, 2, H)
    logits = ops.matmul(pairs[:, 0], ops.transpose(pairs[:, 1])) / temperature  # (N, N)
    target = ops.arange(ops.shape(logits)[0])
    forward = ops.sparse_categorical_crossentropy(target, logits, from_logits=True)
    backward = ops.sparse_categorical_crossentropy(target, ops.transpose(logits),
                                                   from_logits=True)
    return 0.5 * (ops.mean(forward) + ops.mean(backward))
