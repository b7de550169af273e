"""Masked-LM corruption: one family for static validation masks and dynamic training masks.

Selection picks real, non-special positions only. Per sequence, the number to
select is
  'fixed'     n = min(max_predictions, max(1, round(n_eligible * select_rate)))
              (the BERT rule; round half to even, as Python's round), or
  'bernoulli' n = min(max_predictions, Binomial(n_eligible, select_rate)),
and then a uniformly random n-subset of the eligible positions is taken.
For 'bernoulli' this is the same distribution as keeping each eligible
position with probability select_rate and capping at max_predictions with a
random subset, but it needs one binomial draw per row instead of one uniform
per token. A sequence with eligible tokens but n == 0 (possible only under
'bernoulli') gets one random eligible position when empty_policy ==
'force_one'; under 'skip' it stays unselected and is counted. A sequence with
no eligible tokens is never selected and is counted too.

Of the selected positions, each independently becomes [MASK] (mask_rate), a
random token drawn uniformly from the non-special ids [NUM_SPECIAL, vocab)
(random_rate; it may coincide with the original), or stays unchanged
(keep_rate). The target is always the original id.

Everything is vectorised over the batch and driven by the explicit Generator,
so the same Generator state gives the same arrays.
"""

from __future__ import annotations

import os
import zipfile
from typing import Any

import numpy as np

from selfsup_model.artifacts import atomic_path
from selfsup_model.config import MaskingConfig
from selfsup_model.errors import ArtifactError, UserError
from selfsup_model.text.specials import (
    CORRUPT_MASK,
    CORRUPT_NONE,
    CORRUPT_RANDOM,
    CORRUPT_UNCHANGED,
    MASK_ID,
    NUM_SPECIAL,
    UNK_ID,
)

DENSE_KEYS = ("input_ids", "target_ids", "loss_weights", "corruption")
GATHERED_KEYS = ("mask_positions", "mask_ids", "mask_weights")
MASK_KEYS = DENSE_KEYS + GATHERED_KEYS + ("num_eligible",)
# Fixed zip entry date (the zip epoch): two saves of the same arrays are byte-identical.
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)


def eligible_mask(ids: np.ndarray, protect_unk: bool = True) -> np.ndarray:
    """True at real, non-special tokens; [UNK] is eligible only when not protected."""
    ids = np.asarray(ids)
    eligible = ids >= NUM_SPECIAL
    if not protect_unk:
        eligible |= ids == UNK_ID
    return eligible


def mask_tokens(
    ids: np.ndarray,
    rng: np.random.Generator,
    cfg: MaskingConfig,
    vocab_size: int,
    protect_unk: bool = True,
) -> dict[str, np.ndarray]:
    """Corrupt a (B, L) batch of token ids; returns dense and gathered MLM arrays.

    Dense, all (B, L): `input_ids` int32 (corrupted), `target_ids` int32 (the
    originals everywhere), `loss_weights` float32 (1 at selected positions),
    `corruption` int8 (0 none, 1 [MASK], 2 random, 3 unchanged).
    Gathered, all (B, max_predictions), selected positions in ascending order,
    padded with 0: `mask_positions` int32, `mask_ids` int32, `mask_weights`
    float32. Plus `num_eligible` (B,) int32, for `mask_counts`.
    """
    ids = _check_batch(ids, vocab_size)
    batch, length = ids.shape
    eligible = eligible_mask(ids, protect_unk)  # (B, L)
    num_eligible = np.count_nonzero(eligible, axis=1)  # (B,)
    num_select = _selection_sizes(num_eligible, rng, cfg)  # (B,)
    selected = _select_positions(eligible, num_select, rng, cfg.max_predictions)  # (B, L)

    flat = np.flatnonzero(selected)  # (S,) row-major, so ascending within each row
    kind = _corruption_kinds(flat.size, rng, cfg)  # (S,) int8
    input_ids = ids.copy()
    input_flat = input_ids.reshape(-1)
    input_flat[flat[kind == CORRUPT_MASK]] = MASK_ID
    is_random = flat[kind == CORRUPT_RANDOM]
    input_flat[is_random] = rng.integers(
        NUM_SPECIAL, vocab_size, size=is_random.size, dtype=np.int32
    )
    corruption = np.zeros((batch, length), dtype=np.int8)
    corruption.reshape(-1)[flat] = kind

    out = {
        "input_ids": input_ids,
        "target_ids": ids.copy(),  # never alias the caller's (possibly memory-mapped) batch
        "loss_weights": selected.astype(np.float32),
        "corruption": corruption,
    }
    out.update(_gather(ids, flat, num_select, cfg.max_predictions))
    out["num_eligible"] = num_eligible.astype(np.int32)
    return out


