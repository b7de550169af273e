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
import numpy as np
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
from selfsup_model.nn.losses import (
    TokenWeightedLoss,
    paired_info_nce,
    token_weighted_bce,
    token_weighted_loss,
)
from selfsup_model.nn.pooling import MaskedMeanPooling
from selfsup_model.nn.saving import serializable
from selfsup_model.text.specials import NUM_SPECIAL

EMBEDDING_LAYER = "embeddings"
DOCUMENT_MASK_LAYER = "document_mask"
OBJECTIVES = ("mlm", "clm", "rtd")


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
    if objective not in ("mlm", "clm"):
        raise ValueError(f"an objective head is mlm or clm, got {objective!r}")
    embedding = token_embedding_of(backbone)
    cls = MaskedLMHead if objective == "mlm" else CausalLMHead
    return cls(embedding.vocab_size, embedding.hidden, tie_embeddings=tie_embeddings,
               token_embedding=embedding, dtype=embedding.dtype_policy, seed=seed,
               name=name or f"{objective}_head")


class _RebuiltAroundBackbone:
    """A model whose config holds its backbone serialised: rebuilt from config, the backbone is
    deserialised first and handed to the constructor, which relinks the heads to it."""

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["backbone"] = keras.saving.deserialize_keras_object(config["backbone"],
                                                                   custom_objects=custom_objects)
        return cls(**config)


def _with_contrastive(model, loss, y_pred):
    """`loss` plus the model's weighted paired contrastive term, if it has one, on the pooled
    states it outputs last."""
    if model.contrastive_loss is None:
        return loss
    contrastive = paired_info_nce(y_pred[-1], model.contrastive_temperature)
    model.contrastive_loss.update_state(contrastive)
    return loss + model.contrastive_weight * contrastive


@serializable
class PretrainingModel(_RebuiltAroundBackbone, keras.Model):
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
        return _with_contrastive(self, loss, y_pred)

    def get_config(self):
        return {"backbone": keras.saving.serialize_keras_object(self.backbone),
                "objective": self.objective, "tie_embeddings": self.tie_embeddings,
                "seed": self.seed, "contrastive_weight": self.contrastive_weight,
                "contrastive_temperature": self.contrastive_temperature,
                "name": self.name, "trainable": self.trainable}


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


# ------------------------------------------------------------------ replaced-token detection


@serializable
class Generator(layers.Layer):
    """Replaced-token detection's generator: a small masked-LM encoder that reads the
    discriminator's own token and position embeddings (shared, as in ELECTRA: they learn from
    both losses) through `blocks` encoder blocks of its own and a tied masked-LM head.

    ids (B, L) [+ mask_positions (B, P)] -> logits (B, P, V) [or (B, L, V)], float32. The
    embedding layer is passed in by the owning model (it lives in the discriminator's
    backbone, so it is not part of this layer's config)."""

    def __init__(self, blocks: int, heads: int, ff: int, norm: str = "pre", dropout: float = 0.0,
                 documents: bool = False, tie_embeddings: bool = True,
                 token_embedding: TokenAndPositionEmbedding | None = None,
                 seed: int | None = None, **kwargs):
        super().__init__(**kwargs)
        if token_embedding is None:
            raise ValueError("a generator needs the discriminator's embedding layer")
        self.num_blocks, self.heads, self.ff, self.norm = int(blocks), int(heads), int(ff), norm
        self.dropout, self.documents, self.seed = float(dropout), bool(documents), seed
        self.tie_embeddings = bool(tie_embeddings)
        self.token_embedding, dt = token_embedding, token_embedding.dtype_policy
        hidden = token_embedding.hidden
        self.visible = (DocumentMask(name="generator_document_mask") if documents
                        else PaddingMask(name="generator_padding_mask"))
        self.embeddings_norm = (layers.LayerNormalization(
            epsilon=1e-6, dtype=dt, name="generator_embeddings_norm") if norm == "post" else None)
        self.blocks = [TransformerEncoderBlock(hidden, self.heads, self.ff, dropout=self.dropout,
                                               norm=norm, dtype=dt,
                                               seed=derive_seed(seed, f"generator_block_{i}"),
                                               name=f"generator_block_{i}")
                       for i in range(self.num_blocks)]
        self.final_norm = (layers.LayerNormalization(
            epsilon=1e-6, dtype=dt, name="generator_final_norm") if norm == "pre" else None)
        self.head = MaskedLMHead(token_embedding.vocab_size, hidden,
                                 tie_embeddings=self.tie_embeddings,
                                 token_embedding=token_embedding, dtype=dt,
                                 seed=derive_seed(seed, "generator_head"), name="generator_head")

    def build(self, ids_shape):
        shape = (*ids_shape, self.token_embedding.hidden)
        for layer in (self.embeddings_norm, *self.blocks, self.final_norm):
            if layer is not None:
                layer.build(shape)
        self.head.build(shape)
        self.built = True

    def states(self, ids, training=None):
        """ids (B, L) -> the generator's final states (B, L, H)."""
        visible = self.visible(ids)
        x = self.token_embedding(ids)
        if self.embeddings_norm is not None:
            x = self.embeddings_norm(x)
        for block in self.blocks:
            x = block(x, padding_mask=visible, training=training)
        return x if self.final_norm is None else self.final_norm(x)

    def call(self, ids, mask_positions=None, training=None):
        return self.head(self.states(ids, training=training), mask_positions=mask_positions)

    def compute_output_shape(self, ids_shape, mask_positions_shape=None):
        rows = mask_positions_shape if mask_positions_shape is not None else ids_shape
        return (*rows, self.token_embedding.vocab_size)

    def get_config(self):
        return {**super().get_config(), "blocks": self.num_blocks, "heads": self.heads,
                "ff": self.ff, "norm": self.norm, "dropout": self.dropout,
                "documents": self.documents, "tie_embeddings": self.tie_embeddings,
                "seed": self.seed}


