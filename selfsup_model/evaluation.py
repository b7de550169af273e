"""Validation on the static masks: pooled over all batches, divided once, in float64.

Every function takes the export model (ids (B, L) -> logits (B, L, V)), so the
numbers logged during training can be recomputed later from
`pretrain_model.keras` and `val_masks.npz` alone.
"""

from __future__ import annotations

import math

import numpy as np

from selfsup_model.encoding import causal_lm_batch
from selfsup_model.errors import UserError
from selfsup_model.losses import WeightedLossAccumulator
from selfsup_model.pretrain_data import unigram_baseline_loss

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


def evaluate_masked_lm(export_model, val_masks, batch_size: int = 32) -> dict[str, float]:
    """Masked-LM loss (token-weighted mean NLL), accuracy and scored tokens on the corrupted inputs."""
    n = _check_masks(val_masks)
    acc = WeightedLossAccumulator()
    for s in range(0, n, batch_size):
        ids = np.asarray(val_masks["input_ids"][s:s + batch_size], dtype=np.int32)  # (B, L)
        logits = _predict(export_model, ids)  # (B, L, V)
        acc.add_batch(val_masks["target_ids"][s:s + batch_size], logits,
                      val_masks["loss_weights"][s:s + batch_size])
    return {"loss": acc.mean_loss, "accuracy": acc.accuracy, "scored_tokens": acc.weight_sum}


def evaluate_causal_lm(export_model, windows, batch_size: int = 32) -> dict[str, float]:
    """Next-token NLL over real targets; perplexity = exp(token-weighted mean NLL)."""
    acc = WeightedLossAccumulator()
    for s in range(0, len(windows), batch_size):
        b = causal_lm_batch(np.asarray(windows[s:s + batch_size]))  # (B, L-1) each
        acc.add_batch(b["target_ids"], _predict(export_model, b["input_ids"]), b["loss_weights"])
    loss = acc.mean_loss
    return {"loss": loss, "perplexity": math.exp(loss) if math.isfinite(loss) else float("nan"),
            "scored_tokens": acc.weight_sum}


def validation_metrics(export_model, objective: str, val_masks, batch_size: int) -> dict[str, float]:
    """The `val/...` metrics logged for the objective (never a perplexity for mlm)."""
    if objective == "mlm":
        r = evaluate_masked_lm(export_model, val_masks, batch_size)
        return {"val/mlm_loss": r["loss"], "val/mlm_accuracy": r["accuracy"],
                "val/scored_tokens": r["scored_tokens"]}
    _check_masks(val_masks)
    # target_ids hold the original (uncorrupted) windows at every position.
    r = evaluate_causal_lm(export_model, val_masks["target_ids"], batch_size)
    return {"val/clm_loss": r["loss"], "val/perplexity": r["perplexity"], "val/scored_tokens": r["scored_tokens"]}


def validation_unigram_loss(log_probs: np.ndarray, objective: str, val_masks) -> float:
    """The unigram model's loss on exactly the validation targets the objective scores."""
    _check_masks(val_masks)
    if objective == "mlm":
        return unigram_baseline_loss(log_probs, val_masks["target_ids"], val_masks["loss_weights"])
    b = causal_lm_batch(np.asarray(val_masks["target_ids"]))
    return unigram_baseline_loss(log_probs, b["target_ids"], b["loss_weights"])
