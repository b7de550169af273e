"""Pooling: one vector per sequence from the encoder's states, over real tokens only.

Each layer takes the states (B, L, H) and the ids (B, L) they came from, and
returns (B, H). Padded positions never reach a pooled vector.
"""

from __future__ import annotations

from keras import layers, ops

from selfsup_model.nn.saving import serializable
from selfsup_model.text.specials import PAD_ID


@serializable
class MaskedMeanPooling(layers.Layer):
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
class ClsPooling(layers.Layer):
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
class LastTokenPooling(layers.Layer):
    """The state at each row's last real position: under a causal mask, the one that has seen
    the whole document. Windows are right-padded, so it sits at (number of real tokens - 1)."""

    def call(self, states, ids):
        count = ops.sum(ops.cast(ops.not_equal(ids, PAD_ID), "int32"), axis=1)  # (B,)
        last = ops.maximum(count - 1, 0)[:, None, None]  # (B, 1, 1)
        return ops.take_along_axis(states, ops.cast(last, "int32"), axis=1)[:, 0, :]  # (B, H)

    def compute_output_shape(self, states_shape, ids_shape):
        return (states_shape[0], states_shape[-1])
