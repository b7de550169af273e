"""Backbone, objective heads and the two pretraining models (train and export).

A task = backbone + head (the KerasHub split). The backbone maps int32 ids
(B, L) to states (B, L, H) and derives its own padding mask from [PAD]. The
training model gathers the selected positions *before* the vocabulary
projection, so the most expensive matmul runs on (B, P) rows, not (B, L). The
export model (`pretrain_model.keras`) reuses the very same layers on every
position: ids (B, L) -> logits (B, L, V).

Tying the output projection to the token embedding means a head must refer to
a layer that lives inside the backbone. A plain functional graph cannot
serialise such a reference, so both pretraining models are `keras.Model`
subclasses whose config is (backbone, objective, ...) and which re-link the
head to the backbone's embedding when rebuilt from config.
"""

from __future__ import annotations

import keras
from keras import layers, ops

from selfsup_model.config import ModelConfig
from selfsup_model.nn.layers import (
    DocumentMask,
    FastDropout,
    PaddingMask,
    TokenAndPositionEmbedding,
    TransformerEncoderBlock,
    derive_seed,
    gelu,
    truncated_normal_init,
)
from selfsup_model.nn.losses import TokenWeightedLoss, paired_info_nce, token_weighted_loss
from selfsup_model.nn.pooling import MaskedMeanPooling
from selfsup_model.nn.saving import serializable

EMBEDDING_LAYER = "embeddings"
DOCUMENT_MASK_LAYER = "document_mask"
OBJECTIVES = ("mlm", "clm")


def build_backbone(vocab_size: int, max_len: int, cfg: ModelConfig, causal: bool = False,
                   dtype=None, seed: int | None = None, documents: bool = False) -> keras.Model:
    """int32 ids (B, L), L <= max_len -> states (B, L, H); `seed` fixes every initial weight
    and dropout draw (`layers.derive_seed`). With `documents` (packed pretraining) a row may
    hold several documents, each opened by [CLS] or [BOS]: none attends to another, and each
    has its own positions from 0. Without, the padding mask and row positions: the same
    outputs on one-document rows, at less cost (and the arithmetic of every earlier run)."""
    ids = keras.Input(shape=(None,), dtype="int32", name="input_ids")
    if documents:
        visible = DocumentMask(name=DOCUMENT_MASK_LAYER)(ids)  # (B, L, L) bool
    else:
        visible = PaddingMask(name="padding_mask")(ids)  # (B, L) bool
    x = TokenAndPositionEmbedding(vocab_size, max_len, cfg.hidden, dtype=dtype,
                                  seed=derive_seed(seed, EMBEDDING_LAYER),
                                  document_positions=documents, name=EMBEDDING_LAYER)(ids)
    if cfg.norm == "post":
        x = layers.LayerNormalization(epsilon=1e-6, dtype=dtype, name="embeddings_norm")(x)
    x = FastDropout(cfg.dropout, dtype=dtype, seed=derive_seed(seed, "embeddings_dropout"),
                    name="embeddings_dropout")(x)
    for i in range(cfg.layers):
        x = TransformerEncoderBlock(cfg.hidden, cfg.heads, cfg.ff, dropout=cfg.dropout,
                                    norm=cfg.norm, causal=causal, dtype=dtype,
                                    seed=derive_seed(seed, f"block_{i}"),
                                    name=f"block_{i}")(x, padding_mask=visible)
    if cfg.norm == "pre":
        # Pre-norm residual streams are never normalised inside the blocks.
        x = layers.LayerNormalization(epsilon=1e-6, dtype=dtype, name="final_norm")(x)
    return keras.Model(ids, x, name="causal_backbone" if causal else "backbone")


