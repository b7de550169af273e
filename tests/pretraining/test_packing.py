"""Packed pretraining rows: the document mask, restarted positions, the packer and the batches.

A packed document must be computed exactly as if it were alone in its row: no token attends
across a document boundary, and its per-document loss equals the unpacked one to 1e-5.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from selfsup_model.config import MaskingConfig, PretrainConfig
from selfsup_model.errors import UserError
from selfsup_model.nn.layers import DocumentMask, PaddingMask, document_ids, document_positions
from selfsup_model.nn.model import (
    build_backbone,
    build_pretraining_model,
    build_rtd_model,
    separates_documents,
    with_dropout,
)
from selfsup_model.nn.saving import load_keras_model
from selfsup_model.pretraining.batches import PretrainBatches, pack_rows
from selfsup_model.text.specials import BOS_ID, CLS_ID, EOS_ID, PAD_ID, SEP_ID
from selfsup_model.text.windows import causal_lm_batch
from tests.pretraining.test_bucketing import MASKS, MODEL, L, V, framed, varied


def np_(x) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(x))


# A row holding two documents and padding: [CLS] a b [SEP] | [CLS] c [SEP] | [PAD] [PAD]
ROW = np.array([[CLS_ID, 9, 10, SEP_ID, CLS_ID, 11, SEP_ID, PAD_ID, PAD_ID]], dtype=np.int32)


def test_document_ids_and_positions_are_hand_computable():
    assert np_(document_ids(ROW)).tolist() == [[2, 2, 2, 2, 3, 3, 3, 0, 0]]
    # Positions restart at each document's [CLS]; a [PAD] keeps its column.
    assert np_(document_positions(ROW)).tolist() == [[0, 1, 2, 3, 0, 1, 2, 7, 8]]
    # Causal framing opens documents with [BOS]; content before any opener is a document too.
    causal = np.array([[7, 8, BOS_ID, 9, EOS_ID, BOS_ID, 10]], dtype=np.int32)
    assert np_(document_ids(causal)).tolist() == [[1, 1, 2, 2, 2, 3, 3]]
    assert np_(document_positions(causal)).tolist() == [[0, 1, 0, 1, 2, 0, 1]]


def test_document_mask_is_block_diagonal_over_real_keys():
    got = np_(DocumentMask()(ROW))[0].astype(int)
    first, second, pad = [1, 1, 1, 1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1, 1, 0, 0], \
        [1, 1, 1, 1, 1, 1, 1, 0, 0]
    # Real queries read the real keys of their own document; [PAD] queries (never read by
    # anything) read every real key, as under the padding mask.
    assert got.tolist() == [first] * 4 + [second] * 3 + [pad] * 2


def test_one_document_per_row_gets_the_padding_masks_attention():
    ids = framed([5, 9, L], seed=4)
    mask, keys = np_(DocumentMask()(ids)), np_(PaddingMask()(ids))
    assert np.array_equal(mask, np.broadcast_to(keys[:, None, :], mask.shape))
    assert np.array_equal(np_(document_positions(ids)), np.broadcast_to(np.arange(L), ids.shape))


def _pack(docs: list[np.ndarray], length: int) -> np.ndarray:
    row = np.full((1, length), PAD_ID, dtype=np.int32)
    row[0, :sum(map(len, docs))] = np.concatenate(docs)
    return row


@pytest.mark.parametrize("causal", [False, True])
def test_no_token_attends_across_a_document_boundary(causal):
    keras.utils.set_random_seed(0)
    backbone = build_backbone(V, L, MODEL, causal=causal, seed=5, documents=True)
    assert separates_documents(backbone)
    opener = BOS_ID if causal else CLS_ID
    rng = np.random.default_rng(1)
    docs = [np.concatenate([[opener], rng.integers(7, V, size=n)]) for n in (6, 4, 8)]
    row = _pack(docs, L)
    before = np_(backbone(row))
    bounds = np.cumsum([0] + [len(d) for d in docs])
    for k in range(len(docs)):  # rewrite document k's content: only its own states may move
        changed = row.copy()
        changed[0, bounds[k] + 1:bounds[k + 1]] = rng.integers(7, V, size=len(docs[k]) - 1)
        after = np_(backbone(changed))
        moved = np.abs(after - before).max(axis=-1)[0]  # (L,)
        others = np.ones(L, dtype=bool)
        others[bounds[k]:bounds[k + 1]] = False
        others[bounds[-1]:] = False  # [PAD] queries read every real key
        assert moved[bounds[k] + 1:bounds[k + 1]].max() > 1e-4  # the change is visible...
        assert moved[others].max() == 0.0  # ...nowhere else


def _docs_of(ids_row: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each framed window in a packed row of ids."""
    starts = np.flatnonzero((ids_row == CLS_ID) | (ids_row == BOS_ID)).tolist()
    end = int(np.count_nonzero(ids_row != PAD_ID))
    return list(zip(starts, [*starts[1:], end]))


