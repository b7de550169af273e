"""Layer-wise learning-rate decay in fine-tuning's optimizer, by hand."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from selfsup_model.nn.optimizers import RestartableAdamW, layer_depths


def test_depths_count_layers_below_the_top_from_the_variable_paths():
    paths = ["embeddings/token_embedding/embeddings", "embeddings_norm/gamma",
             "block_0/qkv/kernel", "block_1/ff_norm/beta", "final_norm/gamma",
             "head_logits/kernel", "bag_embedding/embeddings"]
    assert layer_depths(paths) == [3, 3, 2, 1, 0, 0, 3]
    assert layer_depths(["bag_embedding/embeddings", "head_logits/bias"]) == [1, 0]


@pytest.mark.parametrize("decay", [1.0, 0.5])
def test_each_layer_moves_at_decay_to_its_depth_times_the_rate(decay):
    # Adam's first update is the rate times sign(gradient) (m / sqrt(v) = g / |g| once
    # bias-corrected), so each variable moves by exactly its scaled rate.
    layers = [keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros", name=name)
              for name in ("embeddings", "block_0", "block_1", "head_logits")]
    for layer in layers:
        layer.build((None, 1))
    variables = [layer.kernel for layer in layers]
    optimizer = RestartableAdamW(weight_decay=0.0, epsilon=1e-12)
    optimizer.build(variables)
    for run in range(2):  # a restart with another decay needs no new optimizer
        for v in variables:
            v.assign(np.zeros((1, 1), np.float32))
        optimizer.restart(0.1, 0, 10, layer_decay=decay if run else 0.9)
        optimizer.apply_gradients([(np.ones((1, 1), np.float32), v) for v in variables])
    moved = [-float(keras.ops.convert_to_numpy(v)[0, 0]) for v in variables]
    assert moved == pytest.approx([0.1 * decay ** 3, 0.1 * decay ** 2, 0.1 * decay, 0.1],
                                  rel=1e-5)


def test_a_decay_outside_zero_to_one_is_refused():
    layer = keras.layers.Dense(1, name="head_logits")
    layer.build((None, 1))
    optimizer = RestartableAdamW(weight_decay=0.0)
    optimizer.build(layer.trainable_variables)
    with pytest.raises(ValueError, match="layer_decay must be in"):
        optimizer.restart(0.1, 0, 10, layer_decay=1.5)