@serializable
class ReplacedTokenHead(layers.Layer):
    """The discriminator's head: states (B, L, H) -> (B, L) float32 logits that each token was
    replaced (dense + gelu, then one unit)."""

    def __init__(self, hidden: int, seed: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.hidden, self.seed, dt = int(hidden), seed, self.dtype_policy
        self.transform = layers.Dense(
            self.hidden, kernel_initializer=truncated_normal_init(seed=derive_seed(seed, "dense")),
            dtype=dt, name="transform")
        self.score = layers.Dense(
            1, kernel_initializer=truncated_normal_init(seed=derive_seed(seed, "score")),
            dtype=dt, name="score")

    def build(self, states_shape):
        self.transform.build(states_shape)
        self.score.build((*states_shape[:-1], self.hidden))
        self.built = True

    def call(self, states):
        logits = self.score(gelu(self.transform(states)))  # (B, L, 1)
        return ops.cast(ops.squeeze(logits, -1), "float32")

    def compute_output_shape(self, states_shape):
        return tuple(states_shape[:-1])

    def get_config(self):
        return {**super().get_config(), "hidden": self.hidden, "seed": self.seed}


def sample_replacements(generator_logits, uniform):
    """One token per scored position from the generator's distribution, by inverse CDF on
    `uniform` (B, P) draws in [0, 1) that the batches supply (so a step's samples are a pure
    function of the step, and a resumed run draws them again): (B, P) int32. Special tokens
    are never drawn (a [PAD] would change the discriminator's attention mask). No gradient
    flows through the draw."""
    logits = ops.stop_gradient(ops.cast(generator_logits, "float32"))  # (B, P, V)
    vocab = ops.shape(logits)[-1]
    special = ops.arange(vocab) < NUM_SPECIAL  # (V,)
    probs = ops.softmax(ops.where(special, -1e9, logits), axis=-1)
    cdf = ops.cumsum(probs, axis=-1)  # (B, P, V)
    below = ops.sum(ops.cast(cdf < ops.expand_dims(ops.cast(uniform, "float32"), -1), "int32"),
                    axis=-1)
    # Rounding can leave the last cdf value a hair under a draw close to 1: the last id then.
    return ops.clip(below, NUM_SPECIAL, vocab - 1)


def place_replacements(original_ids, mask_positions, mask_weights, sampled):
    """The discriminator's input: `original_ids` (B, L) with each scored position of
    `mask_positions` (B, P; weight > 0) holding its `sampled` (B, P) token. Returns (ids,
    replaced): replaced (B, L) float32 is 1 where the token differs from the original (a
    sample equal to the original counts as original, as in ELECTRA)."""
    length = ops.shape(original_ids)[1]
    at = ops.expand_dims(mask_positions, -1) == ops.arange(length)[None, None, :]  # (B, P, L)
    at = ops.logical_and(at, ops.expand_dims(mask_weights > 0, -1))
    hit = ops.any(at, axis=1)  # (B, L)
    placed = ops.sum(ops.where(at, ops.expand_dims(sampled, -1), 0), axis=1)  # (B, L)
    ids = ops.where(hit, ops.cast(placed, "int32"), ops.cast(original_ids, "int32"))
    return ids, ops.cast(ids != ops.cast(original_ids, "int32"), "float32")


@serializable
class ReplacedTokenModel(_RebuiltAroundBackbone, keras.Model):
    """What `fit` trains for pretrain.objective=rtd (ELECTRA's replaced-token detection).

    Inputs: input_ids (B, L), the corrupted windows the generator reads (the masked-LM
    corruption); original_ids (B, L); mask_positions, mask_weights (B, P); sample_uniform
    (B, P). The generator predicts the selected positions (its masked-LM loss, on the targets
    and weights `fit` passes as (y, sample_weight)); a sample from it replaces each selected
    token of the original window; the discriminator (`backbone`, the encoder fine-tuning
    gets) predicts for every token whether it was replaced. The discriminator's loss is a
    binary cross-entropy weighted over the real tokens (not [PAD], not special), divided by
    their count, and enters the total as `rtd_weight` times it (ELECTRA: 50).
    """

    def __init__(self, backbone: keras.Model, generator_blocks: int = 1,
                 tie_embeddings: bool = True, seed: int | None = None, rtd_weight: float = 50.0,
                 contrastive_weight: float = 0.0, contrastive_temperature: float = 0.05,
                 **kwargs):
        generator, detector = _rtd_parts(backbone, generator_blocks, tie_embeddings, seed)
        names = ("input_ids", "original_ids", "mask_positions")
        ids, original, positions = (keras.Input(shape=(None,), dtype="int32", name=n)
                                    for n in names)
        weights = keras.Input(shape=(None,), dtype="float32", name="mask_weights")
        uniform = keras.Input(shape=(None,), dtype="float32", name="sample_uniform")
        generated = generator(ids, mask_positions=positions)  # (B, P, V)
        replaced_ids, replaced = ReplaceTokens(name="replace_tokens")(
            generated, original, positions, weights, uniform)
        states = backbone(replaced_ids)  # (B, L, H)
        outputs = [generated, detector(states), replaced]
        if contrastive_weight > 0:
            outputs.append(MaskedMeanPooling(name="contrastive_pool")(states, replaced_ids))
        inputs = {"input_ids": ids, "original_ids": original, "mask_positions": positions,
                  "mask_weights": weights, "sample_uniform": uniform}
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)
        self.backbone, self.generator, self.detector = backbone, generator, detector
        self.objective, self.generator_blocks = "rtd", int(generator_blocks)
        self.tie_embeddings, self.seed, self.rtd_weight = bool(tie_embeddings), seed, rtd_weight
        self.contrastive_weight = float(contrastive_weight)
        self.contrastive_temperature = float(contrastive_temperature)
        self.token_loss = TokenWeightedLoss(name="mlm_loss")
        self.detection_loss = TokenWeightedLoss(name="rtd_loss", counts_prefix="rtd_")
        self.contrastive_loss = (keras.metrics.Sum(name="contrastive_loss_sum")
                                 if contrastive_weight > 0 else None)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        if sample_weight is None:
            raise ValueError("pretraining needs per-token weights: fit on (x, targets, weights)")
        generated, detected, replaced = y_pred[:3]
        loss = token_weighted_loss(y, generated, sample_weight, metric=self.token_loss)
        real = ops.cast(ops.cast(x["original_ids"], "int32") >= NUM_SPECIAL, "float32")
        loss = loss + self.rtd_weight * token_weighted_bce(replaced, detected, real,
                                                           metric=self.detection_loss)
        return _with_contrastive(self, loss, y_pred)

    def get_config(self):
        return {"backbone": keras.saving.serialize_keras_object(self.backbone),
                "generator_blocks": self.generator_blocks,
                "tie_embeddings": self.tie_embeddings, "seed": self.seed,
                "rtd_weight": self.rtd_weight, "contrastive_weight": self.contrastive_weight,
                "contrastive_temperature": self.contrastive_temperature,
                "name": self.name, "trainable": self.trainable}


