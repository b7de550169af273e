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
    if scored_only and hasattr(model, "generator"):  # rtd: the generator's masked-LM logits
        states = keras.ops.convert_to_numpy(model.generator.states(ids, training=False))[scored]
        logits = model.generator.head(states[None], training=False)  # (1, N, V)
        return np.asarray(keras.ops.convert_to_numpy(logits), dtype=np.float32)[0]
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


def detection_corruption(val_masks, log_probs: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """The stored corruption replaced-token detection is validated on: each validation window
    (the masks' `target_ids`, the original tokens) with every position the static masks select
    replaced by a draw from the training split's unigram model (`unigram_log_probs` for the
    masked LM: no special token is ever drawn), seeded. The generator's samples change as it
    trains; these do not, so the discriminator's validation numbers compare across steps and
    runs. Returns input_ids (n, L) int32, replaced (n, L) float32 (1 where the token differs
    from the original: a draw equal to it is not a replacement) and weights (n, L) float32 (1
    on the real, non-special tokens of the original: the tokens the loss counts)."""
    _check_masks(val_masks)
    original = np.asarray(val_masks["target_ids"], dtype=np.int32)
    selected = np.asarray(val_masks["loss_weights"]) > 0
    probs = np.exp(log_probs)
    draws = np.random.default_rng(seed).choice(len(probs), size=int(selected.sum()),
                                               p=probs / probs.sum())
    ids = original.copy()
    ids[selected] = draws
    return {"input_ids": ids, "replaced": (ids != original).astype(np.float32),
            "weights": (original >= NUM_SPECIAL).astype(np.float32)}


def numpy_weighted_bce_sum(targets, logits, weights) -> tuple[float, float, float]:
    """(sum(w * bce), sum(w * [correct]), sum(w)) in float64 for binary logits, stably:
    bce = max(x, 0) - x * z + log(1 + exp(-|x|)); a logit > 0 predicts 1."""
    x = np.asarray(logits, dtype=np.float64)
    z, w = np.asarray(targets, dtype=np.float64), np.asarray(weights, dtype=np.float64)
    bce = np.maximum(x, 0.0) - x * z + np.log1p(np.exp(-np.abs(x)))
    correct = (x > 0) == (z > 0.5)
    return float((w * bce).sum()), float((w * correct).sum()), float(w.sum())


def evaluate_detection(export_model, corruption, batch_size: int = 32) -> dict[str, float]:
    """The discriminator on a stored corruption (`detection_corruption`): token-weighted binary
    cross-entropy, accuracy, the tokens scored and the share of them that were replaced."""
    acc, replaced = WeightedLossAccumulator(), 0.0
    n = len(corruption["input_ids"])
    for s in range(0, n, batch_size):
        block = {k: np.asarray(v[s:s + batch_size]) for k, v in corruption.items()}
        logits = export_model.detect(block["input_ids"].astype(np.int32))  # (B, L)
        loss_sum, correct_sum, weight_sum = numpy_weighted_bce_sum(
            block["replaced"], logits, block["weights"])
        acc.add(loss_sum, weight_sum, correct_sum)
        replaced += float((block["replaced"] * block["weights"]).sum())
    return {"loss": acc.mean_loss, "accuracy": acc.accuracy, "scored_tokens": acc.weight_sum,
            "replaced_share": replaced / acc.weight_sum if acc.weight_sum else float("nan")}


def validation_metrics(export_model, objective: str, val_masks, batch_size: int,
                       detection: dict[str, np.ndarray] | None = None) -> dict[str, float]:
    """The `val/...` metrics logged for the objective (never a perplexity for mlm). rtd: the
    generator's masked-LM numbers on the static masks and the discriminator's on `detection`
    (`detection_corruption`)."""
    if objective in ("mlm", "rtd"):
        r = evaluate_masked_lm(export_model, val_masks, batch_size)
        out = {"val/mlm_loss": r["loss"], "val/mlm_accuracy": r["accuracy"],
               "val/scored_tokens": r["scored_tokens"]}
        if objective == "rtd":
            if detection is None:
                raise ValueError("rtd validation needs the stored detection corruption")
            d = evaluate_detection(export_model, detection, batch_size)
            out.update({"val/rtd_loss": d["loss"], "val/rtd_accuracy": d["accuracy"],
                        "val/rtd_scored_tokens": d["scored_tokens"],
                        "val/rtd_replaced_share": d["replaced_share"]})
        return out
    _check_masks(val_masks)
    # target_ids hold the original (uncorrupted) windows at every position.
    r = evaluate_causal_lm(export_model, val_masks["target_ids"], batch_size)
    return {"val/clm_loss": r["loss"], "val/perplexity": r["perplexity"],
            "val/scored_tokens": r["scored_tokens"]}


def validation_unigram_loss(log_probs: np.ndarray, objective: str, val_masks) -> float:
    """The unigram model's loss on exactly the validation targets the objective scores."""
    _check_masks(val_masks)
    if objective != "clm":  # rtd: its generator's masked-LM targets
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
    if objective != "clm":
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
