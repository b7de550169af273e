"""Pretraining batches: a pure function of the global step, so a resumed run replays exactly.

Without length buckets (`length_buckets=1`), step s reads stream positions
[s*B, (s+1)*B) of an endless sequence of passes over the training windows;
pass p visits the windows in the order of a permutation seeded by (seed, p).

With length buckets, a window belongs to the shortest bucket length that holds
all its non-[PAD] positions, and each pass is laid out in whole batches: every
bucket's windows in an order seeded by (seed, p), cut into full batches of B;
the leftovers of all buckets, shortest first, cut into batches at the longest
length they need (so at most one batch of the pass is short, and its shape is
the same in every pass); then the batch order is permuted (seeded) so lengths
mix through the pass. Every window is visited once per pass, a pass is always
ceil(n / B) batches, and step s is batch s mod ceil(n / B) of pass
s // ceil(n / B). A batch is trimmed to its length: only [PAD] columns go, so
the model's outputs at real positions do not change, and the set of shapes is
small and fixed (a compiled backend builds one program per shape).

With `pairs` (a contrastive term in the loss), a step holds B/2 anchor windows laid out as
above with B/2 in place of B, and each anchor is followed by its partner: another window of
the same document, or the anchor itself when its document has one window. Pass p draws every
window's partner at once from a Generator seeded by (seed, p), so with buckets a pair goes in
the bucket of its longer window and a batch is trimmed to what both halves of its pairs need
(drawing partners per batch instead would lengthen most batches to their longest partner).

With `packing`, several windows share a row of max_len positions instead: the
windows are packed once, best fit decreasing by length (each, longest first,
into the open row with the least room that still holds it), which fixes how
many rows R a pass has and which lengths share one; each pass then breaks ties
between equal lengths in a seeded order and permutes the rows, and step s reads
rows [s*B, (s+1)*B) of the endless sequence of passes (pass p is rows
[p*R, (p+1)*R)), so every batch is B full-length rows, one shape, and every
window is read once per pass. Each window opens with [CLS], so the model
keeps the documents of a row apart (`layers.DocumentMask`): a packed window is
computed as if alone. Masked-LM corruption is drawn per packed row, causal-LM
targets never cross into the next window.

Corruption for step s is drawn from a Generator seeded by (seed, s) (dynamic
masking: a window gets a new selection on every pass) or, with static training
masks, by (seed, window index) on the untrimmed window, which gives each window
the same corruption on every pass. Nothing depends on which batches were built
before, which is what makes `fit(initial_epoch=...)` after a kill reproduce an
uninterrupted run.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import keras
import numpy as np

from selfsup_model.config import MaskingConfig, PretrainConfig
from selfsup_model.errors import UserError
from selfsup_model.pretraining.devices import local_share
from selfsup_model.text.masking import mask_tokens
from selfsup_model.text.specials import BOS_ID, CLS_ID, NUM_SPECIAL, PAD_ID
from selfsup_model.text.windows import causal_lm_batch

# Independent random streams per purpose, so the pass order and the corruption
# of equal-numbered passes/steps are not the same numbers.
_ORDER_STREAM, _DYNAMIC_STREAM, _STATIC_STREAM, _PAIR_STREAM, _SAMPLE_STREAM = 0, 1, 2, 3, 4
_CHUNK_ROWS = 1 << 16  # windows scanned at a time when measuring lengths (bounded memory)


class StepTokens(NamedTuple):
    """What one step feeds the model: `rows` x `length` input positions, `real` of them
    not [PAD]."""
    rows: int
    length: int
    real: int

    @property
    def positions(self) -> int:
        return self.rows * self.length


def budget_steps(cfg: PretrainConfig, max_len: int) -> int:
    """Optimiser steps of the run: `steps`, or ceil(max_tokens / (batch * max_len)) input tokens
    (counted at the full window length, so the step count does not depend on bucketing)."""
    if cfg.max_tokens is not None:
        return max(1, math.ceil(cfg.max_tokens / (cfg.batch_size * max_len)))
    return cfg.steps


def bucket_lengths(max_len: int, buckets: int) -> tuple[int, ...]:
    """The sequence lengths batches are trimmed to: `buckets` equal slices of max_len, each
    rounded up to a multiple of 8 and capped at max_len (duplicates merge); 1 -> (max_len,)."""
    if buckets < 1:
        raise ValueError(f"length_buckets must be >= 1, got {buckets}")
    edges = (math.ceil(max_len * (k + 1) / buckets) for k in range(buckets))
    return tuple(sorted({min(max_len, -(-edge // 8) * 8) for edge in edges}))


def real_lengths(windows) -> tuple[np.ndarray, np.ndarray]:
    """(n,) non-[PAD] token counts and (n,) extents (last non-[PAD] position + 1) per window.
    The two agree for right-padded windows; trimming keeps the extent, so it would stay safe
    even if they did not."""
    n, length = windows.shape
    count, extent = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    for start in range(0, n, _CHUNK_ROWS):
        real = np.asarray(windows[start:start + _CHUNK_ROWS]) != PAD_ID  # (chunk, L)
        count[start:start + len(real)] = np.count_nonzero(real, axis=1)
        last = length - np.argmax(real[:, ::-1], axis=1)  # (chunk,)
        extent[start:start + len(real)] = np.where(real.any(axis=1), last, 0)
    return count, extent


def check_windows(windows, vocab_size: int) -> None:
    shape = getattr(windows, "shape", ())
    if len(shape) != 2 or shape[0] == 0 or shape[1] < 3:
        raise UserError("training windows must be a non-empty (n, max_len >= 3) array, "
                        f"got shape {shape}; rerun the encode stage")
    if not np.issubdtype(windows.dtype, np.integer):
        raise UserError(f"training windows must hold integer token ids, got {windows.dtype}")
    if vocab_size <= NUM_SPECIAL:
        raise UserError(f"vocab_size must exceed the {NUM_SPECIAL} special tokens, "
                        f"got {vocab_size}")


def _document_extents(doc_offsets, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(n,) first window and window count of each window's document, from (docs + 1,) offsets."""
    offsets = None if doc_offsets is None else np.asarray(doc_offsets, dtype=np.int64)
    if (offsets is None or offsets.ndim != 1 or len(offsets) < 2 or offsets[0] != 0
            or offsets[-1] != n or np.any(np.diff(offsets) < 0)):
        raise UserError(f"pairing windows by document needs offsets from 0 to the {n} training "
                        "windows, non-decreasing; rerun the encode stage")
    counts = np.diff(offsets)  # (docs,)
    return np.repeat(offsets[:-1], counts), np.repeat(counts, counts)