def with_dropout(backbone: keras.Model, rate: float, keep_weights: bool = True,
                 seed: int | None = None, dtype: str | None = None,
                 documents: bool = False) -> keras.Model:
    """The same backbone rebuilt with every dropout rate set to `rate` (fine-tuning's rate need
    not be pretraining's), carrying over its weights unless `keep_weights` is False (a fresh
    random initialisation of the same architecture: the random-init baseline). A `seed`
    reseeds every layer that draws (initial weights, dropout), by the layer's name. A `dtype`
    (a policy name) replaces the policy of every layer `build_backbone` gives one, as if built
    with it; the weights stay float32 under either policy. Every dropout comes back a
    `FastDropout` (a backbone saved before it existed has a plain keras one). `documents`
    makes a backbone that does not yet keep packed documents apart do so (`build_backbone`)."""
    rate = float(rate)
    convert = documents and not separates_documents(backbone)

    def clone(layer):
        if convert and isinstance(layer, PaddingMask):
            return DocumentMask(name=DOCUMENT_MASK_LAYER)
        config = layer.get_config()
        if convert and isinstance(layer, TokenAndPositionEmbedding):
            config["document_positions"] = True
        if isinstance(layer, keras.layers.Dropout):
            config["rate"] = rate
        elif isinstance(layer, TransformerEncoderBlock):
            config["dropout"] = rate
        if seed is not None and "seed" in config:
            config["seed"] = derive_seed(seed, layer.name)
        if dtype is not None and not isinstance(layer, (PaddingMask, DocumentMask)):
            config["dtype"] = dtype
        cls = FastDropout if isinstance(layer, keras.layers.Dropout) else layer.__class__
        return cls.from_config(config)

    clone_model = keras.models.clone_model(backbone, clone_function=clone)
    if keep_weights:
        clone_model.set_weights(backbone.get_weights())
    return clone_model


def token_embedding_of(backbone: keras.Model) -> TokenAndPositionEmbedding:
    return backbone.get_layer(EMBEDDING_LAYER)


def separates_documents(backbone: keras.Model) -> bool:
    """Whether `backbone` keeps the documents of a packed row apart (attention and positions);
    backbones saved before packing existed do not."""
    masks = [layer for layer in backbone.layers if isinstance(layer, DocumentMask)]
    return bool(masks) and token_embedding_of(backbone).document_positions


@serializable
class CausalLMHead(layers.Layer):
    """states (B, L, H) -> logits (B, L, V): dense + gelu + LayerNorm, then the vocabulary
    projection.

    With `tie_embeddings` the projection is the token embedding matrix (V, H)
    transposed plus a bias; the embedding layer is passed in by the owning model
    (it is not part of this layer's config). Logits are float32 even under a
    mixed policy so the softmax and the loss are computed at full precision.
    """

    def __init__(self, vocab_size: int, hidden: int, tie_embeddings: bool = True,
                 token_embedding: TokenAndPositionEmbedding | None = None, epsilon: float = 1e-6,
                 seed: int | None = None, **kwargs):
        super().__init__(**kwargs)
        if tie_embeddings and token_embedding is None:
            raise ValueError("a tied head needs the backbone's token embedding layer")
        self.vocab_size, self.hidden = int(vocab_size), int(hidden)
        self.tie_embeddings, self.epsilon = bool(tie_embeddings), epsilon
        self.token_embedding = token_embedding if self.tie_embeddings else None
        dt, self.seed = self.dtype_policy, seed
        self.transform = layers.Dense(
            self.hidden,
            kernel_initializer=truncated_normal_init(seed=derive_seed(seed, "transform")),
            dtype=dt, name="transform")
        self.transform_norm = layers.LayerNormalization(epsilon=epsilon, dtype=dt,
                                                        name="transform_norm")
        self.decoder = None if self.tie_embeddings else layers.Dense(
            self.vocab_size, use_bias=False,
            kernel_initializer=truncated_normal_init(seed=derive_seed(seed, "decoder")), dtype=dt,
            name="decoder")

    def build(self, input_shape):
        shape = (None, None, self.hidden)
        self.transform.build(shape)
        self.transform_norm.build(shape)
        if self.decoder is not None:
            self.decoder.build(shape)
        self.output_bias = self.add_weight(shape=(self.vocab_size,), initializer="zeros",
                                           name="bias")
        self.built = True

    def project(self, states):
        """states (B, N, H) -> logits (B, N, V) float32."""
        h = self.transform_norm(gelu(self.transform(states)))  # (B, N, H)
        if self.decoder is not None:
            logits = self.decoder(h)
        else:
            matrix = ops.cast(self.token_embedding.embeddings, h.dtype)  # (V, H)
            logits = ops.matmul(h, ops.transpose(matrix))
        return ops.cast(logits, "float32") + ops.cast(self.output_bias, "float32")

    def call(self, states):
        return self.project(states)

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], self.vocab_size)

    def get_config(self):
        return {**super().get_config(), "vocab_size": self.vocab_size, "hidden": self.hidden,
                "tie_embeddings": self.tie_embeddings, "epsilon": self.epsilon, "seed": self.seed}


