"""Length-bucketed pretraining batches: assignment, coverage, purity, shapes, padding isolation."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest

from selfsup_model.config import MaskingConfig, ModelConfig
from selfsup_model.nn.losses import token_weighted_loss
from selfsup_model.nn.model import build_backbone, build_pretraining_model
from selfsup_model.pretraining.batches import PretrainBatches, bucket_lengths, real_lengths
from selfsup_model.text.specials import CLS_ID, NUM_SPECIAL, PAD_ID, SEP_ID
from selfsup_model.text.windows import causal_lm_batch

V, L = 40, 24
MASKS = MaskingConfig(max_predictions=5, select_rate=0.3)
MODEL = ModelConfig(hidden=16, layers=1, heads=2, ff=32, dropout=0.0)


def framed(real: list[int], length: int = L, seed: int = 0) -> np.ndarray:
    """(n, length) right-padded [CLS] ... [SEP] windows with the given real lengths."""
    rng = np.random.default_rng(seed)
    w = np.full((len(real), length), PAD_ID, dtype=np.int32)
    for i, n in enumerate(real):
        w[i, :n] = rng.integers(NUM_SPECIAL, V, size=n)
        w[i, 0], w[i, n - 1] = CLS_ID, SEP_ID
    return w


def varied(n: int, seed: int = 1) -> np.ndarray:
    return framed(list(np.random.default_rng(seed).integers(3, L + 1, size=n)), seed=seed)


def batches(windows, **kw) -> PretrainBatches:
    args = {"objective": "mlm", "batch_size": 4, "total_steps": 60, "seed": 3, "masking": MASKS,
            "vocab_size": V, "length_buckets": 3}
    return PretrainBatches(windows, **{**args, **kw})


def arrays(batch) -> list[np.ndarray]:
    return [np.asarray(a) for a in keras.tree.flatten(batch)]


def test_bucket_lengths_are_equal_slices_rounded_up_to_eight():
    assert bucket_lengths(64, 1) == (64,)
    assert bucket_lengths(64, 4) == (16, 32, 48, 64)
    assert bucket_lengths(20, 3) == (8, 16, 20)  # ceil(20/3) = 7 -> 8, 14 -> 16, capped at 20
    assert bucket_lengths(12, 4) == (8, 12)  # 3, 6 -> 8 merge; 9 -> 16 capped at 12
    assert bucket_lengths(5, 3) == (5,)  # too short to cut: one bucket, i.e. off


def test_each_window_goes_in_the_shortest_bucket_holding_its_real_tokens():
    windows = framed([3, 8, 9, 16, 17, 24, 20])  # L = 24, buckets (8, 16, 24)
    data = batches(windows)
    assert data.bucket_lengths == (8, 16, 24)
    np.testing.assert_array_equal(data.bucket_of, [0, 0, 1, 1, 2, 2, 2])
    count, extent = real_lengths(windows)
    np.testing.assert_array_equal(count, [3, 8, 9, 16, 17, 24, 20])
    np.testing.assert_array_equal(extent, count)  # right-padded: the same


def test_a_pass_is_full_bucket_batches_then_mixed_leftovers_shortest_in_the_short_batch():
    # 5 windows of bucket 8, 3 of bucket 16, 2 of bucket 24; B = 4 -> 3 batches per pass:
    # one full 8-batch; leftovers 1 x 8, 3 x 16, 2 x 24 cut from the long end:
    # [16, 16, 24, 24] -> length 24, then the short [8, 16] -> length 16.
    windows = framed([3, 4, 5, 6, 7, 10, 12, 14, 20, 24])
    data = batches(windows)
    assert data.batches_per_pass == 3
    for p in range(3):
        steps = range(3 * p, 3 * p + 3)
        got = sorted((len(data.window_indices(s)), data.step_length(s)) for s in steps)
        assert got == [(2, 16), (4, 8), (4, 24)]


def test_every_window_is_visited_once_per_pass_and_orders_differ():
    windows = varied(37)
    for size in (4, 5, 37, 50):
        data = batches(windows, batch_size=size)
        per_pass = data.batches_per_pass
        assert per_pass == -(-37 // size)
        seen = [np.concatenate([data.window_indices(s) for s in range(p * per_pass,
                                                                    (p + 1) * per_pass)])
                for p in range(3)]
        for order in seen:
            assert sorted(order) == list(range(37))
        if per_pass > 1:
            assert not np.array_equal(seen[0], seen[1])


@pytest.mark.parametrize("objective", ["mlm", "clm"])
@pytest.mark.parametrize("static", [False, True])
def test_batches_are_a_pure_function_of_the_step(objective, static):
    windows = varied(23)
    a, b = batches(windows, objective=objective, static_masks=static), batches(
        windows, objective=objective, static_masks=static, start_step=5)
    steps = [17, 5, 40, 6, 17, 59, 11, 5]  # any order, repeats, across passes
    first = {s: arrays(a.batch_for_step(s)) for s in steps}
    for s in reversed(steps):
        for x, y in zip(first[s], arrays(b[s - 5]), strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("objective", ["mlm", "clm"])
def test_every_shape_is_in_the_small_fixed_set_and_holds_its_windows(objective):
    windows = varied(41)
    data = batches(windows, objective=objective, batch_size=6, length_buckets=4)
    shift = 1 if objective == "clm" else 0
    shapes = data.shapes()
    assert len(shapes) <= len(data.bucket_lengths) + 1  # one short batch per pass at most
    _, extent = real_lengths(windows)
    for step in range(4 * data.batches_per_pass):
        x, y, w = data.batch_for_step(step)
        rows, length = x["input_ids"].shape
        assert (rows, length) in shapes and length + shift in data.bucket_lengths
        assert extent[data.window_indices(step)].max() <= length + shift
        if objective == "mlm":
            assert x["mask_positions"].shape == y.shape == w.shape == (rows, MASKS.max_predictions)
        else:
            assert y.shape == w.shape == (rows, length)


def legacy_batch(windows, step: int, size: int, seed: int):
    """The unbucketed rule, written out: stream positions [s*B, (s+1)*B) over passes, pass p in
    the order of permutation (seed, 0, p), corruption from (seed, 1, s)."""
    from selfsup_model.text.masking import mask_tokens

    stream = step * size + np.arange(size)
    passes, offsets = np.divmod(stream, len(windows))
    index = np.array([np.random.default_rng([seed, 0, p]).permutation(len(windows))[o]
                      for p, o in zip(passes, offsets, strict=True)])
    m = mask_tokens(windows[index], np.random.default_rng([seed, 1, step]), MASKS, V)
    return [m["input_ids"], m["mask_positions"], m["mask_ids"], m["mask_weights"]]


def test_one_bucket_reproduces_the_unbucketed_batches_exactly():
    windows = varied(10)
    data = batches(windows, length_buckets=1)
    assert data.shapes() == {(4, L)}
    for step in range(8):
        got = arrays(data.batch_for_step(step))  # flatten: input_ids, mask_positions, ids, w
        for x, y in zip(got, legacy_batch(windows, step, 4, 3), strict=True):
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes()


def test_real_token_counts_are_hand_computable_and_match_the_batches():
    windows = framed([3, 4, 5, 6, 7, 10, 12, 14, 20, 24])  # 105 real tokens in all
    for objective in ("mlm", "clm"):
        data = batches(windows, objective=objective)
        steps = [data.step_tokens(s) for s in range(3)]  # one whole pass
        for s, t in enumerate(steps):
            ids = data.batch_for_step(s)[0]["input_ids"]
            assert (t.rows, t.length) == ids.shape
            assert t.real == np.count_nonzero(ids != PAD_ID)
        if objective == "mlm":
            assert sum(t.real for t in steps) == 105
            assert sorted(t.positions for t in steps) == [32, 32, 96]  # 2x16, 4x8, 4x24
        else:  # inputs x[:, :Lb-1]: only the window filling max_len loses a token, as unbucketed
            assert sum(t.real for t in steps) == 105 - 1
    unbucketed = batches(windows, length_buckets=1, batch_size=5)
    counts = [unbucketed.step_tokens(s) for s in range(2)]
    assert [t.positions for t in counts] == [5 * L, 5 * L]
    assert sum(t.real for t in counts) == 105


def _loss(model, x, y, w) -> float:
    return float(keras.ops.convert_to_numpy(token_weighted_loss(y, model(x), w)))


def test_mlm_loss_on_a_trimmed_batch_equals_the_loss_padded_to_max_len():
    keras.utils.set_random_seed(0)
    model = build_pretraining_model(build_backbone(V, L, MODEL), "mlm", MODEL)
    data = batches(varied(30), length_buckets=3)
    step = next(s for s in range(20) if data.step_length(s) < L)
    x, y, w = data.batch_for_step(step)
    rows, length = x["input_ids"].shape
    padded = np.full((rows, L), PAD_ID, dtype=np.int32)
    padded[:, :length] = x["input_ids"]
    full = {"input_ids": padded, "mask_positions": x["mask_positions"]}
    assert w.sum() > 0 and length < L
    assert _loss(model, x, y, w) == pytest.approx(_loss(model, full, y, w), abs=1e-5)


def test_clm_loss_on_a_trimmed_batch_equals_the_loss_padded_to_max_len():
    keras.utils.set_random_seed(0)
    model = build_pretraining_model(build_backbone(V, L, MODEL, causal=True), "clm", MODEL)
    windows = varied(30)
    data = batches(windows, objective="clm", length_buckets=3)
    step = next(s for s in range(20) if data.step_length(s) < L)
    x, y, w = data.batch_for_step(step)
    full = causal_lm_batch(windows[data.window_indices(step)])  # (B, L-1), never trimmed
    assert x["input_ids"].shape[1] < L - 1 and w.sum() == full["loss_weights"].sum()
    trimmed = _loss(model, x, y, w)
    assert trimmed == pytest.approx(_loss(model, {"input_ids": full["input_ids"]},
                                          full["target_ids"], full["loss_weights"]), abs=1e-5)


def test_a_bucketed_run_trains_and_counts_real_tokens(tmp_path):
    from tests.pretraining.test_pretraining import L as RUN_L
    from tests.pretraining.test_pretraining import tiny_run, topic_windows

    result = tiny_run(str(tmp_path), steps=20, checkpoint_every=10, length_buckets=3)
    data = batches(topic_windows(512, 0), batch_size=16, seed=42, length_buckets=3)
    counts = [data.step_tokens(s) for s in range(20)]
    assert data.bucket_lengths == (8, RUN_L)
    assert result.tokens_seen == sum(t.positions for t in counts) < 20 * 16 * RUN_L
    assert result.real_tokens_seen == sum(t.real for t in counts)
    assert result.real_tokens_per_s > 0 and result.tokens_per_s >= result.real_tokens_per_s
    history = json.loads(result.history_path.read_text())
    assert history[-1]["train/tokens_seen"] == result.tokens_seen
    assert history[-1]["train/real_tokens_seen"] == result.real_tokens_seen
    assert np.isfinite(result.val_metrics["val/mlm_loss"])
