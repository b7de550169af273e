"""Transformer building blocks: embeddings, the attention masks and one encoder block.

Shapes: B batch, L sequence length, H hidden width, F feed-forward width.
Every layer's constructor arguments come back out of `get_config()`, so a
saved model reloads (with `safe_mode=True`) from the registered classes alone.

A row of ids may hold several documents back to back (packed pretraining
batches): each begins with its framing token, [CLS] (masked LM) or [BOS]
(causal LM), which content never carries. `DocumentMask` lets a token attend
only within its own document and `TokenAndPositionEmbedding` restarts the
positions at each one, so a packed document is computed exactly as if it were
alone in its row. A row with one document is unchanged by either.
"""

from __future__ import annotations

import hashlib
import math

import keras
from keras import layers, ops

from selfsup_model.errors import UserError
from selfsup_model.nn.saving import serializable
from selfsup_model.text.specials import BOS_ID, CLS_ID, PAD_ID


def gelu(x):
    # The tanh approximation, as in the original BERT and GPT-2 code: on CPU the
    # 4x256 training step measured ~5% faster than with the erf form.
    return keras.activations.gelu(x, approximate=True)


def derive_seed(seed: int | None, name: str) -> int | None:
    """The seed of the part `name` of something seeded with `seed`; None stays None.

    Keras draws a missing seed from Python's global `random`, which any thread of the
    process may draw from too (MLflow's and Prefect's background threads do), so two runs
    with the same seed could start from different weights and dropout draws. Every layer
    that draws takes its seed from here instead: a hash, so that parts never share one.
    """
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{int(seed)}/{name}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def truncated_normal_init(stddev: float = 0.02, seed: int | None = None
                          ) -> keras.initializers.Initializer:
    # BERT's initialiser: small weights keep the tied output projection's
    # first logits near uniform, so the first loss is close to ln(V).
    return keras.initializers.TruncatedNormal(stddev=stddev, seed=seed)


# lowbias32 (C. Wellons' integer hash prospector): a bijection of uint32 with full avalanche.
_MIX_SHIFTS, _MIX_MULTIPLIERS = (16, 15, 16), (0x7FEB352D, 0x846CA68B)
# Odd constants that make the two seed words' keys differ even when the words are equal.
_KEY_SALTS = (0x9E3779B9, 0x85EBCA6B)


def mix32(x):
    """lowbias32 on a uint32 tensor (TensorFlow; wraps modulo 2**32)."""
    import tensorflow as tf

    for shift, mult in zip(_MIX_SHIFTS, (*_MIX_MULTIPLIERS, None), strict=True):
        x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(shift, tf.uint32)))
        if mult is not None:
            x = x * tf.constant(mult, tf.uint32)
    return x


