"""Document classification on top of a backbone: pooling, the classifier, its training.

A classifier is backbone + pooling + dropout + one Dense layer to class
logits. Three training modes share that architecture and budget:

- ``probe``: the pretrained backbone is frozen (``trainable = False`` and run in
  inference mode, so its features are fixed); only the head learns.
- ``full``: everything learns; backbone variables use
  ``cfg.encoder_learning_rate`` and the head ``cfg.head_learning_rate``.
- ``scratch``: the same architecture with freshly initialised backbone weights
  (the random-init baseline). No pretrained features to protect, so every
  variable uses ``cfg.head_learning_rate``.

Model selection: after every epoch the classifier predicts the validation
split, the weights with the best validation macro-F1 are kept, and training
stops after ``cfg.patience`` epochs without improvement. Test data is never
an input here: `eval_sets` are token ids only, predicted once, after selection.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import keras
import numpy as np
from keras import ops

from selfsup_model.config import FinetuneConfig
from selfsup_model.errors import UserError
from selfsup_model.metrics import accuracy, macro_f1
from selfsup_model.saving import serializable
from selfsup_model.specials import PAD_ID

Mode = Literal["probe", "full", "scratch"]
MODES: tuple[str, ...] = ("probe", "full", "scratch")
POOLINGS: tuple[str, ...] = ("mean", "cls")

log = logging.getLogger("selfsup.classify")


@serializable
class MaskedMeanPooling(keras.layers.Layer):
    """Mean of the states at real positions (ids != PAD): (B, L, H), (B, L) -> (B, H).

    Padded positions never enter the sum (selected out with `where`, so even a
    NaN in a padded row cannot leak in). A row with no real token pools to zeros.
    """

    def call(self, states, ids):
        real = ops.expand_dims(ops.not_equal(ids, PAD_ID), -1)  # (B, L, 1)
        kept = ops.where(real, states, ops.zeros_like(states))  # (B, L, H)
        count = ops.sum(ops.cast(real, states.dtype), axis=1)  # (B, 1)
        return ops.sum(kept, axis=1) / ops.maximum(count, 1.0)  # (B, H)

    def compute_output_shape(self, states_shape, ids_shape):
        return (states_shape[0], states_shape[-1])


@serializable
class ClsPooling(keras.layers.Layer):
    """The state at position 0, the [CLS] token every encoded sequence starts with.

    Under bidirectional attention this state has attended to every real token
    (and, through the padding mask, to no padded one). `ids` is accepted for a
    signature shared with `MaskedMeanPooling` and is not used.
    """

    def call(self, states, ids):
        return states[:, 0, :]  # (B, H)

    def compute_output_shape(self, states_shape, ids_shape):
        return (states_shape[0], states_shape[-1])


@serializable
class TwoRateAdam(keras.optimizers.Adam):
    """Adam whose step is scaled by `scale` for the variables named in `scaled_paths`.

    Used for full fine-tuning: learning_rate is the head's, and the encoder's
    variables get learning_rate * scale. Scaling the step (not the gradient)
    matters: Adam normalises gradient magnitude away. Works on every backend,
    because it only overrides the per-variable `update_step`.
    """

    def __init__(self, scaled_paths: Sequence[str] = (), scale: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        self.scaled_paths = tuple(scaled_paths)
        self.scale = float(scale)

    def build(self, var_list):
        wanted = set(self.scaled_paths)
        matched = [v.path for v in var_list if v.path in wanted]
        if len(matched) != len(wanted) or len(set(matched)) != len(matched):
            # Silently training the encoder at the head's rate would be a wrong experiment.
            raise UserError(
                "TwoRateAdam: the scaled variable paths do not match the model's variables "
                f"one-to-one ({len(matched)} matches for {len(wanted)} paths)"
            )
        self._step_scales = [self.scale if v.path in wanted else 1.0 for v in var_list]
        super().build(var_list)

    def update_step(self, gradient, variable, learning_rate):
        scale = self._step_scales[self._get_variable_index(variable)]
        super().update_step(gradient, variable, learning_rate * scale)

    def get_config(self):
        return {**super().get_config(), "scaled_paths": list(self.scaled_paths),
                "scale": self.scale}


def build_classifier(
    backbone: keras.Model, num_classes: int, pooling: str = "mean", dropout: float = 0.1
) -> keras.Model:
    """int32 ids (B, L) -> class logits (B, num_classes), with a new, randomly initialised head."""
    if num_classes < 2:
        raise UserError(f"a classifier needs at least 2 classes (got {num_classes})")
    if pooling not in POOLINGS:
        raise UserError(f"unknown pooling {pooling!r}; choose one of {', '.join(POOLINGS)}")
    ids = keras.Input(shape=backbone.input_shape[1:], dtype="int32", name="token_ids")
    # A frozen backbone also runs in inference mode (no dropout): a probe reads fixed features.
    states = backbone(ids) if backbone.trainable else backbone(ids, training=False)  # (B, L, H)
    pool = MaskedMeanPooling(name="pool") if pooling == "mean" else ClsPooling(name="pool")
    pooled = pool(states, ids)  # (B, H)
    pooled = keras.layers.Dropout(dropout, name="head_dropout")(pooled)
    logits = keras.layers.Dense(num_classes, name="head_logits")(pooled)  # (B, C)
    return keras.Model(ids, logits, name="classifier")


@dataclasses.dataclass(frozen=True)
class ClassifierResult:
    model: keras.Model  # restored to the best validation epoch
    mode: str
    val_macro_f1: float  # of the returned model
    best_epoch: int  # 1-based
    epochs_run: int
    train_time_s: float
    history: list[dict]  # per epoch: epoch, loss, val_macro_f1, val_accuracy
    val_predictions: np.ndarray  # (n_val,) class ids
    predictions: dict[str, np.ndarray]  # eval-set name -> (n,) class ids


def train_classifier(
    backbone_factory: Callable[[], keras.Model],
    train: tuple[np.ndarray, np.ndarray],
    val: tuple[np.ndarray, np.ndarray],
    num_classes: int,
    mode: Mode,
    cfg: FinetuneConfig,
    seed: int,
    eval_sets: Mapping[str, np.ndarray] | None = None,
) -> ClassifierResult:
    """Train a classifier in `mode`; select on validation macro-F1; predict `eval_sets`.

    `backbone_factory()` must return a fresh pretrained backbone (e.g. load
    `encoder.keras`) each call: full fine-tuning changes its weights. For
    ``scratch`` only its architecture is used. `train`/`val` are (ids (N, L)
    int32, class ids (N,)); `eval_sets` maps a name to ids (N, L) only.
    """
    if mode not in MODES:
        raise UserError(f"unknown fine-tuning mode {mode!r}; choose one of {', '.join(MODES)}")
    train_ids, train_y = _check_split("train", train, num_classes)
    val_ids, val_y = _check_split("val", val, num_classes)
    if len(np.unique(train_y)) < 2:
        raise UserError("the training subset holds a single label; classification needs at least 2")
    keras.utils.set_random_seed(seed)
    backbone = _prepare_backbone(backbone_factory(), mode)
    for name, ids in (("train", train_ids), ("val", val_ids), *(eval_sets or {}).items()):
        _check_length(name, ids, backbone)
    model = build_classifier(backbone, num_classes, cfg.pooling, cfg.dropout)
    model.compile(
        optimizer=_optimizer(backbone, mode, cfg),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    start = time.perf_counter()
    history, best_epoch = _fit_with_selection(model, train_ids, train_y, val_ids, val_y, cfg, seed)
    train_time = time.perf_counter() - start
    val_pred = predict_classes(model, val_ids, cfg.batch_size)
    return ClassifierResult(
        model=model,
        mode=mode,
        val_macro_f1=macro_f1(val_y, val_pred),
        best_epoch=best_epoch,
        epochs_run=len(history),
        train_time_s=train_time,
        history=history,
        val_predictions=val_pred,
        predictions={name: predict_classes(model, ids, cfg.batch_size)
                     for name, ids in (eval_sets or {}).items()},
    )


def predict_classes(model: keras.Model, ids: np.ndarray, batch_size: int = 64) -> np.ndarray:
    """Arg-max class ids (N,) for token ids (N, L)."""
    ids = np.asarray(ids, dtype=np.int32)
    out = [np.zeros((0,), dtype=np.int64)]
    for start in range(0, len(ids), batch_size):
        batch = ids[start : start + batch_size]  # (b, L)
        real = len(batch)
        if real < batch_size:
            # Fill with all-PAD rows (dropped below) so every call has one shape:
            # one compiled function, no retrace for the last batch.
            filler = np.full((batch_size - real, ids.shape[1]), PAD_ID, dtype=np.int32)
            batch = np.concatenate([batch, filler])
        # predict_on_batch skips predict()'s per-call dataset setup, which dominates
        # when validation runs after every epoch.
        logits = np.asarray(model.predict_on_batch(batch))[:real]  # (b, C)
        out.append(np.argmax(logits, axis=-1).astype(np.int64))
    return np.concatenate(out)


def class_ids(labels: Sequence[str], classes: Sequence[str]) -> np.ndarray:
    """Map string labels to their index in `classes` (N,); unknown labels are an error."""
    index = {c: i for i, c in enumerate(classes)}
    unknown = sorted({str(label) for label in labels if label not in index})
    if unknown:
        raise UserError(f"labels {unknown[:5]} are not in the training label set "
                        f"{list(classes)[:10]}")
    return np.fromiter((index[label] for label in labels), dtype=np.int64, count=len(labels))


def stratified_subset(labels: Sequence, fraction: float, seed: int) -> np.ndarray:
    """Sorted indices of a seeded, label-stratified `fraction` of `labels`.

    Each label keeps floor(fraction * count) examples but at least one; the
    remaining slots up to round(fraction * N) go to the labels furthest below
    fraction * count (ties to the earlier label in sorted order). The one-per-label floor wins
    over the size target, so with many rare labels the subset can exceed
    fraction * N by at most the number of labels. fraction 1.0 returns all.
    """
    labels = np.asarray(labels)
    n = len(labels)
    if n == 0:
        raise UserError("cannot take a subset of an empty training set")
    if not 0.0 < fraction <= 1.0:
        raise UserError(f"label fraction must be in (0, 1] (got {fraction})")
    if fraction == 1.0:
        return np.arange(n)
    values, codes, counts = np.unique(labels, return_inverse=True, return_counts=True)
    quota = fraction * counts  # (K,)
    take = np.maximum(np.floor(quota).astype(np.int64), 1)
    spare = max(round(fraction * n), 1) - int(take.sum())
    if spare > 0:
        room = take < counts
        # Largest shortfall first; a label already lifted to its floor of one ranks low.
        shortfall = np.where(room, quota - take, -np.inf)
        order = np.argsort(-shortfall, kind="stable")[: int(room.sum())]
        take[order[:spare]] += 1
    rng = np.random.default_rng(seed)
    chosen = [rng.permutation(np.flatnonzero(codes == k))[: take[k]] for k in range(len(values))]
    return np.sort(np.concatenate(chosen))


# ---------------------------------------------------------------- internals


def _check_split(name: str, split: tuple[np.ndarray, np.ndarray], num_classes: int):
    ids, y = np.asarray(split[0]), np.asarray(split[1])
    if ids.ndim != 2 or len(ids) == 0:
        raise UserError(f"{name} ids must be a non-empty (n_docs, max_len) array "
                        f"(got shape {ids.shape})")
    if len(y) != len(ids):
        raise UserError(f"{name} has {len(ids)} sequences but {len(y)} labels")
    if not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= num_classes:
        raise UserError(f"{name} labels must be class ids in [0, {num_classes}); "
                        "map strings with class_ids()")
    return ids.astype(np.int32), y.astype(np.int64)


def _check_length(name: str, ids: np.ndarray, backbone: keras.Model) -> None:
    fixed = backbone.input_shape[1]
    # A variable-length encoder still has a last learned position (its position
    # embedding's `max_len`); past it a lookup fails on CPU and reads zeros on GPU.
    limits = [layer.max_len for layer in backbone.layers
              if isinstance(getattr(layer, "max_len", None), int)]
    ids = np.asarray(ids)
    too_long = ids.ndim == 2 and limits and ids.shape[1] > min(limits)
    if ids.ndim != 2 or (fixed is not None and ids.shape[1] != fixed) or too_long:
        expected = fixed if fixed is not None else f"<= {min(limits)}" if limits else "L"
        raise UserError(
            f"{name} ids have shape {ids.shape} but the encoder expects (n, {expected}); "
            "encode with the same max_len as pretraining"
        )


def _prepare_backbone(backbone: keras.Model, mode: str) -> keras.Model:
    if mode == "scratch":
        # Same architecture from config, new layers, fresh random weights.
        backbone = keras.models.clone_model(backbone)
    backbone.trainable = mode != "probe"
    return backbone


def _optimizer(backbone: keras.Model, mode: str, cfg: FinetuneConfig) -> keras.optimizers.Optimizer:
    if mode != "full":
        return keras.optimizers.Adam(learning_rate=cfg.head_learning_rate)
    return TwoRateAdam(
        learning_rate=cfg.head_learning_rate,
        scaled_paths=[v.path for v in backbone.trainable_variables],
        scale=cfg.encoder_learning_rate / cfg.head_learning_rate,
    )


def _fit_with_selection(model, train_ids, train_y, val_ids, val_y, cfg: FinetuneConfig, seed: int):
    """Epoch loop with validation macro-F1 selection; leaves the best weights in `model`."""
    rng = np.random.default_rng(seed)
    history: list[dict] = []
    best_f1, best_epoch, best_weights = -1.0, 0, None
    for epoch in range(1, cfg.epochs + 1):
        # Our own seeded shuffle: identical batches on every backend and every rerun.
        order = rng.permutation(len(train_y))
        fit = model.fit(
            train_ids[order], train_y[order], batch_size=cfg.batch_size, epochs=1, shuffle=False,
            verbose=0
        )
        val_pred = predict_classes(model, val_ids, cfg.batch_size)
        f1 = macro_f1(val_y, val_pred)
        history.append({
            "epoch": epoch,
            "loss": float(fit.history["loss"][-1]),
            "val_macro_f1": f1,
            "val_accuracy": accuracy(val_y, val_pred),
        })
        log.info("epoch %d/%d: loss %.4f, val macro-F1 %.4f", epoch, cfg.epochs,
                 history[-1]["loss"], f1)
        if f1 > best_f1:  # strict: on a tie the earlier (cheaper) epoch stays
            best_f1, best_epoch, best_weights = f1, epoch, model.get_weights()
        elif epoch - best_epoch >= cfg.patience:
            break
    model.set_weights(best_weights)
    return history, best_epoch