def _ce(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    top = logits.max(-1, keepdims=True)
    logz = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    return logz - np.take_along_axis(logits, targets[..., None], -1)[..., 0]


def test_a_packed_mlm_batch_gives_each_document_its_unpacked_loss():
    keras.utils.set_random_seed(0)
    model = build_pretraining_model(build_backbone(V, L, MODEL, seed=2, documents=True), "mlm",
                                    MODEL, seed=2)
    data = PretrainBatches(varied(40, seed=6), objective="mlm", batch_size=4, total_steps=30,
                           seed=3, masking=MaskingConfig(max_predictions=12, select_rate=0.3),
                           vocab_size=V, packing=True)
    x, y, w = data.batch_for_step(1)
    packed_ce = _ce(np_(model(x, training=False)), y)  # (B, P)
    compared = 0
    for r, ids_row in enumerate(x["input_ids"]):
        docs = _docs_of(ids_row)
        for start, end in docs:
            slots = (w[r] > 0) & (x["mask_positions"][r] >= start) & (x["mask_positions"][r] < end)
            if not slots.any():
                continue
            alone = np.full((1, L), PAD_ID, dtype=np.int32)
            alone[0, :end - start] = ids_row[start:end]
            positions = np.zeros((1, x["mask_positions"].shape[1]), dtype=np.int32)
            positions[0, :slots.sum()] = x["mask_positions"][r][slots] - start
            logits = np_(model({"input_ids": alone, "mask_positions": positions}, training=False))
            alone_ce = _ce(logits[0, :slots.sum()], y[r][slots])
            assert packed_ce[r][slots].mean() == pytest.approx(alone_ce.mean(), abs=1e-5)
            compared += 1
        assert len(docs) >= 1
    assert compared >= 6 and max(len(_docs_of(row)) for row in x["input_ids"]) >= 2


def test_a_packed_rtd_batch_gives_each_document_its_unpacked_generator_and_detector():
    """Replaced-token detection packed: each document's generator logits at its selected
    positions, the tokens drawn there (the same uniform draws), and the discriminator's logit
    and replaced flag at every one of its positions are what the document alone in a row
    gets."""
    keras.utils.set_random_seed(0)
    model = build_rtd_model(build_backbone(V, L, MODEL, seed=2, documents=True), MODEL,
                            generator_blocks=1, rtd_weight=50.0, seed=2)
    data = PretrainBatches(varied(40, seed=6), objective="rtd", batch_size=4, total_steps=30,
                           seed=3, masking=MaskingConfig(max_predictions=12, select_rate=0.3),
                           vocab_size=V, packing=True)
    x, y, w = data.batch_for_step(1)
    generated, detected, replaced = (np_(t) for t in model(x, training=False)[:3])
    compared, swapped = 0, 0
    for r, ids_row in enumerate(x["original_ids"]):
        docs = _docs_of(ids_row)
        for start, end in docs:
            slots = (w[r] > 0) & (x["mask_positions"][r] >= start) & (x["mask_positions"][r] < end)
            alone = {key: np.zeros((1, x[key].shape[1]), dtype=x[key].dtype)
                     for key in ("mask_positions", "mask_weights", "sample_uniform")}
            for key in ("input_ids", "original_ids"):
                alone[key] = np.full((1, L), PAD_ID, dtype=np.int32)
                alone[key][0, :end - start] = x[key][r, start:end]
            n = int(slots.sum())
            # the generator's targets are the original tokens at the selected positions
            np.testing.assert_array_equal(y[r][slots], ids_row[x["mask_positions"][r][slots]])
            alone["mask_positions"][0, :n] = x["mask_positions"][r][slots] - start
            alone["mask_weights"][0, :n] = x["mask_weights"][r][slots]
            alone["sample_uniform"][0, :n] = x["sample_uniform"][r][slots]
            got = [np_(t) for t in model(alone, training=False)[:3]]
            np.testing.assert_allclose(got[0][0, :n], generated[r][slots], atol=1e-5)
            np.testing.assert_allclose(got[1][0, :end - start], detected[r, start:end],
                                       atol=1e-5)
            np.testing.assert_array_equal(got[2][0, :end - start], replaced[r, start:end])
            assert replaced[r, start] == 0 and ids_row[start] == CLS_ID  # never drawn over
            compared += 1
            swapped += int(replaced[r, start:end].sum())
    assert compared >= 6 and swapped > 0
    assert max(len(_docs_of(row)) for row in x["original_ids"]) >= 2


def test_a_packed_clm_batch_gives_each_document_its_unpacked_loss():
    keras.utils.set_random_seed(0)
    model = build_pretraining_model(build_backbone(V, L, MODEL, causal=True, seed=2,
                                                   documents=True), "clm", MODEL, seed=2)
    windows = varied(40, seed=7)
    data = PretrainBatches(windows, objective="clm", batch_size=4, total_steps=30, seed=3,
                           packing=True)
    x, y, w = data.batch_for_step(0)
    packed_ce = _ce(np_(model(x, training=False)), y)  # (B, L-1)
    # Nothing predicts where the next document starts: targets that are a [BOS] weigh 0.
    assert not w[y == BOS_ID].any() and (y == BOS_ID).any()
    for r, ids_row in enumerate(x["input_ids"]):
        for start, end in _docs_of(ids_row):
            window = np.full((1, L), PAD_ID, dtype=np.int32)
            window[0, :end - start] = ids_row[start:end]
            if ids_row[end - 1] != EOS_ID:  # it ends the row: its [EOS] is a target only
                window[0, end - start] = EOS_ID
            alone = causal_lm_batch(window)
            ce = _ce(np_(model({"input_ids": alone["input_ids"]}, training=False)),
                     alone["target_ids"])
            scored = alone["loss_weights"][0] > 0
            span = slice(start, start + int(scored.sum()))
            assert w[r, span].all() and w[r, span].sum() == scored.sum()
            assert packed_ce[r, span].mean() == pytest.approx(ce[0, scored].mean(), abs=1e-5)


def test_pack_rows_is_best_fit_decreasing_by_hand():
    # Longest first, capacity 10: 6 opens row 0 (4 free); 5 fits nowhere, opens row 1 (5 free);
    # 4 goes to the open row with the least room that holds it, row 0 (now full); 3 goes to
    # row 1 (2 free); 2 fills row 1.
    assert pack_rows(np.array([3, 6, 2, 5, 4]), 10).tolist() == [1, 0, 1, 1, 0]
    # Ties go to the most recently filled of equally roomy rows; an empty window fits anywhere.
    assert pack_rows(np.array([10, 10, 0]), 10).tolist() == [0, 1, 1]
    with pytest.raises(ValueError, match="lie in"):
        pack_rows(np.array([11]), 10)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 16), min_size=1, max_size=80), st.randoms(use_true_random=False))