@serializable
class MaskedLMHead(CausalLMHead):
    """states (B, L, H) [+ mask_positions (B, P)] -> logits (B, P, V) [or (B, L, V)].

    The gather happens before the dense/LayerNorm/vocabulary projection: a
    pretraining step pays for P rows of the (H x V) matmul instead of L.
    """

    def call(self, states, mask_positions=None):
        if mask_positions is not None:
            index = ops.expand_dims(ops.cast(mask_positions, "int32"), -1)  # (B, P, 1)
            states = ops.take_along_axis(states, index, axis=1)  # (B, P, H)
        return self.project(states)

    def compute_output_shape(self, states_shape, mask_positions_shape=None):
        if mask_positions_shape is not None:
            return (*mask_positions_shape, self.vocab_size)
        return (*states_shape[:-1], self.vocab_size)


def _make_head(objective: str, backbone: keras.Model, tie_embeddings: bool,
               name: str | None = None, seed: int | None = None):
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    embedding = token_embedding_of(backbone)
    cls = MaskedLMHead if objective == "mlm" else CausalLMHead
    return cls(embedding.vocab_size, embedding.hidden, tie_embeddings=tie_embeddings,
               token_embedding=embedding, dtype=embedding.dtype_policy, seed=seed,
               name=name or f"{objective}_head")