@serializable
class ReplaceTokens(layers.Layer):
    """(generator logits, original ids, positions, weights, uniform draws) -> the
    discriminator's ids and which were replaced (`sample_replacements`,
    `place_replacements`)."""

    def call(self, generated, original_ids, mask_positions, mask_weights, uniform):
        sampled = sample_replacements(generated, uniform)
        return place_replacements(original_ids, mask_positions, mask_weights, sampled)


@serializable
class ReplacedTokenExportModel(_RebuiltAroundBackbone, keras.Model):
    """`pretrain_model.keras` of an rtd run: ids (B, L) -> the generator's logits (B, L, V) on
    every position (what fill-mask and the masked-LM validation read), holding the trained
    discriminator (`backbone`, the encoder) and its head (`detector`: `detect`), sharing the
    trained objects."""

    def __init__(self, backbone: keras.Model, generator_blocks: int = 1,
                 tie_embeddings: bool = True, generator: Generator | None = None,
                 detector: ReplacedTokenHead | None = None, **kwargs):
        if generator is None or detector is None:  # rebuilt from config: fresh, weights load
            generator, detector = _rtd_parts(backbone, generator_blocks, tie_embeddings, None)
        ids = keras.Input(shape=(None,), dtype="int32", name="input_ids")
        logits = generator(ids)  # (B, L, V)
        detector(backbone(ids))  # built in the graph, so its weights are saved and loaded
        super().__init__(inputs=ids, outputs=logits, **kwargs)
        self.backbone, self.generator, self.detector = backbone, generator, detector
        self.objective, self.generator_blocks = "rtd", int(generator_blocks)
        self.tie_embeddings = bool(tie_embeddings)

    def detect(self, ids) -> np.ndarray:
        """(B, L) logits that each token of `ids` was replaced."""
        states = self.backbone(ids, training=False)
        return keras.ops.convert_to_numpy(self.detector(states))

    def get_config(self):
        return {"backbone": keras.saving.serialize_keras_object(self.backbone),
                "generator_blocks": self.generator_blocks,
                "tie_embeddings": self.tie_embeddings, "name": self.name,
                "trainable": self.trainable}


