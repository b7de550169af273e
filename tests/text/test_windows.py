import numpy as np
import pytest

from selfsup_model.text.specials import BOS_ID, CLS_ID, EOS_ID, NUM_SPECIAL, PAD_ID, SEP_ID
from selfsup_model.text.windows import (
    causal_lm_batch,
    document_windows,
    documents_owning,
    first_windows,
    mean_over_documents,
    truncate_windows,
)


def test_truncation_keeps_framing_and_leaves_short_rows_alone():
    rows = np.array([
        # longer than 4: cut, re-closed with [SEP]
        [CLS_ID, 10, 11, 12, 13, SEP_ID, PAD_ID, PAD_ID],
        [CLS_ID, 10, SEP_ID, PAD_ID, PAD_ID, PAD_ID, PAD_ID, PAD_ID],  # fits: unchanged
    ], dtype=np.int32)
    out = truncate_windows(rows, 4)
    np.testing.assert_array_equal(out, [[CLS_ID, 10, 11, SEP_ID], [CLS_ID, 10, SEP_ID, PAD_ID]])
    assert truncate_windows(rows, None) is rows and truncate_windows(rows, 8) is rows
    assert rows[0, 3] == 12  # the input is not modified


def test_first_windows_selects_documents_and_cuts_them():
    windows = np.array([
        [CLS_ID, 10, 11, 12, SEP_ID, PAD_ID],  # doc 0, window 0
        [CLS_ID, 12, 13, SEP_ID, PAD_ID, PAD_ID],  # doc 0, window 1
        [CLS_ID, 20, SEP_ID, PAD_ID, PAD_ID, PAD_ID],  # doc 1
        [CLS_ID, 30, 31, 32, 33, SEP_ID],  # doc 2
    ], dtype=np.int32)
    offsets = np.array([0, 2, 3, 4])
    out = first_windows(windows, offsets, rows=np.array([True, False, True]), max_len=4)
    np.testing.assert_array_equal(out, [[CLS_ID, 10, 11, SEP_ID], [CLS_ID, 30, 31, SEP_ID]])
    assert out.dtype == np.int32
    np.testing.assert_array_equal(first_windows(windows, offsets), windows[[0, 2, 3]])


def test_document_windows_reads_every_window_of_the_documents_asked_for(tmp_path):
    windows = np.array([
        [CLS_ID, 10, 11, 12, SEP_ID, PAD_ID],  # doc 0, window 0
        [CLS_ID, 12, 13, SEP_ID, PAD_ID, PAD_ID],  # doc 0, window 1
        [CLS_ID, 20, SEP_ID, PAD_ID, PAD_ID, PAD_ID],  # doc 1
        [CLS_ID, 30, 31, 32, 33, SEP_ID],  # doc 2, window 0
        [CLS_ID, 33, 34, SEP_ID, PAD_ID, PAD_ID],  # doc 2, window 1
        [CLS_ID, 35, SEP_ID, PAD_ID, PAD_ID, PAD_ID],  # doc 2, window 2
    ], dtype=np.int32)
    np.save(tmp_path / "w.npy", windows)
    mapped = np.load(tmp_path / "w.npy", mmap_mode="r")  # as the classifiers read encode's
    offsets = np.array([0, 2, 3, 6])
    out, owner = document_windows(mapped, offsets, np.array([2, 0]), max_len=4)
    np.testing.assert_array_equal(out, [
        [CLS_ID, 30, 31, SEP_ID], [CLS_ID, 33, 34, SEP_ID], [CLS_ID, 35, SEP_ID, PAD_ID],
        [CLS_ID, 10, 11, SEP_ID], [CLS_ID, 12, 13, SEP_ID]])
    assert owner.tolist() == [0, 0, 0, 1, 1] and out.dtype == np.int32
    out, owner = document_windows(windows, offsets, np.array([1]))
    np.testing.assert_array_equal(out, windows[[2]])
    assert owner.tolist() == [0]
    out, owner = document_windows(windows, offsets, np.array([], dtype=np.int64))
    assert out.shape == (0, 6) and owner.shape == (0,)


def test_mean_over_documents_by_hand():
    values = np.array([[1.0, 0.0], [0.0, 1.0], [0.2, 0.8], [0.6, 0.4], [0.5, 0.5]], np.float32)
    out = mean_over_documents(values, np.array([0, 0, 1, 2, 2]), 3)
    np.testing.assert_allclose(out, [[0.5, 0.5], [0.2, 0.8], [0.55, 0.45]], rtol=1e-6)
    assert out.dtype == np.float32
    assert mean_over_documents(values[:0], np.zeros(0, np.int64), 0).shape == (0, 2)
    with pytest.raises(ValueError, match="non-decreasing"):
        mean_over_documents(values[:2], np.array([1, 0]), 2)
    with pytest.raises(ValueError, match="at least one row"):
        mean_over_documents(values[:2], np.array([0, 2]), 3)  # document 1 owns nothing
    with pytest.raises(ValueError, match="at least one row"):
        mean_over_documents(values[:2], np.array([0, 1]), 1)  # row 1's document is not one


def test_documents_owning_says_when_rows_need_averaging():
    assert documents_owning(None) is None
    assert documents_owning(np.arange(4)) is None  # each row its own document
    assert documents_owning(np.zeros(0, np.int64)) is None
    assert documents_owning(np.array([0, 0, 1, 2, 2])) == 3
    # not one row per document in order, though as many documents as rows: averaged, so the
    # averaging refuses it instead of reading it row by row
    assert documents_owning(np.array([0, 0, 2])) == 3
    with pytest.raises(ValueError, match="at least one row"):
        mean_over_documents(np.ones((3, 2)), np.array([0, 0, 2]), 3)


def test_causal_batch_by_hand():
    windows = np.array([[CLS_ID, 10, 11, SEP_ID, PAD_ID, PAD_ID]], dtype=np.int32)
    out = causal_lm_batch(windows)
    assert out["input_ids"].tolist() == [[BOS_ID, 10, 11, EOS_ID, PAD_ID]]
    assert out["target_ids"].tolist() == [[10, 11, EOS_ID, PAD_ID, PAD_ID]]
    assert out["loss_weights"].tolist() == [[1, 1, 1, 0, 0]]
    assert out["loss_weights"].dtype == np.float32 and out["input_ids"].dtype == np.int32


def test_causal_batch_shifts_exactly_once():
    rng = np.random.default_rng(0)
    windows = rng.integers(NUM_SPECIAL, 100, size=(16, 12)).astype(np.int32)
    windows[:, 0], windows[:, -1] = CLS_ID, SEP_ID
    windows[:4, 6:] = PAD_ID
    out = causal_lm_batch(windows)
    framed = np.where(windows == CLS_ID, BOS_ID, np.where(windows == SEP_ID, EOS_ID, windows))
    # Target t is input t+1 of the same window (a double shift would give t+2).
    assert np.array_equal(out["target_ids"], framed[:, 1:])
    assert np.array_equal(out["input_ids"], framed[:, :-1])
    assert np.array_equal(out["target_ids"][:, :-1], out["input_ids"][:, 1:])
    assert out["input_ids"].shape == out["target_ids"].shape == (16, 11)
    assert (out["loss_weights"][out["target_ids"] == PAD_ID] == 0).all()
    assert (out["loss_weights"][out["target_ids"] != PAD_ID] == 1).all()