def test_pack_rows_respects_capacity_and_ignores_the_order_of_equal_lengths(lengths, rnd):
    lengths = np.array(lengths)
    rows = pack_rows(lengths, 16)
    fill = np.bincount(rows, weights=lengths)
    assert fill.max() <= 16 and sorted(set(rows.tolist())) == list(range(rows.max() + 1))
    # A row opens only for a length its open rows cannot hold, so no two rows are both at most
    # half full (else the later one's first length would have fitted in the earlier).
    assert np.count_nonzero(fill <= 8) <= 1
    shuffled = list(range(len(lengths)))
    rnd.shuffle(shuffled)
    again = pack_rows(lengths[shuffled], 16)
    order = np.argsort(-lengths, kind="stable")
    again_order = np.argsort(-lengths[shuffled], kind="stable")
    assert np.array_equal(rows[order], again[again_order])  # rank k -> the same row


def packed(windows, **kw) -> PretrainBatches:
    args = {"objective": "mlm", "batch_size": 4, "total_steps": 60, "seed": 3, "masking": MASKS,
            "vocab_size": V, "packing": True}
    return PretrainBatches(windows, **{**args, **kw})


@pytest.mark.parametrize("objective", ["mlm", "clm"])
def test_every_window_is_packed_once_per_pass_into_full_length_rows(objective):
    windows = varied(50, seed=8)
    data = packed(windows, objective=objective)
    width = L if objective == "mlm" else L - 1
    opener = CLS_ID if objective == "mlm" else BOS_ID
    stream = []
    for s in range(3 * data.batches_per_pass):
        ids, tokens = data.batch_for_step(s)[0]["input_ids"], data.step_tokens(s)
        assert ids.shape == (4, width) == (tokens.rows, tokens.length)
        assert np.count_nonzero(ids != PAD_ID) == tokens.real
        assert (ids[:, 0] == opener).all()  # no empty row: passes follow each other
        index = data.window_indices(s)
        assert np.count_nonzero(ids == opener) == len(index)  # one opener per window
        stream.append(index)
    stream = np.concatenate(stream)
    n = len(windows)
    for p in range(2):  # the windows of pass p come as one block of the stream, each once
        assert np.array_equal(np.sort(stream[p * n:(p + 1) * n]), np.arange(n))
    assert not np.array_equal(stream[:n], stream[n:2 * n])
    # Rows hold several windows: a pass takes far fewer batches than one window per row would.
    total = int(np.count_nonzero(windows != PAD_ID))
    assert math.ceil(total / (4 * L)) <= data.batches_per_pass < math.ceil(n / 4)