@serializable
class PretrainingModel(keras.Model):
    """The model `fit` trains. mlm: {input_ids (B, L), mask_positions (B, P)} -> (B, P, V);
    clm: {input_ids (B, L-1)} -> (B, L-1, V).

    `compute_loss` returns the token-weighted loss sum(w * ce) / sum(w) with the
    targets and weights passed to `fit` as (y, sample_weight), so the backend's
    own train_step does gradients, optimiser, XLA and mixed precision.

    With `contrastive_weight` > 0 the model also outputs the masked mean of the final states
    (B, H), the pooling the classifier and the linear probe read, and the loss adds that
    weight times `losses.paired_info_nce` of it: the batches pair rows 2i and 2i+1 (two
    windows of one document, `PretrainBatches(pairs=True)`).
    """

    def __init__(self, backbone: keras.Model, objective: str = "mlm", tie_embeddings: bool = True,
                 seed: int | None = None, contrastive_weight: float = 0.0,
                 contrastive_temperature: float = 0.05, **kwargs):
        head = _make_head(objective, backbone, tie_embeddings, seed=seed)
        ids = keras.Input(shape=(None,), dtype="int32", name="input_ids")
        inputs = {"input_ids": ids}
        states = backbone(ids)  # (B, L, H)
        if objective == "mlm":
            positions = keras.Input(shape=(None,), dtype="int32", name="mask_positions")
            inputs["mask_positions"] = positions
            outputs = head(states, mask_positions=positions)  # (B, P, V)
        else:
            outputs = head(states)  # (B, L-1, V)
        if contrastive_weight > 0:
            outputs = [outputs, MaskedMeanPooling(name="contrastive_pool")(states, ids)]
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)
        self.backbone, self.head = backbone, head
        self.objective, self.tie_embeddings, self.seed = objective, bool(tie_embeddings), seed
        self.contrastive_weight = float(contrastive_weight)
        self.contrastive_temperature = float(contrastive_temperature)
        self.token_loss = TokenWeightedLoss(name=f"{objective}_loss")
        # A running sum (reset with the epoch, like token_loss): the reporter takes differences.
        self.contrastive_loss = (keras.metrics.Sum(name="contrastive_loss_sum")
                                 if contrastive_weight > 0 else None)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        if sample_weight is None:
            raise ValueError("pretraining needs per-token weights: fit on (x, targets, weights)")
        logits = y_pred[0] if self.contrastive_loss is not None else y_pred
        # A batch with nothing scored gives 0 (no NaN, no gradient); the metric counts it.
        loss = token_weighted_loss(y, logits, sample_weight, metric=self.token_loss)
        if self.contrastive_loss is None:
            return loss
        contrastive = paired_info_nce(y_pred[1], self.contrastive_temperature)
        self.contrastive_loss.update_state(contrastive)
        return loss + self.contrastive_weight * contrastive

    def get_config(self):
        return {"backbone": keras.saving.serialize_keras_object(self.backbone),
                "objective": self.objective, "tie_embeddings": self.tie_embeddings,
                "seed": self.seed, "contrastive_weight": self.contrastive_weight,
                "contrastive_temperature": self.contrastive_temperature,
                "name": self.name, "trainable": self.trainable}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["backbone"] = keras.saving.deserialize_keras_object(config["backbone"],
                                                                   custom_objects=custom_objects)
        return cls(**config)


@serializable
class PretrainExportModel(keras.Model):
    """`pretrain_model.keras`: ids (B, L) -> logits (B, L, V) on every position, sharing the
    trained backbone and head objects (no copies of their weights)."""

    def __init__(self, backbone: keras.Model, head: CausalLMHead, objective: str = "mlm", **kwargs):
        ids = keras.Input(shape=(None,), dtype="int32", name="input_ids")
        logits = head(backbone(ids))  # (B, L, V)
        super().__init__(inputs=ids, outputs=logits, **kwargs)
        self.backbone, self.head, self.objective = backbone, head, objective

    def get_config(self):
        return {"backbone": keras.saving.serialize_keras_object(self.backbone),
                "objective": self.objective, "tie_embeddings": self.head.tie_embeddings,
                "name": self.name, "trainable": self.trainable}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        backbone = keras.saving.deserialize_keras_object(config.pop("backbone"),
                                                         custom_objects=custom_objects)
        head = _make_head(config["objective"], backbone, config.pop("tie_embeddings"))
        return cls(backbone, head, **config)


def build_pretraining_model(backbone: keras.Model, objective: str, cfg: ModelConfig,
                            seed: int | None = None, contrastive_weight: float = 0.0,
                            contrastive_temperature: float = 0.05) -> PretrainingModel:
    """Backbone + a new objective head (its weights fixed by `seed`), ready to compile and fit;
    with `contrastive_weight` > 0, also the paired contrastive term (`PretrainingModel`)."""
    return PretrainingModel(backbone, objective=objective, tie_embeddings=cfg.tie_embeddings,
                            seed=derive_seed(seed, "head"), contrastive_weight=contrastive_weight,
                            contrastive_temperature=contrastive_temperature,
                            name=f"{objective}_pretraining")


def build_pretrain_export_model(backbone: keras.Model, head: CausalLMHead,
                                objective: str) -> PretrainExportModel:
    """ids (B, L) -> logits (B, L, V) over the trained layers (see `PretrainExportModel`)."""
    return PretrainExportModel(backbone, head, objective=objective,
                               name=f"{objective}_pretrain_model")
