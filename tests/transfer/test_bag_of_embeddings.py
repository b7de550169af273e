import ast
from pathlib import Path

import keras
import numpy as np
import pytest

import selfsup_model.transfer.bag_of_embeddings as bag_module
from selfsup_model.config import BaselineConfig, FinetuneConfig
from selfsup_model.errors import UserError
from selfsup_model.report.metrics import accuracy
from selfsup_model.text.specials import CLS_ID, PAD_ID, SEP_ID
from selfsup_model.transfer.bag_of_embeddings import (
    BagTokenEmbedding,
    bag_of_embeddings_factory,
    build_bag_of_embeddings,
)
from selfsup_model.transfer.classify import build_classifier, predict_classes
from selfsup_model.transfer.finetuning import train_classifier
from selfsup_model.transfer.protocol import scratch_baselines
from tests.library.toy import make_docs

VOCAB, MAX_LEN, DIM = 20, 8, 8


@pytest.fixture(scope="module")
def trained():
    """The bag-of-embeddings baseline trained through the shared classifier API."""
    (tr, tr_y), (va, va_y), (te, te_y) = make_docs(64, 0), make_docs(32, 1), make_docs(32, 2)
    cfg = FinetuneConfig(epochs=4, batch_size=8, min_updates=8, max_updates=32, evals=4,
                         patience=2, dropout=0.0)
    factory = bag_of_embeddings_factory(VOCAB, MAX_LEN, DIM)
    result = train_classifier(factory, (tr, tr_y), (va, va_y), 2, "scratch", cfg, seed=0,
                              learning_rate=0.05, eval_sets={"test": te})
    return result, te, te_y


def test_bag_backbone_shapes_and_bad_sizes():
    backbone = build_bag_of_embeddings(VOCAB, MAX_LEN, DIM)
    states = backbone.predict_on_batch(np.ones((3, 5), np.int32))
    assert states.shape == (3, 5, DIM)  # (B, L, dim): any L up to max_len
    with pytest.raises(UserError, match="vocab_size"):
        bag_of_embeddings_factory(3, MAX_LEN, DIM)


def test_bag_pooling_ignores_padding_length():
    keras.utils.set_random_seed(0)
    model = build_classifier(build_bag_of_embeddings(VOCAB, MAX_LEN, DIM), 3, dropout=0.0)
    real = [CLS_ID, 9, 14, 9, SEP_ID]
    probs = []
    for pad_len in (0, 1, 3):
        ids = np.array([real + [PAD_ID] * pad_len], np.int32)  # (1, 5 + pad_len)
        probs.append(keras.ops.convert_to_numpy(keras.ops.softmax(model(ids))))
    for p in probs[1:]:
        np.testing.assert_allclose(p, probs[0], rtol=1e-6)
    # Sanity: the pooled vector is the mean of the real tokens' vectors.
    table = model.get_layer("bag_of_embeddings").get_layer("bag_embedding").get_weights()[0]
    pool = keras.Model(model.input, model.get_layer("pool").output)
    pooled = pool.predict_on_batch(np.array([real + [PAD_ID] * 3], np.int32))  # (1, dim)
    np.testing.assert_allclose(pooled[0], table[real].mean(axis=0), rtol=1e-5, atol=1e-7)


def test_rate_multiplier_moves_the_vectors_that_many_times_further_per_step():
    """Adam's first step moves every weight by about the rate, so a table stored divided by m
    and scaled back by m on lookup moves its vectors m times as far, from the same start."""
    ids = np.array([[CLS_ID, 9, 14, SEP_ID, PAD_ID]], np.int32)
    target = np.random.default_rng(0).normal(size=(1, 5, DIM)).astype("float32")
    start, moved = {}, {}
    for m in (1.0, 30.0):
        inputs = keras.Input(shape=(None,), dtype="int32")
        layer = BagTokenEmbedding(VOCAB, MAX_LEN, DIM, seed=3, rate_multiplier=m)
        model = keras.Model(inputs, layer(inputs))
        model.compile(optimizer=keras.optimizers.Adam(learning_rate=1e-3), loss="mse")
        start[m] = model.predict_on_batch(ids)
        model.train_on_batch(ids, target)
        moved[m] = model.predict_on_batch(ids) - start[m]
        assert layer.get_config()["rate_multiplier"] == m
    assert np.abs(start[1.0]).max() <= 1.0 / DIM  # fastText's start, whatever the multiplier
    np.testing.assert_allclose(start[30.0], start[1.0], rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(np.abs(moved[1.0]), 1e-3, rtol=5e-3)  # one step: the rate (float32)
    np.testing.assert_allclose(moved[30.0], 30.0 * moved[1.0], rtol=5e-3)
    with pytest.raises(UserError, match="rate_multiplier"):
        BagTokenEmbedding(VOCAB, MAX_LEN, DIM, rate_multiplier=0.0)


def test_bag_trains_above_chance_via_train_classifier(trained):
    result, _, te_y = trained
    assert result.mode == "scratch"
    assert result.val_macro_f1 > 0.8
    assert accuracy(te_y, result.predictions["test"]) > 0.8  # chance is 0.5


def test_bag_enforces_max_len_like_the_encoder():
    ids, y = make_docs(8, 0)
    too_long = np.pad(ids, ((0, 0), (0, 2)))  # (8, MAX_LEN + 2)
    cfg = FinetuneConfig(epochs=1, batch_size=8)
    factory = bag_of_embeddings_factory(VOCAB, MAX_LEN, DIM)
    with pytest.raises(UserError, match="max_len"):
        train_classifier(factory, (too_long, y), (ids, y), 2, "scratch", cfg, seed=0,
                         learning_rate=1e-3)


def test_bag_layer_registered_name_is_stable():
    # Saved `.keras` files name the class by this string; changing it orphans old artifacts.
    assert keras.saving.get_registered_name(BagTokenEmbedding) == "selfsup>BagTokenEmbedding"
    assert keras.saving.get_registered_object("selfsup>BagTokenEmbedding") is BagTokenEmbedding


def test_bag_classifier_round_trips_safe_mode(trained, tmp_path):
    result, te, _ = trained
    path = tmp_path / "bag.keras"
    result.model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    np.testing.assert_allclose(
        loaded.predict_on_batch(te), result.model.predict_on_batch(te), rtol=1e-6
    )
    np.testing.assert_array_equal(predict_classes(loaded, te, 8), result.predictions["test"])
    layer = loaded.get_layer("bag_of_embeddings").get_layer("bag_embedding")
    assert isinstance(layer, BagTokenEmbedding) and layer.max_len == MAX_LEN


def test_module_imports_neither_sklearn_nor_torch():
    tree = ast.parse(Path(bag_module.__file__).read_text("utf-8"))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    roots = {name.split(".")[0] for name in names}
    assert "keras" in roots and not roots & {"sklearn", "torch", "sentence_transformers"}


def test_the_baseline_stage_builds_the_bag_with_the_configured_multiplier():
    methods = scratch_baselines(VOCAB, MAX_LEN, None, BaselineConfig(bag_dim=DIM,
                                                                     bag_rate_multiplier=7.0))
    assert [(m.name, m.mode) for m in methods] == [("bag_of_embeddings", "scratch")]
    layer = methods[0].factory().get_layer("bag_embedding")
    assert (layer.rate_multiplier, layer.dim) == (7.0, DIM)
    assert BaselineConfig().bag_rate_multiplier == 300.0  # benchmarks/bag_rate.py's choice
