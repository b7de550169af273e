import keras
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from selfsup_model.config import ModelConfig
from selfsup_model.errors import UserError
from selfsup_model.nn.model import build_backbone, with_dropout
from selfsup_model.text.specials import BOS_ID, CLS_ID, EOS_ID, PAD_ID, SEP_ID
from selfsup_model.transfer.classify import (
    ClsPooling,
    LastTokenPooling,
    MaskedMeanPooling,
    build_classifier,
    check_encoder_length,
    encoder_inputs,
    is_causal,
    predict_in_batches,
    stratified_subset,
)
from tests.library.toy import make_docs

VOCAB, MAX_LEN, HIDDEN = 20, 8, 8


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


# ---------------------------------------------------------------- causal encoders


def test_last_token_pooling_takes_each_rows_last_real_state():
    states = np.arange(24, dtype=np.float32).reshape(2, 4, 3)
    ids = np.array([[5, 9, 6, PAD_ID], [5, 9, 10, 6]], np.int32)
    np.testing.assert_array_equal(np.asarray(LastTokenPooling()(states, ids)),
                                  [states[0, 2], states[1, 3]])


def test_a_causal_encoder_reads_bos_eos_and_is_never_pooled_at_position_zero():
    causal = build_backbone(VOCAB, MAX_LEN, ModelConfig(hidden=HIDDEN, layers=1, heads=2, ff=16),
                            causal=True)
    windows = np.array([[CLS_ID, 9, 10, SEP_ID, PAD_ID]], np.int32)
    assert is_causal(causal) and not is_causal(tiny_backbone())
    np.testing.assert_array_equal(encoder_inputs(causal, windows),
                                  [[BOS_ID, 9, 10, EOS_ID, PAD_ID]])
    np.testing.assert_array_equal(encoder_inputs(tiny_backbone(), windows), windows)
    with pytest.raises(UserError, match="causal"):
        build_classifier(causal, 2, pooling="cls")
    build_classifier(causal, 2, pooling="last")  # and mean: both read states that saw the text


def test_fine_tuning_dropout_is_its_own_setting_and_weights_carry_over():
    keras.utils.set_random_seed(0)
    encoder = tiny_backbone()  # pretrained with dropout 0
    rebuilt = with_dropout(encoder, 0.3)
    rates = {layer.rate for layer in rebuilt._flatten_layers()
             if isinstance(layer, keras.layers.Dropout)}
    assert rates == {0.3}
    for a, b in zip(rebuilt.get_weights(), encoder.get_weights()):
        np.testing.assert_array_equal(a, b)
    fresh = with_dropout(encoder, 0.3, keep_weights=False)
    assert not all(np.array_equal(a, b) for a, b in zip(fresh.get_weights(), encoder.get_weights()))


def test_errors_are_clear(pretrained):
    with pytest.raises(UserError, match="at least 2 classes"):
        build_classifier(pretrained(), 1)
    with pytest.raises(UserError, match="unknown pooling"):
        build_classifier(pretrained(), 2, pooling="max")
    too_long = np.pad(make_docs(8, 1)[0], ((0, 0), (0, 4)))  # past the last learned position
    with pytest.raises(UserError, match="same max_len"):
        check_encoder_length("train", too_long, pretrained())


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


class _RecordingModel:
    """Stands in for a Keras model: row sums of the ids, and the batch sizes it was called with."""

    output_shape = (None, 1)

    def __init__(self):
        self.calls: list[int] = []

    def predict_on_batch(self, batch):
        self.calls.append(len(batch))
        return batch.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("n, expected_calls", [(1, [1]), (3, [4]), (8, [8]), (9, [8, 1]),
                                               (13, [8, 8]), (0, [])])
def test_predict_in_batches_pads_short_batches_to_a_power_of_two(n, expected_calls):
    ids = np.arange(1, 3 * n + 1, dtype=np.int32).reshape(n, 3)
    model = _RecordingModel()
    out = predict_in_batches(model, ids, batch_size=8)
    np.testing.assert_array_equal(out, ids.sum(axis=1, keepdims=True))  # filler rows dropped
    assert model.calls == expected_calls


@pytest.mark.parametrize("pooling, causal", [("mean", False), ("cls", False), ("last", True),
                                             ("mean", True)])
def test_batches_cut_after_the_longest_real_row_give_the_full_window_outputs(pooling, causal):
    keras.utils.set_random_seed(1)
    length = 40
    encoder = build_backbone(VOCAB, length, ModelConfig(hidden=HIDDEN, layers=2, heads=2, ff=16,
                                                        dropout=0.0, norm="pre"), causal=causal)
    model = build_classifier(encoder, 3, pooling)
    rng = np.random.default_rng(0)
    real = rng.choice([1, 3, 9, 16, 17, 30, 40], size=37)  # unsorted, some full, one per batch
    ids = np.zeros((37, length), np.int32)
    for row, n in enumerate(real):
        ids[row, :n] = rng.integers(7, VOCAB, n)
    ids = encoder_inputs(encoder, ids)
    widths = []
    original = model.predict_on_batch

    def spy(batch):
        widths.append(batch.shape[1])
        return original(batch)

    model.predict_on_batch = spy
    got = predict_in_batches(model, ids, batch_size=8)
    full = np.asarray(original(ids))  # every row at its full 40 positions, in the caller's order
    np.testing.assert_allclose(got, full, rtol=0, atol=1e-5)
    assert min(widths) == 16 and max(widths) == length and sorted(widths) == widths