def test_packed_rows_copy_each_window_verbatim_before_corruption():
    windows = varied(30, seed=9)
    data = packed(windows)
    for s in range(data.batches_per_pass + 1):  # the last step holds rows of two passes
        ids = data._packed_batch(s)
        index = data.window_indices(s)
        got = sorted(tuple(ids[r, a:b]) for r in range(len(ids)) for a, b in _docs_of(ids[r]))
        want = sorted(tuple(windows[i][windows[i] != PAD_ID]) for i in index)
        assert got == want


def test_packed_batches_are_a_pure_function_of_the_step_and_passes_differ():
    windows = varied(50, seed=10)
    one, two = packed(windows), packed(windows)
    for s in (7, 0, 3, 7):
        for a, b in zip(keras.tree.flatten(one.batch_for_step(s)),
                        keras.tree.flatten(two.batch_for_step(s)), strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b))
    n = one.batches_per_pass
    assert not np.array_equal(one.window_indices(0), one.window_indices(n))


def test_packing_refuses_what_it_cannot_honour():
    with pytest.raises(UserError, match="length buckets"):
        packed(varied(20), length_buckets=3)
    with pytest.raises(UserError, match="static training masks"):
        packed(varied(20), static_masks=True)
    unframed = varied(20)
    unframed[5, 0] = 9
    with pytest.raises(UserError, match="window 5 does not"):
        packed(unframed)
    inner = varied(20)
    inner[3, 2] = CLS_ID
    with pytest.raises(UserError, match="window 3 does not"):
        packed(inner)
    opener = varied(20)
    opener[7, 1] = BOS_ID
    with pytest.raises(UserError, match="window 7 does not"):
        packed(opener)
    with pytest.raises(ValueError, match="packing"):
        PretrainConfig(packing=True, length_buckets=4)
    with pytest.raises(ValueError, match="contrastive"):
        PretrainConfig(packing=True, contrastive_weight=0.5)
    assert PretrainConfig(packing=True).packing


def test_a_backbone_keeps_documents_apart_only_when_built_or_converted_to():
    plain = build_backbone(V, L, MODEL, seed=1)  # what unpacked runs train: the padding mask
    assert not separates_documents(plain)
    assert separates_documents(build_backbone(V, L, MODEL, seed=1, documents=True))
    # Continuing any backbone with packing converts it, weights and all.
    converted = with_dropout(plain, 0.0, documents=True)
    assert separates_documents(converted) and not separates_documents(plain)
    for a, b in zip(plain.get_weights(), converted.get_weights(), strict=True):
        assert np.array_equal(a, b)
    one_each = framed([5, 9, L], seed=4)
    np.testing.assert_allclose(np_(converted(one_each)), np_(plain(one_each)), atol=1e-6)
    rng = np.random.default_rng(2)
    docs = [np.concatenate([[CLS_ID], rng.integers(7, V, size=n)]) for n in (7, 9)]
    alone = np.full((1, L), PAD_ID, dtype=np.int32)
    alone[0, :len(docs[1])] = docs[1]
    packed_row = _pack(docs, L)
    second = np_(converted(packed_row))[0, len(docs[0]):len(docs[0]) + len(docs[1])]
    np.testing.assert_allclose(second, np_(converted(alone))[0, :len(docs[1])], atol=1e-5)
    assert np.abs(np_(plain(packed_row))[0, len(docs[0]):len(docs[0]) + len(docs[1])]
                  - second).max() > 1e-3  # the plain backbone would have mixed them


def test_a_packed_run_trains_and_counts_real_tokens(tmp_path):
    from tests.pretraining.test_pretraining import MASKS as RUN_MASKS
    from tests.pretraining.test_pretraining import V as RUN_V
    from tests.pretraining.test_pretraining import tiny_run, topic_windows

    result = tiny_run(str(tmp_path), steps=12, checkpoint_every=6, packing=True)
    data = PretrainBatches(topic_windows(512, 0), objective="mlm", batch_size=16,
                           total_steps=12, seed=42, masking=RUN_MASKS, vocab_size=RUN_V,
                           packing=True)
    counts = [data.step_tokens(s) for s in range(12)]
    assert result.tokens_seen == sum(t.positions for t in counts)
    assert result.real_tokens_seen == sum(t.real for t in counts) > 0
    assert np.isfinite(result.val_metrics["val/mlm_loss"])
    assert separates_documents(load_keras_model(result.encoder_path))  # trained apart, saved so
    unpacked = tiny_run(str(tmp_path / "unpacked"), steps=2, checkpoint_every=2)
    assert not separates_documents(load_keras_model(unpacked.encoder_path))
