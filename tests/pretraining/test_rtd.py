"""Replaced-token detection (pretrain.objective=rtd): the draw, the placement and the loss by
hand, the model's loss as exactly its two parts, the stored validation corruption, a saved
model that recomputes its logged numbers, and a stopped run that resumes to the same result."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest

from selfsup_model.config import PretrainConfig
from selfsup_model.errors import UserError
from selfsup_model.nn.losses import numpy_weighted_ce_sum, token_weighted_bce
from selfsup_model.nn.model import (
    ReplacedTokenExportModel,
    build_backbone,
    build_rtd_model,
    place_replacements,
    sample_replacements,
)
from selfsup_model.pretraining import callbacks
from selfsup_model.pretraining.batches import PretrainBatches
from selfsup_model.pretraining.continued import InitSource
from selfsup_model.pretraining.evaluation import (
    detection_corruption,
    numpy_weighted_bce_sum,
    unigram_log_probs,
    validation_metrics,
)
from selfsup_model.pretraining.loop import DETECTION_FILE, pretrain
from selfsup_model.text.masking import load_arrays, make_static_masks
from selfsup_model.text.specials import NUM_SPECIAL, PAD_ID
from tests.pretraining.test_pretraining import MASKS, MODEL, V, topic_windows


def _np(x):
    return keras.ops.convert_to_numpy(x)


def test_a_draw_follows_the_generator_by_inverse_cdf_and_never_yields_a_special_token():
    # V = 10: ids 7, 8, 9 are the only non-special ones; the specials get the largest logits.
    logits = np.full((1, 5, 10), 50.0, dtype=np.float32)
    logits[..., 7:] = np.log([2.0, 1.0, 1.0])  # probabilities 1/2, 1/4, 1/4 once specials go
    uniform = np.array([[0.0, 0.49, 0.51, 0.76, 0.999999]], dtype=np.float32)
    assert _np(sample_replacements(logits, uniform)).tolist() == [[7, 7, 8, 9, 9]]


def test_samples_replace_selected_positions_only_and_drawing_the_original_is_no_replacement():
    original = np.array([[2, 10, 11, 12, 3, 0]], dtype=np.int32)
    positions = np.array([[1, 3, 0]], dtype=np.int32)  # the third is padding (weight 0)
    weights = np.array([[1.0, 1.0, 0.0]], dtype=np.float32)
    sampled = np.array([[20, 12, 30]], dtype=np.int32)  # position 3 draws its own token
    ids, replaced = place_replacements(original, positions, weights, sampled)
    assert _np(ids).tolist() == [[2, 20, 11, 12, 3, 0]]
    assert _np(replaced).tolist() == [[0, 1, 0, 0, 0, 0]]


def test_detection_loss_by_hand_counts_only_weighted_tokens():
    targets = np.array([[1.0, 0.0, 1.0]])
    logits = np.array([[0.0, math.log(3.0), 1e9]], dtype=np.float32)  # the last: not counted
    weights = np.array([[1.0, 1.0, 0.0]])
    expected = (math.log(2.0) + math.log(4.0)) / 2  # -log sigmoid(0), -log(1 - sigmoid(ln 3))
    assert float(_np(token_weighted_bce(targets, logits, weights))) == pytest.approx(expected,
                                                                                    rel=1e-6)
    loss_sum, correct_sum, weight_sum = numpy_weighted_bce_sum(targets, logits, weights)
    assert loss_sum / weight_sum == pytest.approx(expected, rel=1e-7)  # ln 3 in float32
    assert (correct_sum, weight_sum) == (0.0, 2.0)  # logit 0 says "original", ln 3 "replaced"


def _batch(windows: np.ndarray, step: int = 0):
    data = PretrainBatches(windows, objective="rtd", batch_size=8, total_steps=4, seed=5,
                           masking=MASKS, vocab_size=V)
    return data, data[step]


def test_rtd_batches_carry_the_originals_and_seeded_draws_as_a_pure_function_of_the_step():
    windows = topic_windows(32, 3)
    data, (x, _, w) = _batch(windows, 2)
    rows = data.window_indices(2)
    np.testing.assert_array_equal(x["original_ids"], windows[rows])
    np.testing.assert_array_equal(x["mask_weights"], w)
    assert x["sample_uniform"].shape == x["mask_positions"].shape
    assert x["sample_uniform"].dtype == np.float32
    assert ((x["sample_uniform"] >= 0) & (x["sample_uniform"] < 1)).all()
    again = _batch(windows, 2)[1][0]  # rebuilt from scratch: the same draws
    np.testing.assert_array_equal(again["sample_uniform"], x["sample_uniform"])
    assert not np.array_equal(data[1][0]["sample_uniform"], x["sample_uniform"])


def test_the_model_loss_is_the_generators_masked_lm_loss_plus_the_weighted_detection_loss():
    windows = topic_windows(32, 4)
    _, (x, y, w) = _batch(windows)
    backbone = build_backbone(V, windows.shape[1], MODEL, seed=1)
    model = build_rtd_model(backbone, MODEL, generator_blocks=1, rtd_weight=7.0, seed=2)
    generated, detected, replaced = (_np(t) for t in model(x, training=False))
    loss = float(_np(model.compute_loss(x, y, model(x, training=False), w, training=False)))
    ce_sum, ce_weight = numpy_weighted_ce_sum(y, generated, w)
    real = (x["original_ids"] >= NUM_SPECIAL).astype(np.float64)  # never [PAD], never special
    bce_sum, _, bce_weight = numpy_weighted_bce_sum(replaced, detected, real)
    assert loss == pytest.approx(ce_sum / ce_weight + 7.0 * bce_sum / bce_weight, rel=1e-5)
    # Replacements land only where the masks selected, and only real tokens are scored.
    assert (replaced[w.sum(axis=1) == 0] == 0).all()
    assert bce_weight == real.sum() and bce_weight < (x["original_ids"] != PAD_ID).sum()
    metrics = {m.name: m for m in model.metrics}
    assert float(_np(metrics["rtd_loss"].weight_sum)) == real.sum()


def test_the_stored_validation_corruption_replaces_selected_tokens_from_the_unigram_model():
    windows = topic_windows(64, 1)
    val = make_static_masks(windows, MASKS, V, seed=7)
    log_probs = unigram_log_probs(topic_windows(256, 0), V, "rtd")
    corruption = detection_corruption(val, log_probs, seed=11)
    again = detection_corruption(val, log_probs, seed=11)
    for key in corruption:
        np.testing.assert_array_equal(corruption[key], again[key])
    changed = corruption["input_ids"] != windows
    selected = val["loss_weights"] > 0
    assert not (changed & ~selected).any()  # nothing outside the selected positions moves
    assert (corruption["input_ids"][selected] >= NUM_SPECIAL).all()  # never a special token
    np.testing.assert_array_equal(corruption["replaced"], changed.astype(np.float32))
    np.testing.assert_array_equal(corruption["weights"], (windows >= NUM_SPECIAL))
    # A draw equal to the original is no replacement: some are, with 5-id topics.
    assert 0 < corruption["replaced"].sum() < selected.sum()


def _config(**kw) -> PretrainConfig:
    base = {"objective": "rtd", "batch_size": 16, "steps": 20, "learning_rate": 2e-2,
            "warmup_steps": 4, "log_every": 10, "eval_every": 10, "checkpoint_every": 10}
    return PretrainConfig(**{**base, **kw})


def _run(out, cfg: PretrainConfig, logged: list | None = None, dropout: float = 0.1):
    val = make_static_masks(topic_windows(64, 1), MASKS, V, seed=7)
    model = MODEL.model_copy(update={"dropout": dropout})

    def log_metrics(metrics, step):
        if logged is not None:
            logged.append({"step": step, **metrics})

    return pretrain(topic_windows(512, 0), val, V, model, cfg, MASKS, out,
                    log_metrics=log_metrics, progress=False), val


@pytest.fixture(scope="module")
def rtd_run(tmp_path_factory):
    out, logged = tmp_path_factory.mktemp("rtd"), []
    result, val = _run(out, _config(), logged)
    return out, result, val, logged


def test_an_rtd_run_logs_both_losses_and_its_saved_model_recomputes_them(rtd_run):
    out, result, val, logged = rtd_run
    final = logged[-1]
    # The discriminator scores every real token, the generator the selected ones only.
    assert result.detection_scored_tokens > 2 * result.scored_tokens > 0
    for key in ("train/mlm_loss", "train/rtd_loss", "train/rtd_scored_tokens",
                "val/mlm_loss", "val/rtd_loss", "val/rtd_accuracy", "val/rtd_scored_tokens"):
        assert key in final, key
    # The generator learns the topics: below the unigram model on the masked positions.
    assert final["val/mlm_loss"] < final["val/unigram_baseline_loss"]
    export = keras.saving.load_model(out / "pretrain_model.keras", safe_mode=True)
    assert isinstance(export, ReplacedTokenExportModel) and export.objective == "rtd"
    detection = load_arrays(out / DETECTION_FILE)
    again = validation_metrics(export, "rtd", val, batch_size=7, detection=detection)
    for key, value in again.items():
        assert value == pytest.approx(final[key], abs=1e-5), key
    # The encoder handed to fine-tuning is the discriminator.
    encoder = keras.saving.load_model(out / "encoder.keras", safe_mode=True)
    for a, b in zip(encoder.get_weights(), export.backbone.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_stopped_rtd_run_resumes_from_its_checkpoint_to_the_same_result(tmp_path, rtd_run,
                                                                          monkeypatch):
    _, reference, _, ref_logged = rtd_run
    original = callbacks.CheckpointSaver.on_epoch_end

    class Stop(Exception):
        pass

    def stop_after_first(self, epoch, logs=None):
        original(self, epoch, logs)
        raise Stop  # as if killed right after the step-10 checkpoint

    monkeypatch.setattr(callbacks.CheckpointSaver, "on_epoch_end", stop_after_first)
    with pytest.raises(Stop):
        _run(tmp_path, _config())
    monkeypatch.setattr(callbacks.CheckpointSaver, "on_epoch_end", original)
    logged = []
    resumed, _ = _run(tmp_path, _config(), logged)
    assert resumed.resumed_from_step == 10
    # Same batches, generator draws, dropout and optimiser state: the same numbers.
    assert resumed.val_metrics == pytest.approx(reference.val_metrics, abs=1e-6)
    for key, value in ref_logged[-1].items():
        if not key.endswith("_per_s"):  # speeds are measured, not replayed
            assert logged[-1][key] == pytest.approx(value, abs=1e-6), key


def _source(out) -> InitSource:
    return InitSource(workdir=out, tokenizer=out / "tokenizer.json",
                      pretrain_model=out / "pretrain_model.keras", tokenizer_sha256="tok",
                      pretrain_model_sha256="model", encoder_sha256="encoder")


def test_continuing_an_rtd_run_starts_from_its_generator_detector_and_encoder(tmp_path, rtd_run):
    out, reference, val, _ = rtd_run
    # A rate of 1e-12: the continued weights stay the source's, so its validation numbers
    # (the generator's masked-LM loss, the encoder and detector's detection loss) are the
    # source's final ones; fresh generator or detection weights would score far off.
    cfg = _config(steps=2, learning_rate=1e-12, warmup_steps=0, eval_every=2, log_every=2)
    continued = pretrain(topic_windows(512, 0), val, V, MODEL.model_copy(update={"dropout": 0.1}),
                         cfg, MASKS, tmp_path, progress=False, init=_source(out),
                         tokenizer_sha256="tok")
    for key in ("val/mlm_loss", "val/rtd_loss", "val/rtd_accuracy"):
        assert continued.val_metrics[key] == pytest.approx(reference.val_metrics[key],
                                                           abs=1e-4), key


def test_an_rtd_run_is_only_continued_by_rtd(tmp_path, rtd_run):
    out, _, val, _ = rtd_run
    cfg = _config(objective="mlm", steps=2)
    with pytest.raises(UserError, match="pretrained with the rtd objective; set "
                                        "pretrain.objective=rtd to continue it"):
        pretrain(topic_windows(64, 0), val, V, MODEL, cfg, MASKS, tmp_path, progress=False,
                 init=_source(out), tokenizer_sha256="tok")
