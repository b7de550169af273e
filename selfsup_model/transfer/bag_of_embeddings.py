"""Bag-of-embeddings baseline (fastText-style): learned token vectors, no positions, no attention.

The backbone maps token ids to token vectors and nothing else. It is trained by
`classify.train_classifier(..., mode="scratch")`, which adds MaskedMeanPooling
(the mean over real tokens), dropout and one Dense head, so it shares that
function's budget, seeded shuffling and validation-F1 model selection with the
Transformer methods. It measures what word identity alone gets.

Its token rows learn `rate_multiplier` times faster than the learning rate the shared grid
gives it (the table is stored divided by the multiplier and scaled back on lookup, so Adam's
steps, about the rate in size, move the vectors that much further). A row moves only when
its token is in the batch, and at the grid's rates, chosen for the Transformers, the bag
learned little in its budget. At the grid (3e-4, 1e-3) the demo used then and 5% labels, the best
validation macro-F1 was 0.351 without a multiplier, 0.442 with 100 and 0.441 with 300; on a
second corpus 0.107, 0.390 and 0.416 (`benchmarks/bag_rate.py`; fastText itself trains at
rates near 0.1). The multiplier is part of the model, like an initialisation: every method
still searches the same grid with the same budget.

Keras only: no sklearn, no torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import keras

from selfsup_model.errors import UserError
from selfsup_model.nn.layers import BagTokenEmbedding
from selfsup_model.text.specials import NUM_SPECIAL


def build_bag_of_embeddings(vocab_size: int, max_len: int, dim: int = 64,
                            rate_multiplier: float = 1.0) -> keras.Model:
    """Bag-of-embeddings backbone: int32 ids (B, L), L <= max_len -> token vectors (B, L, dim)."""
    _check_bag_sizes(vocab_size, max_len, dim)
    ids = keras.Input(shape=(None,), dtype="int32", name="input_ids")
    states = BagTokenEmbedding(vocab_size, max_len, dim, rate_multiplier=rate_multiplier,
                               name="bag_embedding")(ids)  # (B, L, dim)
    return keras.Model(ids, states, name="bag_of_embeddings")


def bag_of_embeddings_factory(
    vocab_size: int, max_len: int, dim: int = 64, rate_multiplier: float = 1.0
) -> Callable[[], keras.Model]:
    """A zero-argument backbone factory for `train_classifier(..., mode="scratch")`."""
    _check_bag_sizes(vocab_size, max_len, dim)  # fail now, not mid-sweep
    return functools.partial(build_bag_of_embeddings, vocab_size, max_len, dim, rate_multiplier)


def _check_bag_sizes(vocab_size: int, max_len: int, dim: int) -> None:
    if vocab_size <= NUM_SPECIAL or max_len < 1 or dim < 1:
        raise UserError(
            f"bag of embeddings needs vocab_size > {NUM_SPECIAL}, max_len >= 1 and dim >= 1 "
            f"(got {vocab_size}, {max_len}, {dim})"
        )
