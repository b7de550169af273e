"""Masked-LM corruption: selection laws, rates, determinism, static mask files."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from selfsup_model.config import MaskingConfig
from selfsup_model.errors import UserError
from selfsup_model.text.masking import (
    eligible_mask,
    load_masks,
    make_static_masks,
    mask_counts,
    mask_tokens,
    save_masks,
)
from selfsup_model.text.specials import CLS_ID, MASK_ID, NUM_SPECIAL, PAD_ID, SEP_ID, UNK_ID

VOCAB = 50
ALL_MASK = {"select_rate": 1.0, "mask_rate": 1.0, "random_rate": 0.0, "keep_rate": 0.0}


def framed_batch(
    rng: np.random.Generator, batch: int, length: int, vocab: int = VOCAB
) -> np.ndarray:
    """(batch, length) [CLS] content [SEP] [PAD]..., content of random length >= 0."""
    ids = rng.integers(NUM_SPECIAL, vocab, size=(batch, length)).astype(np.int32)
    content = rng.integers(0, length - 1, size=batch)  # leaves room for CLS + SEP
    col = np.arange(length)[None, :]
    ids[col > content[:, None] + 1] = PAD_ID
    ids[:, 0] = CLS_ID
    ids[np.arange(batch), content + 1] = SEP_ID
    return ids


def test_eligible_mask_excludes_specials_and_optionally_unk():
    ids = np.array([[PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID, 5, 6, 7, 8]])
    assert eligible_mask(ids).tolist() == [[False] * 7 + [True, True]]
    assert eligible_mask(ids, protect_unk=False).tolist() == [
        [False, True] + [False] * 5 + [True, True]
    ]


def test_rates_one_one_zero_mask_every_eligible_token_by_hand():
    ids = np.array([[CLS_ID, 10, 11, UNK_ID, 12, SEP_ID, PAD_ID, PAD_ID]])
    cfg = MaskingConfig(**ALL_MASK, max_predictions=4)
    out = mask_tokens(ids, np.random.default_rng(0), cfg, VOCAB)
    assert out["input_ids"].tolist() == [
        [CLS_ID, MASK_ID, MASK_ID, UNK_ID, MASK_ID, SEP_ID, PAD_ID, PAD_ID]
    ]
    assert out["target_ids"].tolist() == ids.tolist()
    assert out["loss_weights"].tolist() == [[0, 1, 1, 0, 1, 0, 0, 0]]
    assert out["corruption"].tolist() == [[0, 1, 1, 0, 1, 0, 0, 0]]
    assert out["mask_positions"].tolist() == [[1, 2, 4, 0]]
    assert out["mask_ids"].tolist() == [[10, 11, 12, 0]]
    assert out["mask_weights"].tolist() == [[1, 1, 1, 0]]
    assert out["input_ids"].dtype == np.int32 and out["corruption"].dtype == np.int8
    assert out["loss_weights"].dtype == np.float32 and out["mask_weights"].dtype == np.float32


def test_rates_one_one_zero_cap_at_max_predictions():
    rng = np.random.default_rng(1)
    ids = framed_batch(rng, 64, 24)
    cfg = MaskingConfig(**ALL_MASK, max_predictions=5)
    out = mask_tokens(ids, rng, cfg, VOCAB)
    per_row = (out["input_ids"] == MASK_ID).sum(axis=1)
    assert per_row.tolist() == np.minimum(5, eligible_mask(ids).sum(axis=1)).tolist()
    assert set(np.unique(out["corruption"])) <= {0, 1}


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    selection=st.sampled_from(["fixed", "bernoulli"]),
    width=st.integers(1, 30),
)
def test_rates_one_one_zero_are_deterministic_for_random_batches(seed, selection, width):
    rng = np.random.default_rng(seed)
    ids = framed_batch(rng, 6, 24)
    cfg = MaskingConfig(**ALL_MASK, selection=selection, max_predictions=width)
    out = mask_tokens(ids, rng, cfg, VOCAB)
    masked = out["input_ids"] == MASK_ID
    assert masked.sum(axis=1).tolist() == np.minimum(width, eligible_mask(ids).sum(axis=1)).tolist()
    if width >= 22:  # room for every eligible token: the output no longer depends on the seed
        assert (masked == eligible_mask(ids)).all()


def test_fixed_rule_rounds_per_sequence():
    rows = [[CLS_ID] + [9] * n + [PAD_ID] * (20 - n) + [SEP_ID] for n in (0, 3, 10, 20)]
    out = mask_tokens(np.array(rows), np.random.default_rng(0), MaskingConfig(), VOCAB)
    # round(0.45) -> 0 -> at least 1; round(1.5) = 2; round(3.0) = 3; nothing eligible -> 0.
    assert out["loss_weights"].sum(axis=1).tolist() == [0, 1, 2, 3]


def test_unk_selectable_only_when_not_protected():
    ids = np.array([[CLS_ID, UNK_ID, UNK_ID, SEP_ID]])
    cfg = MaskingConfig(**ALL_MASK)
    assert mask_tokens(ids, np.random.default_rng(0), cfg, VOCAB)["loss_weights"].sum() == 0
    out = mask_tokens(ids, np.random.default_rng(0), cfg, VOCAB, protect_unk=False)
    assert out["loss_weights"].tolist() == [[0, 1, 1, 0]]


configs = st.builds(
    lambda sel, mask, split, selection, p, policy: MaskingConfig(
        select_rate=sel,
        mask_rate=mask,
        random_rate=(1 - mask) * split,
        keep_rate=max(0.0, 1 - mask - (1 - mask) * split),
        selection=selection,
        max_predictions=p,
        empty_policy=policy,
    ),
    st.floats(0.01, 1.0),
    st.floats(0.0, 1.0),
    st.floats(0.0, 1.0),
    st.sampled_from(["fixed", "bernoulli"]),
    st.integers(1, 40),
    st.sampled_from(["force_one", "skip"]),
)


@settings(max_examples=120, deadline=None)
@given(
    cfg=configs, seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 8), length=st.integers(2, 40)
)
def test_corruption_laws_hold_for_random_batches(cfg, seed, batch, length):
    rng = np.random.default_rng(seed)
    ids = framed_batch(rng, batch, length)
    ids[rng.random(ids.shape) < 0.05] = UNK_ID  # protected, must never be selected
    out = mask_tokens(ids, rng, cfg, VOCAB)
    selected = out["loss_weights"] > 0
    kind = out["corruption"]

    assert not selected[~eligible_mask(ids)].any()  # specials, [UNK] and [PAD] never selected
    assert (out["target_ids"] == ids).all()  # targets are the originals everywhere
    assert (out["input_ids"][~selected] == ids[~selected]).all()
    assert ((kind > 0) == selected).all()
    assert (out["input_ids"][kind == 1] == MASK_ID).all()
    assert (out["input_ids"][kind == 3] == ids[kind == 3]).all()
    replaced = out["input_ids"][kind == 2]
    assert ((replaced >= NUM_SPECIAL) & (replaced < VOCAB)).all()  # never a special id

    n_elig = eligible_mask(ids).sum(axis=1)
    n_sel = selected.sum(axis=1)
    assert (n_sel <= np.minimum(n_elig, cfg.max_predictions)).all()
    if cfg.selection == "fixed":
        expected = np.minimum(cfg.max_predictions, np.maximum(1, np.rint(n_elig * cfg.select_rate)))
        assert n_sel.tolist() == np.where(n_elig > 0, expected, 0).tolist()
    elif cfg.empty_policy == "force_one":
        assert (n_sel[n_elig > 0] >= 1).all()

    # Gathered form: the selected positions, ascending, then zero padding.
    for row in range(batch):
        pos = np.flatnonzero(selected[row])
        k = len(pos)
        assert out["mask_positions"][row, :k].tolist() == pos.tolist()
        assert out["mask_ids"][row, :k].tolist() == ids[row, pos].tolist()
        assert out["mask_weights"][row].tolist() == [1.0] * k + [0.0] * (cfg.max_predictions - k)
        assert not out["mask_positions"][row, k:].any() and not out["mask_ids"][row, k:].any()

    counts = mask_counts(out)
    assert counts["selected"] == counts["masked"] + counts["random"] + counts["unchanged"]
    assert counts["eligible"] == int(n_elig.sum())
    assert counts["sequences_without_selection"] == int((n_sel == 0).sum())


def test_realised_rates_match_config_on_a_million_tokens():
    start = time.perf_counter()
    rng = np.random.default_rng(7)
    ids = rng.integers(NUM_SPECIAL, 1000, size=(8192, 128)).astype(np.int32)  # 2^20 tokens
    cfg = MaskingConfig(selection="bernoulli", max_predictions=128)
    out = mask_tokens(ids, rng, cfg, 1000)
    c = mask_counts(out)
    assert c["eligible"] == ids.size
    # Binomial standard errors: ~3.5e-4 for selection, ~1e-3 for the kinds; tolerances ~5 sigma.
    assert abs(c["selected"] / c["eligible"] - 0.15) < 0.002
    assert abs(c["masked"] / c["selected"] - 0.8) < 0.005
    assert abs(c["random"] / c["selected"] - 0.1) < 0.004
    assert abs(c["unchanged"] / c["selected"] - 0.1) < 0.004
    replaced = out["input_ids"][out["corruption"] == 2]
    assert replaced.min() >= NUM_SPECIAL and abs(replaced.mean() - (NUM_SPECIAL + 999) / 2) < 10
    assert time.perf_counter() - start < 2.0


def test_thousand_eligible_tokens_give_bert_expectation():
    rng = np.random.default_rng(3)
    rows = 400
    ids = rng.integers(NUM_SPECIAL, VOCAB, size=(rows, 1002)).astype(np.int32)
    ids[:, 0], ids[:, -1] = CLS_ID, SEP_ID  # exactly 1,000 eligible per row
    out = mask_tokens(ids, rng, MaskingConfig(max_predictions=200), VOCAB)
    c = mask_counts(out)
    assert c["eligible"] == 1000 * rows
    assert c["selected"] == 150 * rows  # the fixed rule selects exactly 15%
    # Per-row means: standard error ~0.25 (masked), ~0.18 (random / unchanged).
    assert abs(c["masked"] / rows - 120) < 1.5
    assert abs(c["random"] / rows - 15) < 1.2
    assert abs(c["unchanged"] / rows - 15) < 1.2


def test_zero_selection_policies_are_counted():
    ids = np.array([[CLS_ID] + [10] * 6 + [SEP_ID], [CLS_ID, SEP_ID] + [PAD_ID] * 6])
    rare = {"select_rate": 1e-9, "selection": "bernoulli"}
    forced = mask_tokens(ids, np.random.default_rng(0), MaskingConfig(**rare), VOCAB)
    assert forced["loss_weights"].sum(axis=1).tolist() == [1, 0]
    assert mask_counts(forced)["sequences_without_selection"] == 1  # the row with nothing eligible
    skipped = mask_tokens(
        ids, np.random.default_rng(0), MaskingConfig(**rare, empty_policy="skip"), VOCAB
    )
    c = mask_counts(skipped)
    assert skipped["loss_weights"].sum() == 0
    assert c["sequences_without_selection"] == 2 and c["sequences_without_eligible"] == 1


def test_same_generator_state_gives_same_corruption():
    ids = framed_batch(np.random.default_rng(0), 32, 16)
    a = mask_tokens(ids, np.random.default_rng(5), MaskingConfig(), VOCAB)
    b = mask_tokens(ids, np.random.default_rng(5), MaskingConfig(), VOCAB)
    c = mask_tokens(ids, np.random.default_rng(6), MaskingConfig(), VOCAB)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["loss_weights"], c["loss_weights"])


@pytest.mark.parametrize(
    ("ids", "vocab_size", "match"),
    [
        (np.array([[7, 8]]), NUM_SPECIAL, "vocab_size must exceed"),
        (np.array([7, 8]), VOCAB, "2-D integer array"),
        (np.array([[7, VOCAB]]), VOCAB, r"must lie in \[0, 50\)"),
    ],
)
def test_invalid_arguments_raise_user_errors(ids, vocab_size, match):
    with pytest.raises(UserError, match=match):
        mask_tokens(ids, np.random.default_rng(0), MaskingConfig(), vocab_size)


def test_static_masks_reproducible_and_byte_identical(tmp_path, monkeypatch):
    windows = framed_batch(np.random.default_rng(0), 50, 12)
    cfg = MaskingConfig(max_predictions=4)
    a = make_static_masks(windows, cfg, VOCAB, seed=11, batch_size=16)
    b = make_static_masks(windows, cfg, VOCAB, seed=11, batch_size=16)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert a["input_ids"].shape == a["corruption"].shape == (50, 12)
    assert a["mask_positions"].shape == (50, 4)

    save_masks(tmp_path / "one" / "val_masks.npz", a)
    # Nothing in the file may depend on the wall clock: pretend an hour has passed.
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 3600)
    save_masks(tmp_path / "two" / "val_masks.npz", b)
    monkeypatch.undo()
    one = (tmp_path / "one" / "val_masks.npz").read_bytes()
    assert one == (tmp_path / "two" / "val_masks.npz").read_bytes()

    loaded = load_masks(tmp_path / "one" / "val_masks.npz")
    assert set(loaded) == set(a) and all(np.array_equal(loaded[k], a[k]) for k in a)
    assert mask_counts(loaded) == mask_counts(a)


def test_static_masks_of_empty_split(tmp_path):
    masks = make_static_masks(np.zeros((0, 8), np.int32), MaskingConfig(), VOCAB, seed=1)
    assert masks["input_ids"].shape == (0, 8) and masks["mask_ids"].shape[0] == 0
    save_masks(tmp_path / "val_masks.npz", masks)
    assert load_masks(tmp_path / "val_masks.npz")["corruption"].shape == (0, 8)
