import keras
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from selfsup_model.classify import (
    ClsPooling,
    MaskedMeanPooling,
    TwoRateAdam,
    build_classifier,
    class_ids,
    predict_classes,
    stratified_subset,
    train_classifier,
)
from selfsup_model.config import FinetuneConfig, ModelConfig
from selfsup_model.errors import UserError
from selfsup_model.metrics import macro_f1
from selfsup_model.model import build_backbone
from selfsup_model.specials import CLS_ID, PAD_ID, SEP_ID
from tests.model.toy import make_docs

VOCAB, MAX_LEN, HIDDEN = 20, 8, 8
CFG = FinetuneConfig(epochs=2, batch_size=8, patience=1, dropout=0.0)


def tiny_backbone() -> keras.Model:
    """The real encoder at test size: int32 ids (B, L) -> states (B, L, H)."""
    return build_backbone(VOCAB, MAX_LEN,
                          ModelConfig(hidden=HIDDEN, layers=1, heads=2, ff=16, dropout=0.0))


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A factory that loads a saved backbone, as fine-tuning loads encoder.keras."""
    keras.utils.set_random_seed(0)
    path = tmp_path_factory.mktemp("enc") / "encoder.keras"
    tiny_backbone().save(path)
    return lambda: keras.saving.load_model(path, safe_mode=True)


def backbone_weights(model: keras.Model) -> list[np.ndarray]:
    return [np.array(w) for w in model.get_layer("backbone").get_weights()]


# ---------------------------------------------------------------- pooling


def test_masked_mean_pooling_hand_computed_and_all_pad_row():
    states = np.array([[[1.0, 2.0], [3.0, 6.0], [100.0, 100.0]],
                       [[5.0, 5.0], [7.0, 7.0], [9.0, 9.0]]], np.float32)  # (2, 3, 2)
    ids = np.array([[CLS_ID, 9, PAD_ID], [PAD_ID, PAD_ID, PAD_ID]], np.int32)
    pooled = np.asarray(MaskedMeanPooling()(states, ids))
    np.testing.assert_allclose(pooled, [[2.0, 4.0], [0.0, 0.0]])  # no NaN for an empty row


@pytest.mark.parametrize("pad_value", [0.0, -1e6, np.nan, np.inf])
def test_masked_mean_pooling_ignores_pad_length_and_content(pad_value):
    rng = np.random.default_rng(0)
    real = rng.normal(size=(1, 4, 3)).astype(np.float32)  # 4 real tokens
    pool = MaskedMeanPooling()
    pooled = []
    for pad_len in (0, 1, 5):
        states = np.concatenate([real, np.full((1, pad_len, 3), pad_value, np.float32)], axis=1)
        ids = np.array([[CLS_ID, 9, 10, SEP_ID] + [PAD_ID] * pad_len], np.int32)
        pooled.append(np.asarray(pool(states, ids)))
    for p in pooled:
        np.testing.assert_allclose(p, real.mean(axis=1), rtol=1e-6)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_classifier_output_independent_of_padding(pooling):
    keras.utils.set_random_seed(0)
    model = build_classifier(tiny_backbone(), 3, pooling=pooling, dropout=0.0)
    doc = [CLS_ID, 9, 14, 11, SEP_ID]
    logits = [np.asarray(model(np.array([doc + [PAD_ID] * pad], np.int32))) for pad in (0, 1, 3)]
    for other in logits[1:]:
        np.testing.assert_allclose(other, logits[0], atol=1e-5)


def test_cls_pooling_takes_position_zero():
    states = np.arange(12, dtype=np.float32).reshape(1, 4, 3)
    ids = np.array([[CLS_ID, 9, SEP_ID, PAD_ID]], np.int32)
    np.testing.assert_array_equal(np.asarray(ClsPooling()(states, ids)), [[0.0, 1.0, 2.0]])


# ---------------------------------------------------------------- training modes


@pytest.fixture(scope="module")
def probe_runs(pretrained):
    """Two identical probe trainings that differ only in the unlabelled "test" set they predict."""
    train, val = make_docs(32, 1), make_docs(16, 2)
    fixed = make_docs(10, 9)[0]
    # A brisk head rate: validation F1 moves between epochs (on TF), so selection matters.
    cfg = FinetuneConfig(epochs=6, batch_size=8, patience=2, dropout=0.2, head_learning_rate=0.1)
    runs = []
    for test_seed in (5, 6):
        test_ids = make_docs(12 + test_seed, test_seed)[0]
        runs.append(train_classifier(pretrained, train, val, 2, "probe", cfg, seed=3,
                                     eval_sets={"test": test_ids, "fixed": fixed}))
    return runs, val, cfg


def test_probe_changes_no_backbone_weight(pretrained, probe_runs):
    (result, _), _, _ = probe_runs
    before = backbone_weights(build_classifier(pretrained(), 2))
    after = backbone_weights(result.model)
    assert len(after) == len(before) > 0
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a, b)
    # Only the head can learn.
    assert ([v.path for v in result.model.trainable_variables]
            == ["head_logits/kernel", "head_logits/bias"])


def test_selection_uses_validation_only(probe_runs):
    (a, b), val, cfg = probe_runs
    assert len({h["loss"] for h in a.history}) == len(a.history) > 1  # it did train
    # Different test sets, same selection: test data played no part in it.
    assert a.history == b.history and a.best_epoch == b.best_epoch
    assert a.val_macro_f1 == b.val_macro_f1
    np.testing.assert_array_equal(a.predictions["fixed"], b.predictions["fixed"])
    np.testing.assert_array_equal(a.val_predictions, b.val_predictions)
    # The returned model is the best validation epoch, and patience bounds the run.
    assert a.val_macro_f1 == max(h["val_macro_f1"] for h in a.history)
    assert macro_f1(val[1], predict_classes(a.model, val[0])) == a.val_macro_f1
    assert a.epochs_run == cfg.epochs or a.epochs_run - a.best_epoch == cfg.patience


def test_full_changes_backbone_and_round_trips(pretrained, tmp_path):
    before = backbone_weights(build_classifier(pretrained(), 2))
    result = train_classifier(pretrained, make_docs(16, 1), make_docs(8, 2), 2, "full", CFG, seed=1)
    changed = [not np.array_equal(a, b) for a, b in zip(backbone_weights(result.model), before)]
    # Nearly all, not all: e.g. an attention key bias has an exactly-zero gradient.
    assert sum(changed) >= 0.9 * len(changed)
    assert isinstance(result.model.optimizer, TwoRateAdam)
    path = tmp_path / "classifier.keras"
    result.model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    ids = make_docs(8, 3)[0]
    np.testing.assert_allclose(loaded.predict(ids, verbose=0), result.model.predict(ids, verbose=0),
                               atol=1e-6)


def test_two_rate_adam_scales_the_encoder_step():
    enc, head = keras.Variable(np.zeros(3, np.float32)), keras.Variable(np.zeros(3, np.float32))
    opt = TwoRateAdam(learning_rate=0.1, scaled_paths=[enc.path], scale=0.25)
    grad = np.array([1.0, -2.0, 3.0], np.float32)
    opt.apply([grad, grad], [enc, head])
    # Adam's first step is lr * sign(g) (bias-corrected m / sqrt(v) = ±1).
    np.testing.assert_allclose(np.asarray(head), -0.1 * np.sign(grad), rtol=1e-4)
    np.testing.assert_allclose(np.asarray(enc), -0.025 * np.sign(grad), rtol=1e-4)


def test_scratch_starts_from_fresh_weights(tmp_path):
    # A "pretrained" backbone whose weights are all 0.5: scratch must not start from them.
    marked = tiny_backbone()
    marked.set_weights([np.full_like(w, 0.5) for w in marked.get_weights()])
    marked.save(tmp_path / "encoder.keras")

    def factory():
        return keras.saving.load_model(tmp_path / "encoder.keras", safe_mode=True)

    frozen_lr = FinetuneConfig(epochs=1, batch_size=16, head_learning_rate=1e-12,
                               encoder_learning_rate=1e-12)
    result = train_classifier(factory, make_docs(16, 1), make_docs(8, 2), 2, "scratch", frozen_lr,
                              seed=1)
    for w in backbone_weights(result.model):
        assert not np.allclose(w, 0.5)
    assert ([w.shape for w in backbone_weights(result.model)]
            == [w.shape for w in marked.get_weights()])


def test_training_errors_are_clear(pretrained):
    ids, y = make_docs(8, 1)
    with pytest.raises(UserError, match="single label"):
        train_classifier(pretrained, (ids, np.zeros(8, int)), (ids, y), 2, "probe", CFG, seed=0)
    with pytest.raises(UserError, match="unknown fine-tuning mode"):
        train_classifier(pretrained, (ids, y), (ids, y), 2, "linear", CFG, seed=0)
    too_long = np.pad(ids, ((0, 0), (0, 4)))  # (8, MAX_LEN + 4): past the last learned position
    with pytest.raises(UserError, match="same max_len"):
        train_classifier(pretrained, (too_long, y), (ids, y), 2, "probe", CFG, seed=0)
    with pytest.raises(UserError, match="at least 2 classes"):
        build_classifier(pretrained(), 1)
    with pytest.raises(UserError, match="not in the training label set"):
        class_ids(["a", "z"], ["a", "b"])
    np.testing.assert_array_equal(class_ids(["b", "a", "b"], ["a", "b"]), [1, 0, 1])


# ---------------------------------------------------------------- label subsets


@settings(max_examples=80, deadline=None)
@given(
    labels=st.lists(st.sampled_from("abcdefg"), min_size=1, max_size=200),
    fraction=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_stratified_subset_properties(labels, fraction, seed):
    labels = np.array(labels)
    idx = stratified_subset(labels, fraction, seed)
    n_labels = len(set(labels))
    assert set(labels[idx]) == set(labels)  # every label kept
    assert len(np.unique(idx)) == len(idx) and idx.min() >= 0 and idx.max() < len(labels)
    assert np.all(np.diff(idx) > 0)
    assert abs(len(idx) - fraction * len(labels)) <= n_labels
    np.testing.assert_array_equal(idx, stratified_subset(labels, fraction, seed))


def test_stratified_subset_keeps_label_proportions():
    labels = np.array(["a"] * 80 + ["b"] * 20)
    idx = stratified_subset(labels, 0.25, seed=1)
    assert len(idx) == 25 and (labels[idx] == "a").sum() == 20
    np.testing.assert_array_equal(stratified_subset(labels, 1.0, seed=1), np.arange(100))
    with pytest.raises(UserError, match="in \\(0, 1\\]"):
        stratified_subset(labels, 0.0, seed=1)
    with pytest.raises(UserError, match="empty"):
        stratified_subset([], 0.5, seed=1)