@serializable
class FastDropout(layers.Dropout):
    """`keras.layers.Dropout` whose keep mask comes from a counter hash on TensorFlow.

    Keras draws one float32 uniform per element through TensorFlow's random ops, which are slow
    on a CPU and pathological under XLA there (one attention-sized site took ~400x as long as
    no dropout; benchmarks/README.md, "Dropout's random draws"). Here word j of a call is
    mix32(mix32(j ^ k0) + k1), where (k0, k1) are the mixed words of the seed generator's state
    (which advances every call); its four bytes are the bytes of elements 4j..4j+3 in flat
    order, and an element is kept when its byte is >= round(rate * 256). Integer arithmetic
    only, so XLA fuses it into the step, and the same mask comes out with XLA or without.

    The rate is rounded to 1/256 (0.1 -> 26/256 = 0.1016) and kept values are scaled by
    256 / (256 - threshold), so the expectation stays exact. Rates that 1/256 cannot resolve
    (off by more than 2% of the rate), a `noise_shape`, and other backends (JAX fuses its own
    draws into the step) use keras' draws. The seed generator is the parent's (same variable
    path), so a checkpoint's RNG state still restores it. Sizes are int32: tensors of fewer than
    2**31 elements.
    """

    LEVELS = 256

    def call(self, inputs, training=False):
        threshold = round(self.rate * self.LEVELS)
        if (not training or self.rate <= 0 or self.noise_shape is not None
                or keras.backend.backend() != "tensorflow"
                or abs(threshold / self.LEVELS - self.rate) > 0.02 * self.rate
                or threshold >= self.LEVELS):
            return super().call(inputs, training=training)
        keep = ops.greater_equal(self._hashed_bytes(inputs), ops.cast(threshold, "uint8"))
        scale = ops.cast(self.LEVELS / (self.LEVELS - threshold), inputs.dtype)
        return ops.where(keep, inputs * scale, ops.zeros_like(inputs))

    def _hashed_bytes(self, inputs):
        """uint8 array of inputs' shape: byte i of the counter hash's words, i the flat index."""
        import tensorflow as tf

        state = tf.cast(self.seed_generator.next(), tf.uint32)  # (2,)
        k0, k1 = (mix32(tf.bitwise.bitwise_xor(state[i], tf.constant(salt, tf.uint32)))
                  for i, salt in enumerate(_KEY_SALTS))
        size = tf.size(inputs)
        index = tf.bitcast(tf.range((size + 3) // 4, dtype=tf.int32), tf.uint32)
        words = mix32(mix32(tf.bitwise.bitwise_xor(index, k0)) + k1)
        flat = tf.reshape(tf.bitcast(words, tf.uint8), (-1,))  # little-endian bytes of each word
        return tf.reshape(flat[:size], tf.shape(inputs))


@serializable
class PaddingMask(layers.Layer):
    """ids (B, L) -> bool (B, L), True at real tokens: every query reads every real key.
    Backbones saved before `DocumentMask` have this one; they never saw packed rows."""

    def call(self, ids):
        return ops.not_equal(ids, PAD_ID)


def document_ids(ids):
    """ids (B, L) -> int32 (B, L): 0 at [PAD], else 1 + the number of document starts ([CLS]
    or [BOS]) at or before the position, so each document of a packed row has its own id."""
    starts = ops.cast(ops.logical_or(ops.equal(ids, CLS_ID), ops.equal(ids, BOS_ID)), "int32")
    return ops.where(ops.not_equal(ids, PAD_ID), 1 + ops.cumsum(starts, axis=-1), 0)


def same_document(documents):
    """(B, L) document ids -> bool (B, L, L): True where positions i and j share one."""
    return ops.equal(ops.expand_dims(documents, 2), ops.expand_dims(documents, 1))


@serializable
class DocumentMask(layers.Layer):
    """ids (B, L) -> bool (B, L, L): True where query i may read key j, that is where j is a
    real token of i's document. A [PAD] query (whose output nothing reads) reads every real
    key, as under `PaddingMask`, so a row with one document gets the very same attention."""

    def call(self, ids):
        documents = document_ids(ids)  # (B, L)
        real_key = ops.expand_dims(ops.not_equal(documents, 0), 1)  # (B, 1, L)
        pad_query = ops.expand_dims(ops.equal(documents, 0), 2)  # (B, L, 1)
        return ops.logical_and(real_key, ops.logical_or(same_document(documents), pad_query))

    def compute_output_shape(self, input_shape):
        return (*input_shape, input_shape[-1])


def document_positions(ids):
    """ids (B, L) -> int32 (B, L): each token's position within its document (the count of
    earlier tokens of that document); a [PAD] keeps its column index."""
    documents = document_ids(ids)  # (B, L)
    columns = ops.arange(ops.shape(ids)[-1], dtype="int32")  # (L,)
    earlier = ops.expand_dims(columns, 1) > ops.expand_dims(columns, 0)  # (L, L): j < i
    within = ops.sum(ops.cast(ops.logical_and(same_document(documents), earlier[None]),
                              "int32"), axis=-1)  # (B, L)
    return ops.where(ops.equal(documents, 0), columns[None], within)


@serializable
class TokenAndPositionEmbedding(layers.Layer):
    """Token lookup plus a learned absolute position vector: ids (B, L) -> (B, L, H)."""

    def __init__(self, vocab_size: int, max_len: int, hidden: int, seed: int | None = None,
                 document_positions: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size = int(vocab_size)
        self.max_len = int(max_len)
        self.hidden = int(hidden)
        self.seed = seed
        # Count positions from each document's start (packed rows); False (the default, and
        # every backbone saved before packing) counts from the row's start.
        self.document_positions = bool(document_positions)
        self.token_embedding = layers.Embedding(
            self.vocab_size, self.hidden,
            embeddings_initializer=truncated_normal_init(seed=derive_seed(seed, "token")),
            dtype=self.dtype_policy, name="token_embedding",
        )
        self.position_embedding = layers.Embedding(
            self.max_len, self.hidden,
            embeddings_initializer=truncated_normal_init(seed=derive_seed(seed, "position")),
            dtype=self.dtype_policy, name="position_embedding",
        )

    def build(self, input_shape):
        self.token_embedding.build(input_shape)
        self.position_embedding.build((self.max_len,))
        self.built = True

    @property
    def embeddings(self):
        """The token matrix (V, H), shared with a tied output projection."""
        return self.token_embedding.embeddings

    def call(self, ids):
        length = ops.shape(ids)[-1]
        positions = ops.arange(length, dtype="int32")  # (L,)
        tokens = self.token_embedding(ids)  # (B, L, H)
        if not self.document_positions:
            return tokens + ops.expand_dims(self.position_embedding(positions), 0)
        return tokens + self.position_embedding(document_positions(ids))  # (B, L, H)

    def compute_output_shape(self, input_shape):
        return (*input_shape, self.hidden)

    def get_config(self):
        return {**super().get_config(), "vocab_size": self.vocab_size,
                "max_len": self.max_len, "hidden": self.hidden, "seed": self.seed,
                "document_positions": self.document_positions}


@serializable
class TransformerEncoderBlock(layers.Layer):
    """Multi-head self-attention + position-wise FFN, each with dropout and a residual.

    `norm="post"` (BERT): x = LN(x + attn(x)); x = LN(x + ffn(x)).
    `norm="pre"`: x = x + attn(LN(x)); x = x + ffn(LN(x)) (the backbone then adds
    a final LayerNorm). Q, K and V come from one learned (H, 3H) projection: on
    CPU one wide matmul measured ~8% faster per training step than Keras'
    MultiHeadAttention with three (H, H) ones. The mask hides padded keys and
    (`DocumentMask`) the keys of other documents packed into the row; every query
    row, [MASK] included, is computed, and a [MASK] is an ordinary visible key.
    With `causal`, query i also sees only keys j <= i.
    """

    def __init__(self, hidden: int, heads: int, ff: int, dropout: float = 0.0,
                 norm: str = "post", causal: bool = False, epsilon: float = 1e-6,
                 seed: int | None = None, **kwargs):
        super().__init__(**kwargs)
        if norm not in ("post", "pre"):
            raise ValueError(f"norm must be 'post' or 'pre', got {norm!r}")
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        self.hidden, self.heads, self.ff = int(hidden), int(heads), int(ff)
        self.dropout, self.norm, self.causal, self.epsilon = (
            float(dropout), norm, bool(causal), epsilon)
        self.seed, dt = seed, self.dtype_policy

        def dense(units, name):
            init = truncated_normal_init(seed=derive_seed(seed, name))
            return layers.Dense(units, kernel_initializer=init, dtype=dt, name=name)

        def dropout_layer(name):
            return FastDropout(self.dropout, seed=derive_seed(seed, name), dtype=dt, name=name)

        self.qkv = dense(3 * self.hidden, "qkv")
        self.attention_output = dense(self.hidden, "attention_output")
        self.probs_dropout = dropout_layer("probs_dropout")
        self.attention_dropout = dropout_layer("attention_dropout")
        self.attention_norm = layers.LayerNormalization(epsilon=epsilon, dtype=dt,
                                                        name="attention_norm")
        self.ff_in = dense(self.ff, "ff_in")
        self.ff_out = dense(self.hidden, "ff_out")
        self.ff_dropout = dropout_layer("ff_dropout")
        self.ff_norm = layers.LayerNormalization(epsilon=epsilon, dtype=dt, name="ff_norm")

    def build(self, input_shape):
        # Sub-layers are built here, not lazily, so saved weights load into them.
        for layer in (self.qkv, self.attention_output, self.attention_norm, self.ff_in,
                      self.ff_norm):
            layer.build(input_shape)
        self.ff_out.build((*input_shape[:-1], self.ff))
        self.built = True

    def attention_mask(self, padding_mask):
        """`DocumentMask`'s (B, L, L) or `PaddingMask`'s (B, L) bool -> (B, 1, L, L) or
        (B, 1, 1, L): True where query i may read key j."""
        if len(padding_mask.shape) == 3:  # (B, L, L): real keys of the query's document
            visible = ops.expand_dims(padding_mask, 1)  # (B, 1, L, L)
        else:  # (B, L): real keys only
            visible = ops.expand_dims(ops.expand_dims(padding_mask, 1), 1)  # (B, 1, 1, L)
        if not self.causal:
            return visible
        positions = ops.arange(ops.shape(padding_mask)[1])
        earlier = ops.expand_dims(positions, 1) >= ops.expand_dims(positions, 0)  # (L, L): j <= i
        return ops.logical_and(visible, earlier[None, None])

    def self_attention(self, x, padding_mask, training=None):
        batch, length = ops.shape(x)[0], ops.shape(x)[1]
        head_dim = self.hidden // self.heads
        qkv = ops.reshape(self.qkv(x), (batch, length, 3, self.heads, head_dim))  # (B, L, 3, N, D)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # (B, L, N, D) each
        scores = ops.einsum("bqnd,bknd->bnqk", q, k) / math.sqrt(head_dim)  # (B, N, L, L)
        # Softmax in float32 even under a bfloat16 policy; hidden keys get -1e9, so a row
        # with no visible key (an all-[PAD] sequence) is uniform, never NaN.
        scores = ops.where(self.attention_mask(padding_mask), ops.cast(scores, "float32"), -1e9)
        probs = ops.cast(ops.softmax(scores, axis=-1), x.dtype)
        probs = self.probs_dropout(probs, training=training)
        mixed = ops.einsum("bnqk,bknd->bqnd", probs, v)  # (B, L, N, D)
        out = self.attention_output(ops.reshape(mixed, (batch, length, self.hidden)))  # (B, L, H)
        return self.attention_dropout(out, training=training)

    def call(self, x, padding_mask, training=None):
        # x (B, L, H); padding_mask: DocumentMask's (B, L, L) or PaddingMask's (B, L) bool.
        def feed_forward(h):
            out = self.ff_out(gelu(self.ff_in(h)))  # (B, L, F) -> (B, L, H)
            return self.ff_dropout(out, training=training)

        if self.norm == "post":
            x = self.attention_norm(x + self.self_attention(x, padding_mask, training))
            return self.ff_norm(x + feed_forward(x))
        x = x + self.self_attention(self.attention_norm(x), padding_mask, training)
        return x + feed_forward(self.ff_norm(x))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "hidden": self.hidden, "heads": self.heads, "ff": self.ff,
                "dropout": self.dropout, "norm": self.norm, "causal": self.causal,
                "epsilon": self.epsilon, "seed": self.seed}


@serializable
class BagTokenEmbedding(layers.Layer):
    """int32 ids (B, L), L <= max_len -> token vectors (B, L, dim); no positions: a bag.

    The arithmetic needs no `max_len`; it is the limit `train_classifier` checks
    on every encoder, so this baseline reads exactly the token windows the
    Transformer reads. The [PAD] row is trained like any other but never
    reaches a pooled vector (MaskedMeanPooling drops padded positions).
    """

    def __init__(self, vocab_size: int, max_len: int, dim: int, seed: int | None = None,
                 rate_multiplier: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size, self.max_len, self.dim = int(vocab_size), int(max_len), int(dim)
        self.seed, self.rate_multiplier = seed, float(rate_multiplier)
        if self.rate_multiplier <= 0:
            raise UserError(f"bag rate_multiplier must be positive, got {rate_multiplier}")
        # fastText's initialisation, U(-1/dim, 1/dim), for the vectors the layer returns: the
        # mean of a document starts near zero. Stored divided by the multiplier.
        limit = 1.0 / (self.dim * self.rate_multiplier)
        init = keras.initializers.RandomUniform(-limit, limit, seed=seed)
        self.token_embedding = layers.Embedding(
            self.vocab_size, self.dim, embeddings_initializer=init, name="token_embedding"
        )

    def build(self, ids_shape):
        self.token_embedding.build(ids_shape)

    def call(self, ids):
        return self.token_embedding(ids) * self.rate_multiplier  # (B, L, dim)

    def compute_output_shape(self, ids_shape):
        return (*ids_shape, self.dim)

    def get_config(self):
        sizes = {"vocab_size": self.vocab_size, "max_len": self.max_len, "dim": self.dim,
                 "seed": self.seed, "rate_multiplier": self.rate_multiplier}
        return {**super().get_config(), **sizes}
