"""Token embeddings initialised from co-occurrence counts (`pretrain.embedding_init`)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import scipy.sparse as sp

from selfsup_model.pretraining.embedding_init import (
    cooccurrence_counts,
    cooccurrence_embeddings,
    ppmi,
    top_singular_vectors,
)
from selfsup_model.text.specials import CLS_ID, NUM_SPECIAL, PAD_ID, SEP_ID
from tests.pretraining.test_pretraining import tiny_run, topic_windows

A, B, C, D = (NUM_SPECIAL + i for i in range(4))
V = NUM_SPECIAL + 4


def test_counts_weigh_pairs_by_one_over_distance_and_skip_special_tokens():
    windows = np.array([[CLS_ID, A, B, C, SEP_ID, PAD_ID],
                        [CLS_ID, D, A, SEP_ID, PAD_ID, PAD_ID]], dtype=np.int32)
    got = cooccurrence_counts(windows, V, window=2, chunk=1).toarray()
    want = np.zeros((V, V))
    for x, y, w in ((A, B, 1.0), (B, C, 1.0), (A, C, 0.5), (D, A, 1.0)):
        want[x, y] += w
        want[y, x] += w
    np.testing.assert_array_equal(got, want)  # [CLS], [SEP] and padding pair with nothing


def test_ppmi_by_hand():
    # a-b 3 times, a-c once: rows 4, 3, 1 of 8; smoothed contexts 4^.75, 3^.75, 1 over their sum.
    counts = np.zeros((V, V))
    counts[A, B] = counts[B, A] = 3.0
    counts[A, C] = counts[C, A] = 1.0
    got = ppmi(sp.csr_matrix(counts)).toarray()
    z = 4 ** 0.75 + 3 ** 0.75 + 1.0
    ctx = {A: 4 ** 0.75 / z, B: 3 ** 0.75 / z, C: 1.0 / z}
    want = np.zeros((V, V))
    want[A, B] = np.log(3 / 8) - np.log(4 / 8) - np.log(ctx[B])  # 0.698
    want[B, A] = np.log(3 / 8) - np.log(3 / 8) - np.log(ctx[A])  # 0.770
    want[A, C] = np.log(1 / 8) - np.log(4 / 8) - np.log(ctx[C])  # 0.423
    want[C, A] = np.log(1 / 8) - np.log(1 / 8) - np.log(ctx[A])  # 0.770
    np.testing.assert_allclose(got, want, atol=1e-12)
    assert want[A, B] == pytest.approx(0.698, abs=1e-3)


def test_ppmi_drops_pairs_seen_less_often_than_chance():
    # a and b are frequent and mostly with each other; the one a-c pair is rarer than chance.
    counts = np.zeros((V, V))
    counts[A, B] = counts[B, A] = 50.0
    counts[C, D] = counts[D, C] = 50.0
    counts[A, C] = counts[C, A] = 0.1
    got = ppmi(sp.csr_matrix(counts)).toarray()
    assert got[A, B] > 0 and got[C, D] > 0
    assert got[A, C] == got[C, A] == 0.0
    assert (got >= 0).all()


def test_embeddings_group_tokens_that_share_contexts_and_keep_unseen_rows():
    # Four topics of five ids each (ids NUM_SPECIAL .. NUM_SPECIAL + 19); ids above never occur.
    windows = topic_windows(400, 0)
    vocab, hidden = NUM_SPECIAL + 24, 8
    rng = np.random.default_rng(1)
    random_rows = rng.normal(0.0, 0.02, (vocab, hidden)).astype(np.float32)
    rows, counted = cooccurrence_embeddings(windows, vocab, hidden, random_rows, seed=3)
    assert counted == 20
    assert rows.dtype == np.float32 and rows.shape == (vocab, hidden)
    np.testing.assert_array_equal(rows[:NUM_SPECIAL], random_rows[:NUM_SPECIAL])
    np.testing.assert_array_equal(rows[NUM_SPECIAL + 20:], random_rows[NUM_SPECIAL + 20:])
    assert rows.std() == pytest.approx(random_rows.std(), rel=0.05)
    unit = rows[NUM_SPECIAL:NUM_SPECIAL + 20]
    unit = unit / np.linalg.norm(unit, axis=1, keepdims=True)
    cosine = unit @ unit.T
    topic = np.arange(20) // 5
    same = topic[:, None] == topic[None, :]
    off_diagonal = ~np.eye(20, dtype=bool)
    # Every token is closer to each of its topic's tokens than to any other topic's.
    for i in range(20):
        assert cosine[i, same[i] & off_diagonal[i]].min() > cosine[i, ~same[i]].max()
    again, _ = cooccurrence_embeddings(windows, vocab, hidden, random_rows, seed=3)
    np.testing.assert_array_equal(rows, again)  # deterministic


def test_bad_shapes_and_windows_are_refused():
    windows = topic_windows(10, 0)
    with pytest.raises(ValueError, match="window must be at least 1"):
        cooccurrence_counts(windows, 30, window=0)
    with pytest.raises(ValueError, match="expected"):
        cooccurrence_embeddings(windows, 30, 8, np.zeros((30, 4)))


def test_pretraining_starts_from_the_counted_embeddings(tmp_path, caplog):
    """The pretrain loop replaces the random token rows before its first step. With a learning
    rate too small to move them, the saved encoder holds exactly the counted rows of the
    training windows, built from the random rows the same seed gives a plain run."""
    still = {"steps": 4, "eval_every": 4, "checkpoint_every": 4, "log_every": 2,
             "warmup_steps": 1, "learning_rate": 1e-12}
    with caplog.at_level(logging.INFO, logger="selfsup.pretraining"):
        tiny_run(str(tmp_path / "counted"), embedding_init="cooccurrence", **still)
    assert any("20 of 30 token embeddings initialised from co-occurrence counts" in r.message
               for r in caplog.records)
    tiny_run(str(tmp_path / "plain"), **still)
    counted, plain = (_token_rows(tmp_path / name / "encoder.keras")
                      for name in ("counted", "plain"))
    want, _ = cooccurrence_embeddings(topic_windows(512, 0), 30, plain.shape[1], plain, seed=42)
    np.testing.assert_allclose(counted, want, atol=1e-6)
    assert np.abs(counted - plain).max() > 1e-3


def _token_rows(path) -> np.ndarray:
    from keras import ops

    from selfsup_model.nn.model import token_embedding_of
    from selfsup_model.nn.saving import load_keras_model

    return ops.convert_to_numpy(token_embedding_of(load_keras_model(path)).embeddings)


def test_the_manifest_says_what_a_fresh_encoder_started_from():
    from selfsup_model.config import PretrainConfig
    from tasks.pretrain import fresh_start

    assert fresh_start(PretrainConfig()) == "random initialisation"
    assert fresh_start(PretrainConfig(embedding_init="cooccurrence")) == (
        "random initialisation, token embeddings from co-occurrence counts")


def test_the_truncated_svd_is_the_exact_one_with_fixed_signs():
    rng = np.random.default_rng(0)
    dense = np.where(rng.random((40, 40)) < 0.3, rng.random((40, 40)), 0.0)
    vectors, values = top_singular_vectors(sp.csr_matrix(dense), 6, seed=1)
    exact_u, exact_s, _ = np.linalg.svd(dense)
    np.testing.assert_allclose(values, exact_s[:6], rtol=1e-10)
    for k in range(6):  # the same vector up to sign, and the sign puts the largest entry up
        assert abs(vectors[:, k] @ exact_u[:, k]) == pytest.approx(1.0, abs=1e-8)
        assert vectors[np.abs(vectors[:, k]).argmax(), k] > 0
    again, _ = top_singular_vectors(sp.csr_matrix(dense), 6, seed=1)
    np.testing.assert_array_equal(vectors, again)
