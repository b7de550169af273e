"""Bag-of-embeddings baseline (fastText-style): learned token vectors, no positions, no attention.

The backbone maps token ids to token vectors and nothing else. It is trained by
`classify.train_classifier(..., mode="scratch")`, which adds MaskedMeanPooling
(the mean over real tokens), dropout and one Dense head, so it shares that
function's budget, seeded shuffling and validation-F1 model selection with the
Transformer methods. It measures what word identity alone gets.

Keras only: no sklearn, no torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import keras

from selfsup_model.errors import UserError
from selfsup_model.saving import serializable
from selfsup_model.specials import NUM_SPECIAL


@serializable
class BagTokenEmbedding(keras.layers.Layer):
    """int32 ids (B, L), L <= max_len -> token vectors (B, L, dim); no positions: a bag.

    The arithmetic needs no `max_len`; it is the limit `train_classifier` checks
    on every encoder, so this baseline reads exactly the token windows the
    Transformer reads. The [PAD] row is trained like any other but never
    reaches a pooled vector (MaskedMeanPooling drops padded positions).
    """

    def __init__(self, vocab_size: int, max_len: int, dim: int, seed: int | None = None,
                 **kwargs):
        super().__init__(**kwargs)
        self.vocab_size, self.max_len, self.dim = int(vocab_size), int(max_len), int(dim)
        self.seed = seed
        # fastText's initialisation, U(-1/dim, 1/dim): the mean of a document starts near zero.
        init = keras.initializers.RandomUniform(-1.0 / self.dim, 1.0 / self.dim, seed=seed)
        self.token_embedding = keras.layers.Embedding(
            self.vocab_size, self.dim, embeddings_initializer=init, name="token_embedding"
        )

    def build(self, ids_shape):
        self.token_embedding.build(ids_shape)

    def call(self, ids):
        return self.token_embedding(ids)  # (B, L, dim)

    def compute_output_shape(self, ids_shape):
        return (*ids_shape, self.dim)

    def get_config(self):
        sizes = {"vocab_size": self.vocab_size, "max_len": self.max_len, "dim": self.dim,
                 "seed": self.seed}
        return {**super().get_config(), **sizes}


def build_bag_of_embeddings(vocab_size: int, max_len: int, dim: int = 64) -> keras.Model:
    """Bag-of-embeddings backbone: int32 ids (B, L), L <= max_len -> token vectors (B, L, dim)."""
    _check_bag_sizes(vocab_size, max_len, dim)
    ids = keras.Input(shape=(None,), dtype="int32", name="input_ids")
    states = BagTokenEmbedding(vocab_size, max_len, dim, name="bag_embedding")(ids)  # (B, L, dim)
    return keras.Model(ids, states, name="bag_of_embeddings")


def bag_of_embeddings_factory(
    vocab_size: int, max_len: int, dim: int = 64
) -> Callable[[], keras.Model]:
    """A zero-argument backbone factory for `train_classifier(..., mode="scratch")`."""
    _check_bag_sizes(vocab_size, max_len, dim)  # fail now, not mid-sweep
    return functools.partial(build_bag_of_embeddings, vocab_size, max_len, dim)


def _check_bag_sizes(vocab_size: int, max_len: int, dim: int) -> None:
    if vocab_size <= NUM_SPECIAL or max_len < 1 or dim < 1:
        raise UserError(
            f"bag of embeddings needs vocab_size > {NUM_SPECIAL}, max_len >= 1 and dim >= 1 "
            f"(got {vocab_size}, {max_len}, {dim})"
        )
