"""The same-document contrastive term: its loss by hand, paired batches, and a model whose loss
is exactly the objective's plus the weighted term."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest

from selfsup_model.config import MaskingConfig, ModelConfig, PretrainConfig
from selfsup_model.errors import UserError
from selfsup_model.nn.losses import paired_info_nce, token_weighted_loss
from selfsup_model.nn.model import PretrainingModel, build_backbone, build_pretraining_model
from selfsup_model.pretraining.batches import PretrainBatches
from selfsup_model.text.specials import CLS_ID, NUM_SPECIAL, PAD_ID, SEP_ID

V, L = 40, 16
MASKS = MaskingConfig(max_predictions=4, select_rate=0.3)
MODEL = ModelConfig(hidden=16, layers=1, heads=2, ff=32, dropout=0.0, norm="pre")
# 7 documents of 3, 1, 2, 4, 1, 2 and 3 windows: 16 windows.
OFFSETS = np.array([0, 3, 4, 6, 10, 11, 13, 16])


def windows(seed: int = 0) -> np.ndarray:
    """16 windows of random real lengths 3..L, framed [CLS] ... [SEP], right-padded."""
    rng = np.random.default_rng(seed)
    w = np.full((16, L), PAD_ID, dtype=np.int32)
    for i in range(16):
        n = int(rng.integers(3, L + 1))
        w[i, 0], w[i, n - 1] = CLS_ID, SEP_ID
        w[i, 1:n - 1] = rng.integers(NUM_SPECIAL, V, size=n - 2)
    return w


def document_of(window: np.ndarray) -> np.ndarray:
    return np.searchsorted(OFFSETS, window, side="right") - 1


def paired(**kw) -> PretrainBatches:
    args = {"objective": "mlm", "batch_size": 8, "total_steps": 20, "seed": 5, "masking": MASKS,
            "vocab_size": V, "pairs": True, "doc_offsets": OFFSETS}
    return PretrainBatches(windows(), **{**args, **kw})


def test_info_nce_by_hand():
    # Pairs (row 0, row 1) and (row 2, row 3); the vectors' lengths must not matter.
    pooled = np.array([[2.0, 0.0], [1.0, 0.0], [0.0, 3.0], [0.0, 1.0]], dtype=np.float32)
    # Similarities [[1, 0], [0, 1]] at temperature 1: each row's loss is log(1 + e^-1).
    got = float(keras.ops.convert_to_numpy(paired_info_nce(pooled, 1.0)))
    assert got == pytest.approx(math.log(1 + math.exp(-1)), abs=1e-6)
    # At temperature 0.5 the same pairs are told apart more sharply: log(1 + e^-2).
    got = float(keras.ops.convert_to_numpy(paired_info_nce(pooled, 0.5)))
    assert got == pytest.approx(math.log(1 + math.exp(-2)), abs=1e-6)
    # Swapped partners: the off-diagonal wins, log(1 + e^1) both ways.
    swapped = pooled[[0, 3, 2, 1]]
    got = float(keras.ops.convert_to_numpy(paired_info_nce(swapped, 1.0)))
    assert got == pytest.approx(math.log(1 + math.e), abs=1e-6)


@pytest.mark.parametrize("buckets", [1, 2])
def test_partners_share_the_anchor_document_and_every_window_anchors_once_a_pass(buckets):
    data = paired(length_buckets=buckets)
    rows_per_pass = data.batches_per_pass
    assert rows_per_pass == math.ceil(16 / 4)
    for pass_index in range(2):
        steps = range(pass_index * rows_per_pass, (pass_index + 1) * rows_per_pass)
        anchors, partners = [], []
        for step in steps:
            index = data.window_indices(step)
            assert len(index) % 2 == 0
            anchors += list(index[0::2])
            partners += list(index[1::2])
        assert sorted(anchors) == list(range(16))
        anchors, partners = np.array(anchors), np.array(partners)
        np.testing.assert_array_equal(document_of(anchors), document_of(partners))
        sizes = np.diff(OFFSETS)[document_of(anchors)]
        # A window of a multi-window document pairs with another window; a lone one, itself.
        assert np.all((partners != anchors) == (sizes > 1))


def test_paired_batches_are_pure_functions_of_the_step_and_keep_every_real_token():
    data, again = paired(length_buckets=2), paired(length_buckets=2, start_step=5)
    for step in range(5, 20):
        (x, y, w), (x2, y2, w2) = data.batch_for_step(step), again[step - 5]
        np.testing.assert_array_equal(x["input_ids"], x2["input_ids"])
        np.testing.assert_array_equal(y, y2)
        np.testing.assert_array_equal(w, w2)
        index = data.window_indices(step)
        real = np.count_nonzero(windows()[index] != PAD_ID, axis=1)
        assert x["input_ids"].shape == (len(index), data.step_length(step))
        assert np.all(real <= x["input_ids"].shape[1])  # a partner never loses a real token
        np.testing.assert_array_equal(np.count_nonzero(x["input_ids"] != PAD_ID, axis=1), real)


def test_pairs_are_bucketed_by_their_longer_window_and_fixed_within_a_pass():
    data, rows = paired(length_buckets=4, total_steps=40), 4
    assert data.bucket_lengths == (8, 16) and data.batches_per_pass == rows
    for p in range(10):
        steps = range(p * rows, (p + 1) * rows)
        pairs = [data.window_indices(s).reshape(-1, 2) for s in steps]
        # Within a pass each window anchors once, with one partner.
        assert sorted(np.concatenate(pairs)[:, 0]) == list(range(16))
        pair_bucket = [data.bucket_of[b].max(axis=1) for b in pairs]  # each pair's longer window
        for s, buckets in zip(steps, pair_bucket, strict=True):
            assert data.step_length(s) == data.bucket_lengths[buckets.max()]  # no longer
        # The pass fills whole batches bucket by bucket before mixing leftovers: as many
        # single-bucket batches per bucket as its pairs fill (partners drawn per batch, after
        # bucketing the anchors alone, would mix a bucket's pairs into other batches).
        every = np.concatenate(pair_bucket)
        for b in range(2):
            whole = sum(bool(np.all(x == b)) and len(x) == rows for x in pair_bucket)
            assert whole >= np.count_nonzero(every == b) // rows
    partners = [dict(map(tuple, np.concatenate(
        [data.window_indices(s).reshape(-1, 2) for s in range(p * rows, (p + 1) * rows)])))
        for p in range(10)]
    assert any(partners[p] != partners[0] for p in range(1, 10))  # passes redraw them


def test_pairing_refuses_bad_offsets_and_odd_batches():
    with pytest.raises(UserError, match="offsets"):
        paired(doc_offsets=np.array([0, 3, 15]))  # ends before the last window
    with pytest.raises(UserError, match="offsets"):
        paired(doc_offsets=None)
    with pytest.raises(UserError, match="even"):
        paired(batch_size=7)
    with pytest.raises(ValueError, match="even"):
        PretrainConfig(contrastive_weight=0.1, batch_size=9)
    PretrainConfig(contrastive_weight=0.0, batch_size=9)  # no term, no pairing: any size


@pytest.mark.parametrize("objective", ["mlm", "clm"])
def test_loss_is_the_objective_loss_plus_the_weighted_term(objective):
    data = paired(objective=objective)
    x, y, w = data.batch_for_step(0)
    backbone = build_backbone(V, L, MODEL, causal=objective == "clm", seed=1)
    model = build_pretraining_model(backbone, objective, MODEL, seed=1,
                                    contrastive_weight=0.3, contrastive_temperature=0.1)
    logits, pooled = model(x)
    ids = keras.ops.convert_to_numpy(x["input_ids"])
    states = keras.ops.convert_to_numpy(backbone(ids))
    real = (ids != PAD_ID)[..., None]
    mean = (states * real).sum(1) / real.sum(1)  # the masked mean, by hand
    np.testing.assert_allclose(keras.ops.convert_to_numpy(pooled), mean, atol=1e-5)
    expected = (float(keras.ops.convert_to_numpy(token_weighted_loss(y, logits, w)))
                + 0.3 * float(keras.ops.convert_to_numpy(paired_info_nce(mean, 0.1))))
    got = float(keras.ops.convert_to_numpy(model.compute_loss(x, y, [logits, pooled], w)))
    assert got == pytest.approx(expected, abs=1e-5)
    plain = build_pretraining_model(backbone, objective, MODEL, seed=1)
    assert not isinstance(plain(x), (list, tuple))  # no term: the objective's output alone


def test_a_paired_model_trains_logs_its_term_and_round_trips(tmp_path):
    data = paired(total_steps=6)
    backbone = build_backbone(V, L, MODEL, seed=1)
    model = build_pretraining_model(backbone, "mlm", MODEL, seed=1, contrastive_weight=0.5)
    model.compile(optimizer=keras.optimizers.Adam(1e-2))
    history = model.fit(data, epochs=1, steps_per_epoch=6, verbose=0, shuffle=False).history
    term = history["contrastive_loss_sum"][-1]  # the sum over the epoch's 6 steps
    assert np.isfinite(term) and term > 0
    path = tmp_path / "paired.keras"
    model.save(path)
    again = keras.saving.load_model(path, safe_mode=True)
    assert isinstance(again, PretrainingModel)
    assert (again.contrastive_weight, again.contrastive_temperature) == (0.5, 0.05)
    x, _, _ = data.batch_for_step(0)
    for a, b in zip(model(x), again(x), strict=True):
        np.testing.assert_allclose(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b),
                                   atol=1e-6)


def test_pretraining_with_the_term_logs_it_beside_the_objective_loss(tmp_path):
    from selfsup_model.pretraining.loop import pretrain
    from selfsup_model.text.masking import make_static_masks

    cfg = PretrainConfig(batch_size=8, steps=8, learning_rate=1e-2, warmup_steps=2, log_every=4,
                         eval_every=8, checkpoint_every=8, contrastive_weight=0.2)
    logged = []
    val = make_static_masks(windows(1), MASKS, V, seed=7)
    result = pretrain(windows(), val, V, MODEL, cfg, MASKS, tmp_path,
                      log_metrics=lambda m, step: logged.append(m), progress=False,
                      doc_offsets=OFFSETS)
    assert result.steps == 8 and [m.get("train/contrastive_loss") is not None
                                  for m in logged] == [True, True]
    # log(4) at chance for 4 pairs: a mean of per-step values, not a running sum.
    assert all(0 < m["train/contrastive_loss"] < 2 * math.log(4) for m in logged)
    with pytest.raises(UserError, match="offsets"):
        pretrain(windows(), val, V, MODEL, cfg, MASKS, tmp_path / "again", progress=False)
