"""A classifier on top of an encoder: pooling, the head, and how windows enter the encoder.

A classifier is backbone + pooling + dropout + one Dense layer to class
logits; how it is trained (the fair protocol, staged unfreezing) lives in
`finetuning`, the frozen-feature probe in `features`. An encoder pretrained
causally (clm) reads its windows framed [BOS] ... [EOS], as it saw them in
pretraining, and is never pooled at [CLS]: under a causal mask position 0
has attended to itself only.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import numpy as np

from selfsup_model.errors import UserError
from selfsup_model.nn.layers import FastDropout, TransformerEncoderBlock, derive_seed
from selfsup_model.nn.pooling import ClsPooling, LastTokenPooling, MaskedMeanPooling
from selfsup_model.text.specials import PAD_ID
from selfsup_model.text.windows import (
    documents_owning,
    frame_windows,
    mean_over_documents,
    softmax,
)

POOLINGS: tuple[str, ...] = ("mean", "cls", "last")


def is_causal(backbone: keras.Model) -> bool:
    """Whether the encoder's blocks attend causally (pretrained with the clm objective)."""
    return any(getattr(layer, "causal", False) for layer in backbone.layers
               if isinstance(layer, TransformerEncoderBlock))


def encoder_inputs(backbone: keras.Model, windows: np.ndarray) -> np.ndarray:
    """Framed windows as this encoder expects them: [BOS] ... [EOS] for a causal encoder."""
    return frame_windows(windows, is_causal(backbone))


def build_pooling(pooling: str, backbone: keras.Model) -> keras.layers.Layer:
    if pooling not in POOLINGS:
        raise UserError(f"unknown pooling {pooling!r}; choose one of {', '.join(POOLINGS)}")
    if pooling == "cls" and is_causal(backbone):
        raise UserError("finetune.pooling=cls reads position 0, which a causal (clm) encoder lets "
                        "attend only to itself; use mean or last")
    layer = {"mean": MaskedMeanPooling, "cls": ClsPooling, "last": LastTokenPooling}[pooling]
    return layer(name="pool")


def build_classifier(backbone: keras.Model, num_classes: int, pooling: str = "mean",
                     dropout: float = 0.1, seed: int | None = None) -> keras.Model:
    """int32 ids (B, L) -> class logits (B, num_classes), with a new, randomly initialised head
    (its weights and dropout draws fixed by `seed`)."""
    if num_classes < 2:
        raise UserError(f"a classifier needs at least 2 classes (got {num_classes})")
    pool = build_pooling(pooling, backbone)
    ids = keras.Input(shape=backbone.input_shape[1:], dtype="int32", name="token_ids")
    pooled = pool(backbone(ids), ids)  # (B, L, H) -> (B, H)
    pooled = FastDropout(dropout, seed=derive_seed(seed, "head_dropout"),
                         name="head_dropout")(pooled)
    init = keras.initializers.GlorotUniform(seed=derive_seed(seed, "head_logits"))
    logits = keras.layers.Dense(num_classes, kernel_initializer=init,
                                name="head_logits")(pooled)  # (B, C)
    return keras.Model(ids, logits, name="classifier")


TRIM_MULTIPLE = 16  # inference batches are cut to a multiple of this many positions


def predict_in_batches(model: keras.Model, ids: np.ndarray, batch_size: int = 256) -> np.ndarray:
    """Model outputs for int32 ids (N, L) in inference mode, `batch_size` rows per call.

    A short batch is padded with all-[PAD] rows (dropped again) up to the next power of two,
    so calls come in at most log2(batch_size) + 1 shapes (each traced once) and one document
    costs a batch of one, not of `batch_size`.

    When the model takes token ids of any length, rows are visited shortest first and each
    batch is cut after its longest real row (rounded up to a multiple of `TRIM_MULTIPLE`):
    trailing [PAD] columns change no output (no query attends to a [PAD] key and pooling skips
    [PAD] positions), so the outputs are those of the full windows, in the caller's row order,
    for a fraction of the work (a quarter of the demo's positions are padding).
    """
    ids = np.asarray(ids)
    if len(ids) and _takes_any_length(model, ids):
        real = np.count_nonzero(ids != PAD_ID, axis=1)  # (N,) right-padded: the row's extent
        order = np.argsort(real, kind="stable")
        out = _predict_rows(model, ids[order], batch_size, real[order])
        return out[np.argsort(order, kind="stable")]
    return _predict_rows(model, ids, batch_size, None)


def _takes_any_length(model, ids: np.ndarray) -> bool:
    shape = getattr(model, "input_shape", None)
    return (ids.ndim == 2 and np.issubdtype(ids.dtype, np.integer) and isinstance(shape, tuple)
            and len(shape) == 2 and shape[1] is None)


def _predict_rows(model, ids: np.ndarray, batch_size: int, real: np.ndarray | None) -> np.ndarray:
    out = []
    for start in range(0, len(ids), batch_size):
        batch = ids[start : start + batch_size]
        if real is not None:  # sorted by real length: cut the trailing [PAD] columns
            longest = int(real[start : start + batch_size].max())
            keep = min(ids.shape[1], max(TRIM_MULTIPLE, -(-longest // TRIM_MULTIPLE)
                                         * TRIM_MULTIPLE))
            batch = batch[:, :keep]
        rows = len(batch)
        padded = min(batch_size, 1 << (rows - 1).bit_length())  # next power of two >= rows
        if rows < padded:
            filler = np.zeros((padded - rows, *batch.shape[1:]), ids.dtype)
            batch = np.concatenate([batch, filler])
        out.append(np.asarray(model.predict_on_batch(batch))[:rows])
    if not out:
        return np.zeros((0, *model.output_shape[1:]), dtype=np.float32)
    return np.concatenate(out)


def predict_probabilities(model: keras.Model, ids: np.ndarray, batch_size: int = 256,
                          owner: np.ndarray | None = None) -> np.ndarray:
    """Class probabilities (rows, classes) float32 for token ids (N, L): the softmax of each
    row's logits, or with `owner` (each row's document, non-decreasing) one row per document,
    the mean of its rows' probabilities."""
    probabilities = softmax(predict_in_batches(model, ids, batch_size))
    if (n_docs := documents_owning(owner)) is not None:
        probabilities = mean_over_documents(probabilities, owner, n_docs)
    return probabilities


def predict_classes(model: keras.Model, ids: np.ndarray, batch_size: int = 256,
                    owner: np.ndarray | None = None) -> np.ndarray:
    """Arg-max class ids of `predict_probabilities`: one per row, or per document with
    `owner`."""
    return np.argmax(predict_probabilities(model, ids, batch_size, owner), axis=-1).astype(np.int64)


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


def check_encoder_length(name: str, ids: np.ndarray, backbone: keras.Model) -> None:
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
