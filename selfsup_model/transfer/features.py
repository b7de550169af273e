"""Frozen encoder features: pooled document vectors computed once, in inference mode.

A frozen encoder is a fixed feature map, so it is run once per document with
dropout off (`predict_on_batch` is inference mode) and its pooled states are
reused by every label fraction and every classifier trained on top: the
logistic-regression probe, and the head-only stage of staged unfreezing.
"""

from __future__ import annotations

import keras
import numpy as np

from selfsup_model.transfer.classify import build_pooling, encoder_inputs, predict_in_batches


def feature_extractor(backbone: keras.Model, pooling: str = "mean") -> keras.Model:
    """ids (B, L) -> pooled states (B, H) over real tokens: the classifier's input to its head."""
    ids = keras.Input(shape=(None,), dtype="int32", name="token_ids")
    pooled = build_pooling(pooling, backbone)(backbone(ids), ids)
    return keras.Model(ids, pooled, name="frozen_features")


def frozen_features(backbone: keras.Model, windows: np.ndarray, pooling: str = "mean",
                    batch_size: int = 256) -> np.ndarray:
    """(N, H) float32 pooled features of framed windows (N, L); dropout off, weights untouched."""
    extractor = feature_extractor(backbone, pooling)
    features = predict_in_batches(extractor, encoder_inputs(backbone, windows), batch_size)
    return features.astype(np.float32, copy=False)