def _check_batch(ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """(B, L) int32 ids (a copy only when the dtype differs), validated against vocab_size."""
    if vocab_size <= NUM_SPECIAL:
        raise UserError(
            f"vocab_size must exceed the {NUM_SPECIAL} special tokens so random replacements "
            f"exist, got {vocab_size}; fit a larger tokenizer"
        )
    ids = np.asarray(ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise UserError(
            f"token ids must be a 2-D integer array (batch, length), got {ids.dtype} {ids.shape}"
        )
    ids = ids.astype(np.int32, copy=False)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise UserError(
            f"token ids must lie in [0, {vocab_size}) for vocab_size={vocab_size}, found "
            f"[{ids.min()}, {ids.max()}]; was the batch encoded with another tokenizer?"
        )
    return ids


def _selection_sizes(
    num_eligible: np.ndarray, rng: np.random.Generator, cfg: MaskingConfig
) -> np.ndarray:
    """(B,) int64 positions to select per row, per the selection rule and empty policy."""
    if cfg.selection == "fixed":
        wanted = np.maximum(1, np.rint(num_eligible * cfg.select_rate).astype(np.int64))
    else:
        wanted = rng.binomial(num_eligible, cfg.select_rate).astype(np.int64)
        if cfg.empty_policy == "force_one":
            wanted = np.maximum(wanted, 1)
    # Never more than the eligible tokens (so rows without any stay at 0) or the head's width.
    return np.minimum(np.minimum(wanted, num_eligible), cfg.max_predictions)


def _select_positions(
    eligible: np.ndarray, num_select: np.ndarray, rng: np.random.Generator, max_predictions: int
) -> np.ndarray:
    """(B, L) bool: per row, the `num_select` eligible positions with the smallest random keys."""
    batch, length = eligible.shape
    if batch == 0 or length == 0 or not num_select.any():
        return np.zeros((batch, length), dtype=bool)
    # uint64 keys: random high bits, the column in the low bits (so keys in a row are
    # distinct and exactly n are <= the n-th smallest), top bit set when not eligible.
    shift = np.uint64(max(1, int(length - 1).bit_length()))
    raw = rng.bit_generator.random_raw(batch * length).reshape(batch, length)
    keys = ((raw >> np.uint64(1)) >> shift) << shift
    keys |= np.arange(length, dtype=np.uint64)
    keys |= (~eligible).astype(np.uint64) << np.uint64(63)
    width = min(max_predictions, length)
    if width < length:
        # Only the row's `width` smallest keys can matter: partition, then sort those few.
        keys_small = np.partition(keys, width - 1, axis=1)[:, :width]
    else:
        keys_small = keys
    keys_small = np.sort(keys_small, axis=1)  # (B, width)
    kth = np.maximum(num_select - 1, 0)
    threshold = keys_small[np.arange(batch), kth]  # (B,) n-th smallest key
    selected = keys <= threshold[:, None]
    selected &= (num_select > 0)[:, None]  # rows with n == 0 select nothing
    return selected


def _corruption_kinds(n: int, rng: np.random.Generator, cfg: MaskingConfig) -> np.ndarray:
    """(n,) int8 corruption kind per selected position: 1 MASK, 2 random, 3 unchanged."""
    u = rng.random(n)
    kind = np.full(n, CORRUPT_MASK, dtype=np.int8)
    kind[u >= cfg.mask_rate] = CORRUPT_RANDOM
    kind[u >= cfg.mask_rate + cfg.random_rate] = CORRUPT_UNCHANGED
    return kind


def _gather(
    ids: np.ndarray, flat: np.ndarray, num_select: np.ndarray, width: int
) -> dict[str, np.ndarray]:
    """Selected positions packed left into (B, width) slots, ascending, zero-padded."""
    batch, length = ids.shape
    rows, cols = np.divmod(flat, length)  # (S,)
    row_start = np.cumsum(num_select) - num_select  # (B,) first slot index of each row in `flat`
    slot = np.arange(flat.size) - row_start[rows]  # (S,) rank within the row
    positions = np.zeros((batch, width), dtype=np.int32)
    mask_ids = np.zeros((batch, width), dtype=np.int32)
    weights = np.zeros((batch, width), dtype=np.float32)
    positions[rows, slot] = cols
    mask_ids[rows, slot] = ids.reshape(-1)[flat]
    weights[rows, slot] = 1.0
    return {"mask_positions": positions, "mask_ids": mask_ids, "mask_weights": weights}


def mask_counts(result: dict[str, np.ndarray]) -> dict[str, int]:
    """Token and sequence counts of a `mask_tokens` / `make_static_masks` result.

    `sequences_without_selection` counts every row with nothing selected,
    including the `sequences_without_eligible` rows that had nothing to select.
    """
    corruption = result["corruption"]
    selected_per_row = np.count_nonzero(corruption != CORRUPT_NONE, axis=1)
    return {
        "sequences": int(corruption.shape[0]),
        "eligible": int(result["num_eligible"].sum()),
        "selected": int(selected_per_row.sum()),
        "masked": int(np.count_nonzero(corruption == CORRUPT_MASK)),
        "random": int(np.count_nonzero(corruption == CORRUPT_RANDOM)),
        "unchanged": int(np.count_nonzero(corruption == CORRUPT_UNCHANGED)),
        "sequences_without_eligible": int(np.count_nonzero(result["num_eligible"] == 0)),
        "sequences_without_selection": int(np.count_nonzero(selected_per_row == 0)),
    }


def make_static_masks(
    windows: np.ndarray, cfg: MaskingConfig, vocab_size: int, seed: int, batch_size: int = 4096
) -> dict[str, np.ndarray]:
    """Corrupt every window once from `seed`; same seed and batch_size -> same arrays."""
    if batch_size < 1:
        raise UserError(f"batch_size must be >= 1, got {batch_size}")
    rng = np.random.default_rng(seed)
    n = len(windows)
    starts = range(0, n, batch_size) if n else [0]
    parts = [
        mask_tokens(np.asarray(windows[s : s + batch_size]), rng, cfg, vocab_size) for s in starts
    ]
    return {key: np.concatenate([p[key] for p in parts]) for key in MASK_KEYS}


def save_masks(path: str | os.PathLike, masks: dict[str, np.ndarray]) -> None:
    """Write `val_masks.npz` atomically and byte-reproducibly (no timestamps, no pickle)."""
    missing = [k for k in MASK_KEYS if k not in masks]
    if missing:
        raise ValueError(f"masks lack {missing}; build them with make_static_masks")
    shapes = {k: np.shape(masks[k]) for k in DENSE_KEYS}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"dense mask arrays must share one shape, got {shapes}")
    save_arrays(path, {key: masks[key] for key in MASK_KEYS})


def save_arrays(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> None:
    """An .npz of `arrays` (in their order), written atomically and byte-reproducibly."""
    # The file's sha256 fingerprints it in the manifest, so it must be a pure function of
    # the arrays. Today's np.savez happens to leave entries at the zip epoch (older numpy
    # releases stamped a file time); pinning the date, order, attributes and ZIP_STORED
    # here does not depend on that detail.
    with atomic_path(path) as tmp, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zf:
        for key, array in arrays.items():
            info = zipfile.ZipInfo(f"{key}.npy", date_time=_ZIP_DATE)
            info.external_attr = 0o644 << 16
            with zf.open(info, "w", force_zip64=True) as fh:
                np.lib.format.write_array(fh, np.ascontiguousarray(array), allow_pickle=False)


def load_arrays(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every array of a `save_arrays` file, loaded eagerly, without pickle."""
    with np.load(path, allow_pickle=False) as data:
        return {key: data[key] for key in data.files}


def load_masks(path: str | os.PathLike) -> dict[str, Any]:
    """All arrays of a `save_masks` file, loaded eagerly, without pickle."""
    if not os.path.isfile(path):
        raise ArtifactError(f"missing mask file {path}; rerun the masks stage")
    masks = load_arrays(path)
    missing = [k for k in DENSE_KEYS if k not in masks]
    if missing:
        raise ArtifactError(f"mask file {path} lacks {missing}; rerun the masks stage")
    return masks