def _rtd_parts(backbone: keras.Model, generator_blocks: int, tie_embeddings: bool,
               seed: int | None) -> tuple[Generator, ReplacedTokenHead]:
    """A generator over `backbone`'s embeddings, its blocks shaped like the backbone's, and the
    discriminator's head."""
    embedding = token_embedding_of(backbone)
    block = next(layer for layer in backbone.layers if isinstance(layer, TransformerEncoderBlock))
    generator = Generator(generator_blocks, block.heads, block.ff, norm=block.norm,
                          dropout=block.dropout, documents=separates_documents(backbone),
                          tie_embeddings=tie_embeddings, token_embedding=embedding,
                          dtype=embedding.dtype_policy, seed=derive_seed(seed, "generator"),
                          name="generator")
    detector = ReplacedTokenHead(embedding.hidden, dtype=embedding.dtype_policy,
                                 seed=derive_seed(seed, "detector"), name="rtd_head")
    return generator, detector


def build_rtd_model(backbone: keras.Model, cfg: ModelConfig, generator_blocks: int,
                    rtd_weight: float, seed: int | None = None, contrastive_weight: float = 0.0,
                    contrastive_temperature: float = 0.05) -> ReplacedTokenModel:
    """The discriminator `backbone` + a new generator and detection head (their weights fixed
    by `seed`), ready to compile and fit (`ReplacedTokenModel`)."""
    return ReplacedTokenModel(backbone, generator_blocks=generator_blocks,
                              tie_embeddings=cfg.tie_embeddings, seed=derive_seed(seed, "head"),
                              rtd_weight=rtd_weight, contrastive_weight=contrastive_weight,
                              contrastive_temperature=contrastive_temperature,
                              name="rtd_pretraining")


def build_rtd_export_model(model: ReplacedTokenModel) -> ReplacedTokenExportModel:
    """ids (B, L) -> the generator's logits (B, L, V), over the trained layers."""
    return ReplacedTokenExportModel(model.backbone, model.generator_blocks, model.tie_embeddings,
                                    generator=model.generator, detector=model.detector,
                                    name="rtd_pretrain_model")
