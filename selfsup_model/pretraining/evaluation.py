"""Validation on the static masks: pooled over all batches, divided once, in float64.

Every function takes the export model (ids (B, L) -> logits (B, L, V)), so the
numbers logged during training can be recomputed later from
`pretrain_model.keras` and `val_masks.npz` alone.
"""

from __future__ import annotations

import math

import keras
import numpy as np

from selfsup_model.errors import UserError
from selfsup_model.nn.losses import WeightedLossAccumulator
from selfsup_model.text.specials import NUM_SPECIAL, PAD_ID
from selfsup_model.text.windows import causal_lm_batch

_DENSE = ("input_ids", "target_ids", "loss_weights")


def _check_masks(val_masks) -> int:
    missing = [k for k in _DENSE if k not in val_masks]
    if missing:
        raise UserError(f"validation masks lack {missing}; rerun the masks stage")
    n = len(val_masks["input_ids"])
    if n == 0:
        raise UserError("validation masks hold no sequences; the validation split is empty")
    return n


def _predict(model, ids: np.ndarray) -> np.ndarray:
    return np.asarray(model.predict_on_batch(ids), dtype=np.float32)


def _scored_logits(model, ids: np.ndarray, scored: np.ndarray, scored_only: bool) -> np.ndarray:
    """(N, V) logits at the N positions `scored` ((B, L) bool) marks. An export model's head
    runs on those positions' states alone (an MLM window scores about 1 position in 5, and
    the vocabulary projection is most of the work); `scored_only=False` takes them from the
    model's full (B, L, V) output instead, the same numbers by another route."""
    if scored_only and hasattr(model, "backbone") and hasattr(model, "head"):
        states = np.asarray(model.backbone.predict_on_batch(ids))[scored]  # (N, H)
        logits = model.head(states[None], training=False)  # (1, N, V)
        return np.asarray(keras.ops.convert_to_numpy(logits), dtype=np.float32)[0]
    return _predict(model, ids)[scored]


def _add_batch(acc: WeightedLossAccumulator, model, ids, targets, weights,
               scored_only: bool) -> None:
    weights = np.asarray(weights)
    scored = weights != 0  # (B, L)
    if not scored.any():
        acc.add(0.0, 0.0)
        return
    logits = _scored_logits(model, ids, scored, scored_only)  # (N, V)
    acc.add_batch(np.asarray(targets)[scored], logits, weights[scored])


def evaluate_masked_lm(export_model, val_masks, batch_size: int = 32,
                       scored_only: bool = True) -> dict[str, float]:
    """Masked-LM loss (token-weighted mean NLL), accuracy and scored tokens on the corrupted
    inputs (`scored_only`: see `_scored_logits`)."""
    n = _check_masks(val_masks)
    acc = WeightedLossAccumulator()
    for s in range(0, n, batch_size):
        ids = np.asarray(val_masks["input_ids"][s:s + batch_size], dtype=np.int32)  # (B, L)
        _add_batch(acc, export_model, ids, val_masks["target_ids"][s:s + batch_size],
                   val_masks["loss_weights"][s:s + batch_size], scored_only)
    return {"loss": acc.mean_loss, "accuracy": acc.accuracy, "scored_tokens": acc.weight_sum}


def evaluate_causal_lm(export_model, windows, batch_size: int = 32,
                       scored_only: bool = True) -> dict[str, float]:
    """Next-token NLL over real targets; perplexity = exp(token-weighted mean NLL)."""
    acc = WeightedLossAccumulator()
    for s in range(0, len(windows), batch_size):
        b = causal_lm_batch(np.asarray(windows[s:s + batch_size]))  # (B, L-1) each
        _add_batch(acc, export_model, b["input_ids"], b["target_ids"], b["loss_weights"],
                   scored_only)
    loss = acc.mean_loss
    return {"loss": loss, "perplexity": math.exp(loss) if math.isfinite(loss) else float("nan"),
            "scored_tokens": acc.weight_sum}


def validation_metrics(export_model, objective: str, val_masks,
                       batch_size: int) -> dict[str, float]:
    """The `val/...` metrics logged for the objective (never a perplexity for mlm)."""
    if objective == "mlm":
        r = evaluate_masked_lm(export_model, val_masks, batch_size)
        return {"val/mlm_loss": r["loss"], "val/mlm_accuracy": r["accuracy"],
                "val/scored_tokens": r["scored_tokens"]}
    _check_masks(val_masks)
    # target_ids hold the original (uncorrupted) windows at every position.
    r = evaluate_causal_lm(export_model, val_masks["target_ids"], batch_size)
    return {"val/clm_loss": r["loss"], "val/perplexity": r["perplexity"],
            "val/scored_tokens": r["scored_tokens"]}


def validation_unigram_loss(log_probs: np.ndarray, objective: str, val_masks) -> float:
    """The unigram model's loss on exactly the validation targets the objective scores."""
    _check_masks(val_masks)
    if objective == "mlm":
        return unigram_baseline_loss(log_probs, val_masks["target_ids"], val_masks["loss_weights"])
    b = causal_lm_batch(np.asarray(val_masks["target_ids"]))
    return unigram_baseline_loss(log_probs, b["target_ids"], b["loss_weights"])


def unigram_log_probs(windows, vocab_size: int, objective: str, chunk: int = 4096) -> np.ndarray:
    """(V,) float64 log-probabilities of the training split's add-one-smoothed unigram model.

    Counted over the tokens that can be targets: non-special ids for mlm; for
    clm every real id of the framing the causal batches use ([BOS]/[EOS]).
    """
    counts = np.zeros(vocab_size, dtype=np.float64)
    for start in range(0, len(windows), chunk):
        block = np.asarray(windows[start:start + chunk], dtype=np.int64)
        if objective == "clm":
            block = causal_lm_batch(block)["target_ids"]
            keep = block != PAD_ID
        else:
            keep = block >= NUM_SPECIAL
        counts += np.bincount(block[keep], minlength=vocab_size)[:vocab_size]
    if objective == "mlm":
        # Targets are never special, so the specials get no mass (smoothing included).
        counts[:NUM_SPECIAL] = -1.0
    counts += 1.0
    return np.log(counts / counts.sum(), where=counts > 0, out=np.full(vocab_size, -np.inf))


def unigram_baseline_loss(log_probs: np.ndarray, targets, weights) -> float:
    """Token-weighted cross-entropy of predicting `targets` with a fixed distribution."""
    weights = np.asarray(weights, dtype=np.float64)
    total = weights.sum()
    if total <= 0:
        return float("nan")
    return float(-(weights * np.where(weights != 0, log_probs[np.asarray(targets)], 0.0)).sum()
                 / total)