def pack_rows(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Best fit decreasing: (n,) lengths, each in [0, capacity], taken longest first (ties in
    the given order) -> (n,) the row each one goes in, numbered in order of opening. Each
    goes in the open row with the least room that still holds it, else opens a row. The
    assignment depends on the sorted lengths alone, so any order of equal lengths gets the
    same rows."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and (lengths.min() < 0 or lengths.max() > capacity):
        raise ValueError(f"lengths must lie in [0, {capacity}]")
    order = np.argsort(-lengths, kind="stable")
    row_of = np.empty(len(lengths), dtype=np.int64)
    # rooms[r]: open rows with exactly r positions free, most recently filled last.
    rooms: list[list[int]] = [[] for _ in range(capacity + 1)]
    has_room = np.zeros(capacity + 1, dtype=bool)
    opened = 0
    for item in order:  # one step per window, not per token
        need = int(lengths[item])
        fits = has_room[need:]
        if need * 2 > capacity or not fits.any():  # nothing already open can take it
            row, free = opened, capacity
            opened += 1
        else:
            free = need + int(np.argmax(fits))
            row = rooms[free].pop()
            has_room[free] = bool(rooms[free])
        row_of[item] = row
        left = free - need
        rooms[left].append(row)
        has_room[left] = True
    return row_of


class _PackedLayout(NamedTuple):
    flat: np.ndarray  # (n,) window indices, row after row in the pass's row order
    starts: np.ndarray  # (rows + 1,) where each row begins in `flat`
    offsets: np.ndarray  # (n,) the column each window of `flat` starts at in its row


class _PassLayout(NamedTuple):
    flat: np.ndarray  # (n,) window indices (paired: anchors), batch after batch
    starts: np.ndarray  # (batches + 1,) where each batch begins in `flat`
    lengths: np.ndarray  # (batches,) the length each batch is trimmed to


class PretrainBatches(keras.utils.PyDataset):
    """Item i is global step `start_step + i`: mlm -> ({input_ids, mask_positions}, mask_ids,
    mask_weights); clm -> ({input_ids}, target_ids, loss_weights). input_ids (and clm's
    targets/weights) are (B, Lb) for the step's bucket length Lb (clm: Lb - 1); the mlm
    gathered arrays keep their fixed width P = masking.max_predictions. With `pairs`, rows 2i
    and 2i+1 are two windows of one document (`doc_offsets`: (docs + 1,) first window of each
    document, ending at n)."""

    def __init__(self, windows, *, objective: str, batch_size: int, total_steps: int, seed: int,
                 masking: MaskingConfig | None = None, vocab_size: int | None = None,
                 static_masks: bool = False, start_step: int = 0, length_buckets: int = 1,
                 pairs: bool = False, doc_offsets: np.ndarray | None = None,
                 packing: bool = False):
        # One worker, no multiprocessing: the batch for an index is built on demand and
        # tf.data's prefetch overlaps it with the step; workers would copy the memmap.
        super().__init__(workers=1, use_multiprocessing=False)
        if objective != "clm" and (masking is None or vocab_size is None):
            raise ValueError(f"the {objective} objective needs a MaskingConfig and the vocab size")
        self.windows, self.objective, self.batch_size = windows, objective, int(batch_size)
        self.total_steps, self.start_step, self.seed = int(total_steps), int(start_step), int(seed)
        self.masking, self.vocab_size, self.static_masks = masking, vocab_size, static_masks
        self.max_len = int(windows.shape[1])
        self.pairs = bool(pairs)
        if self.pairs:
            if self.batch_size < 4 or self.batch_size % 2:
                raise UserError("paired batches need an even batch_size of at least 4, "
                                f"got {self.batch_size}")
            self._first, self._span = _document_extents(doc_offsets, len(windows))
        # Windows laid out per step: the anchors, each followed by its partner when paired.
        self._rows = self.batch_size // 2 if self.pairs else self.batch_size
        self.bucket_lengths = bucket_lengths(self.max_len, int(length_buckets))
        self.real, extent = real_lengths(windows)  # (n,), (n,)
        self.extent = extent
        self.bucket_of = np.searchsorted(self.bucket_lengths, extent)  # (n,) bucket index
        self._members = [np.flatnonzero(self.bucket_of == b)
                         for b in range(len(self.bucket_lengths))]
        self._orders: dict[int, np.ndarray] = {}
        self._layouts: dict[int, _PassLayout] = {}
        self._partner_draws: dict[int, np.ndarray] = {}
        self.packing = bool(packing)
        if self.packing:
            self._check_packable(int(length_buckets))
            self._rank_row = pack_rows(extent, self.max_len)[np.argsort(-extent, kind="stable")]
            self._packed_rows = int(self._rank_row.max()) + 1
            self._packed: dict[int, _PackedLayout] = {}

    def _check_packable(self, length_buckets: int) -> None:
        clash = [name for name, on in (("length buckets", length_buckets > 1),
                                       ("paired windows", self.pairs),
                                       ("static training masks", self.static_masks)) if on]
        if clash:
            raise UserError(f"packing cannot be combined with {' or '.join(clash)}")
        n = len(self.windows)
        for start in range(0, n, _CHUNK_ROWS):
            chunk = np.asarray(self.windows[start:start + _CHUNK_ROWS])
            opens = chunk[:, 0] == CLS_ID
            # Any other [CLS] or a [BOS] (the causal framing's opener) would split a window.
            rest = chunk[:, 1:]
            inner = np.count_nonzero((rest == CLS_ID) | (rest == BOS_ID), axis=1)
            bad = np.flatnonzero(~opens | (inner > 0))
            if bad.size:
                raise UserError(f"packing needs every training window to open with [CLS] and "
                                f"hold no other [CLS] or [BOS]; window {start + int(bad[0])} "
                                "does not. Rerun the encode stage, or set pretrain.packing=false")

    @property
    def bucketed(self) -> bool:
        return len(self.bucket_lengths) > 1

    @property
    def batches_per_pass(self) -> int:
        """Batches a pass takes (packed: rounded up; its last rows open the next batch, which
        the next pass's first rows fill)."""
        if self.packing:
            return math.ceil(self._packed_rows / self.batch_size)
        return math.ceil(len(self.windows) / self._rows)

    def __len__(self) -> int:
        return max(0, self.total_steps - self.start_step)

    def __getitem__(self, index: int):
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.batch_for_step(self.start_step + index)

    def _recent(self, cache: str, pass_index: int, build):
        """`self.<cache>[pass_index]`, built on first use. Only it and the pass before stay: a
        batch spans at most two passes, and prefetching may ask for the next pass before this
        one ends. The dict is replaced, never changed in place, so a thread reading it while
        another builds sees the old dict or the new one, whole."""
        value = getattr(self, cache).get(pass_index)
        if value is None:
            value = build()
            kept = {p: v for p, v in getattr(self, cache).items() if p >= pass_index - 1}
            setattr(self, cache, {**kept, pass_index: value})
        return value

    def _order(self, pass_index: int) -> np.ndarray:
        return self._recent("_orders", pass_index, lambda: np.random.default_rng(
            [self.seed, _ORDER_STREAM, pass_index]).permutation(len(self.windows)))

    def _layout(self, pass_index: int) -> _PassLayout:
        return self._recent("_layouts", pass_index, lambda: self._lay_out(pass_index))

    def _partners(self, pass_index: int) -> np.ndarray:
        """(n,) each window's partner in pass `pass_index`: another window of its document,
        uniformly, or itself when its document has one window."""
        def draw() -> np.ndarray:
            rng = np.random.default_rng([self.seed, _PAIR_STREAM, pass_index])
            shift = 1 + rng.integers(0, np.maximum(self._span - 1, 1))  # (n,) 1 .. span-1
            window = np.arange(len(self.windows), dtype=np.int64)
            return np.where(self._span > 1,
                            self._first + (window - self._first + shift) % self._span, window)
        return self._recent("_partner_draws", pass_index, draw)

    def _lay_out(self, pass_index: int) -> _PassLayout:
        rng = np.random.default_rng([self.seed, _ORDER_STREAM, pass_index])
        size, batches, spare = self._rows, [], []
        bucket_of, members = self.bucket_of, self._members
        if self.pairs:  # a pair needs the bucket of its longer window
            bucket_of = np.maximum(bucket_of, bucket_of[self._partners(pass_index)])
            members = [np.flatnonzero(bucket_of == b) for b in range(len(self.bucket_lengths))]
        for bucket in members:
            shuffled = bucket[rng.permutation(len(bucket))]
            cut = len(shuffled) - len(shuffled) % size
            batches += [shuffled[i:i + size] for i in range(0, cut, size)]
            spare.append(shuffled[cut:])
        pool = np.concatenate(spare)  # bucket by bucket, shortest first
        # Cut from the longest end: the one short batch (if any) holds the shortest windows.
        batches += [pool[max(0, end - size):end] for end in range(len(pool), 0, -size)]
        batches = [batches[i] for i in rng.permutation(len(batches))]
        lengths = np.array([self.bucket_lengths[bucket_of[b].max()] for b in batches])
        if self.pairs:  # pairs change every pass: the short batch keeps one shape in all of them
            lengths[np.array([len(b) < size for b in batches])] = self.max_len
        starts = np.cumsum([0] + [len(b) for b in batches])
        return _PassLayout(np.concatenate(batches), starts, lengths)

    def _packed_layout(self, pass_index: int) -> _PackedLayout:
        def build() -> _PackedLayout:
            rng = np.random.default_rng([self.seed, _ORDER_STREAM, pass_index])
            order = rng.permutation(len(self.windows))
            by_rank = order[np.argsort(-self.extent[order], kind="stable")]  # ties: seeded
            place = np.empty(self._packed_rows, dtype=np.int64)  # row -> its place in the pass
            place[rng.permutation(self._packed_rows)] = np.arange(self._packed_rows)
            where = place[self._rank_row]  # (n,) place of each rank's row
            ranked = np.argsort(where, kind="stable")  # row by row, longest window first
            flat, row = by_rank[ranked], where[ranked]  # (n,) each, row by row
            starts = np.concatenate([[0], np.cumsum(np.bincount(where, minlength=len(place)))])
            lengths = self.extent[flat]
            begin = np.cumsum(lengths) - lengths  # (n,) start in the rows laid end to end
            return _PackedLayout(flat, starts, begin - begin[starts[row]])
        return self._recent("_packed", pass_index, build)

    def _packed_step(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(windows, their row in the batch, their first column) of packed step `step`: rows
        [step*B, (step+1)*B) of the endless sequence of passes, each pass its rows in order."""
        stream = step * self.batch_size + np.arange(self.batch_size, dtype=np.int64)
        passes, places = np.divmod(stream, self._packed_rows)
        parts = []
        for p in np.unique(passes):  # at most two passes meet in one batch
            here = np.flatnonzero(passes == p)  # consecutive batch rows, consecutive places
            layout = self._packed_layout(int(p))
            first, last = int(places[here[0]]), int(places[here[-1]]) + 1
            span = slice(layout.starts[first], layout.starts[last])
            counts = np.diff(layout.starts[first:last + 1])
            parts.append((layout.flat[span], np.repeat(here, counts), layout.offsets[span]))
        return tuple(np.concatenate(arrays) for arrays in zip(*parts))

    def _packed_batch(self, step: int) -> np.ndarray:
        """(B, max_len) int32 ids of packed step `step`: its windows side by side, [PAD] after."""
        index, rows, offsets = self._packed_step(step)
        ids = np.full((self.batch_size, self.max_len), PAD_ID, dtype=np.int32)
        columns = np.arange(self.max_len)
        ascending = np.argsort(index)  # a memmap is read in file order
        source = np.empty((len(index), self.max_len), dtype=np.int32)
        source[ascending] = self.windows[index[ascending]]
        keep = columns[None] < self.extent[index][:, None]  # (k, L) each window's extent
        target = (rows * self.max_len + offsets)[:, None] + columns[None]
        ids.reshape(-1)[target[keep]] = source[keep]
        return ids

    def _locate(self, step: int) -> tuple[_PassLayout, int]:
        pass_index, batch = divmod(step, self.batches_per_pass)
        return self._layout(pass_index), batch

    def window_indices(self, step: int) -> np.ndarray:
        """(B,) indices of the windows that global step `step` (0-based) trains on (with
        buckets, fewer for the one short batch of a pass); paired: anchor, partner, ...;
        packed: every window of the step's rows, row by row."""
        if self.packing:
            return self._packed_step(step)[0]
        anchors, passes = self._anchors(step)
        if not self.pairs:
            return anchors
        partners = np.empty_like(anchors)
        for p in np.unique(passes):
            here = passes == p
            partners[here] = self._partners(int(p))[anchors[here]]
        return np.stack([anchors, partners], axis=1).reshape(-1)

    def _anchors(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The step's anchor windows and the pass each belongs to."""
        if self.bucketed:
            layout, batch = self._locate(step)
            anchors = layout.flat[layout.starts[batch]:layout.starts[batch + 1]]
            return anchors, np.full(len(anchors), step // self.batches_per_pass)
        n = len(self.windows)
        stream = step * self._rows + np.arange(self._rows, dtype=np.int64)
        passes, offsets = np.divmod(stream, n)
        out = np.empty(self._rows, dtype=np.int64)
        for p in np.unique(passes):
            here = passes == p
            out[here] = self._order(int(p))[offsets[here]]
        return out, passes

    def step_length(self, step: int) -> int:
        """The window length step `step` is trimmed to (before the causal shift)."""
        if not self.bucketed:
            return self.max_len
        layout, batch = self._locate(step)
        return int(layout.lengths[batch])

    def step_tokens(self, step: int) -> StepTokens:
        """Input positions and real (non-[PAD]) input tokens step `step` feeds, from the window
        lengths alone (no batch is built): equal to counting the batch's input_ids."""
        if self.packing:  # per row: the real tokens of the windows packed into it
            index, rows, _ = self._packed_step(step)
            real = np.bincount(rows, weights=self.real[index],
                               minlength=self.batch_size).astype(np.int64)
            rows_count = self.batch_size
        else:
            index = self.window_indices(step)
            real, rows_count = self.real[index], len(index)  # (B,)
        length = self.step_length(step)
        if self.objective == "clm":  # inputs are x[:, :length - 1]
            length -= 1
            real = np.minimum(real, length)
        return StepTokens(rows_count, length, int(real.sum()))

    def shapes(self) -> set[tuple[int, int]]:
        """Every (rows, length) input_ids shape a step can have: the same in every pass
        (paired: the first pass's; as pairs are redrawn, a later pass can fill a batch at a
        bucket length that had none in the first, on data with few windows per bucket)."""
        steps = range(self.batches_per_pass) if self.bucketed else range(1)
        return {(t.rows, t.length) for t in map(self.step_tokens, steps)}

    def batch_for_step(self, step: int):
        if self.packing:
            ids = self._packed_batch(step)  # (B, L)
            index, length = None, self.max_len
        else:
            index, length = self.window_indices(step), self.step_length(step)
            ids = np.asarray(self.windows[index], dtype=np.int32)  # (B, L)
        if self.objective == "clm":
            b = causal_lm_batch(ids[:, :length])  # already shifted once: (B, Lb-1) each
            return {"input_ids": b["input_ids"]}, b["target_ids"], b["loss_weights"]
        m = self._corrupt(ids, index, step, length)
        x = {"input_ids": m["input_ids"], "mask_positions": m["mask_positions"]}  # (B, Lb), (B, P)
        if self.objective == "rtd":  # the generator's draws come with the step, like its masks
            x["original_ids"] = np.ascontiguousarray(ids[:, :length])  # (B, Lb)
            x["mask_weights"] = m["mask_weights"]  # (B, P): which positions are selected
            x["sample_uniform"] = np.random.default_rng(
                [self.seed, _SAMPLE_STREAM, step]).random(m["mask_positions"].shape,
                                                          dtype=np.float32)  # (B, P)
        return x, m["mask_ids"], m["mask_weights"]  # (B, P), (B, P)

    def _corrupt(self, ids: np.ndarray, index: np.ndarray, step: int,
                 length: int) -> dict[str, np.ndarray]:
        if not self.static_masks:
            rng = np.random.default_rng([self.seed, _DYNAMIC_STREAM, step])
            return mask_tokens(np.ascontiguousarray(ids[:, :length]), rng, self.masking,
                               self.vocab_size)
        # Corrupted at full length, then trimmed: the same draws whatever batch a window is in.
        rows = [mask_tokens(ids[i:i + 1],
                            np.random.default_rng([self.seed, _STATIC_STREAM, int(w)]),
                            self.masking, self.vocab_size) for i, w in enumerate(index)]
        out = {key: np.concatenate([r[key] for r in rows]) for key in rows[0]}
        out["input_ids"] = np.ascontiguousarray(out["input_ids"][:, :length])
        return out


def fit_input(data: PretrainBatches):
    """What `fit` reads. Keras types a PyDataset for TensorFlow from its first two batches, so
    with buckets (which those two may not show) the batches go through tf.data with the varying
    dimensions left open: one traced function, which XLA compiles once per concrete shape."""
    if not data.bucketed or keras.backend.backend() != "tensorflow":
        return data
    import tensorflow as tf  # only on the TensorFlow backend

    spec = keras.tree.map_structure(
        lambda a: tf.TensorSpec((None,) * a.ndim, tf.as_dtype(a.dtype)), data[0])
    dataset = tf.data.Dataset.from_generator(
        lambda: (data[i] for i in range(len(data))), output_signature=spec)
    return dataset.prefetch(tf.data.AUTOTUNE)


class ProcessSlice(keras.utils.PyDataset):
    """This training process's share of every global batch of `data` (`devices.local_share`):
    together the processes' shares are the global batch."""

    def __init__(self, data: PretrainBatches):
        super().__init__()
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        return keras.tree.map_structure(local_share, self.data[i])
