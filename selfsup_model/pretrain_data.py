"""Pretraining batches: a pure function of the global step, so a resumed run replays exactly.

Step s reads stream positions [s*B, (s+1)*B) of an endless sequence of passes
over the training windows; pass p visits the windows in the order of a
permutation seeded by (seed, p). Corruption for step s is drawn from a
Generator seeded by (seed, s) (dynamic masking: a window gets a new selection
on every pass) or, with static training masks, by (seed, window index), which
gives each window the same corruption on every pass. Nothing depends on which
batches were built before, which is what makes `fit(initial_epoch=...)` after
a kill reproduce an uninterrupted run.
"""

from __future__ import annotations

import math

import keras
import numpy as np

from selfsup_model.config import MaskingConfig, PretrainConfig
from selfsup_model.errors import UserError
from selfsup_model.masking import mask_tokens
from selfsup_model.specials import NUM_SPECIAL
from selfsup_model.windows import causal_lm_batch

# Independent random streams per purpose, so the pass order and the corruption
# of equal-numbered passes/steps are not the same numbers.
_ORDER_STREAM, _DYNAMIC_STREAM, _STATIC_STREAM = 0, 1, 2


def budget_steps(cfg: PretrainConfig, max_len: int) -> int:
    """Optimiser steps of the run: `steps`, or ceil(max_tokens / (batch * max_len)) input tokens."""
    if cfg.max_tokens is not None:
        return max(1, math.ceil(cfg.max_tokens / (cfg.batch_size * max_len)))
    return cfg.steps


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


class PretrainBatches(keras.utils.PyDataset):
    """Item i is global step `start_step + i`: mlm -> ({input_ids, mask_positions}, mask_ids,
    mask_weights); clm -> ({input_ids}, target_ids, loss_weights), all fixed-shape."""

    def __init__(self, windows, *, objective: str, batch_size: int, total_steps: int, seed: int,
                 masking: MaskingConfig | None = None, vocab_size: int | None = None,
                 static_masks: bool = False, start_step: int = 0):
        # One worker, no multiprocessing: the batch for an index is built on demand and
        # tf.data's prefetch overlaps it with the step; workers would copy the memmap.
        super().__init__(workers=1, use_multiprocessing=False)
        if objective == "mlm" and (masking is None or vocab_size is None):
            raise ValueError("the mlm objective needs a MaskingConfig and the vocab size")
        self.windows, self.objective, self.batch_size = windows, objective, int(batch_size)
        self.total_steps, self.start_step, self.seed = int(total_steps), int(start_step), int(seed)
        self.masking, self.vocab_size, self.static_masks = masking, vocab_size, static_masks
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return max(0, self.total_steps - self.start_step)

    def __getitem__(self, index: int):
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.batch_for_step(self.start_step + index)

    def _order(self, pass_index: int) -> np.ndarray:
        order = self._orders.get(pass_index)
        if order is None:
            rng = np.random.default_rng([self.seed, _ORDER_STREAM, pass_index])
            order = rng.permutation(len(self.windows))
            # A batch spans at most two passes; older orders are never asked for again.
            self._orders = {p: o for p, o in self._orders.items() if p >= pass_index - 1}
            self._orders[pass_index] = order
        return order

    def window_indices(self, step: int) -> np.ndarray:
        """(B,) indices of the windows that global step `step` (0-based) trains on."""
        n = len(self.windows)
        stream = step * self.batch_size + np.arange(self.batch_size, dtype=np.int64)
        passes, offsets = np.divmod(stream, n)
        out = np.empty(self.batch_size, dtype=np.int64)
        for p in np.unique(passes):
            here = passes == p
            out[here] = self._order(int(p))[offsets[here]]
        return out

    def batch_for_step(self, step: int):
        index = self.window_indices(step)
        ids = np.asarray(self.windows[index], dtype=np.int32)  # (B, L)
        if self.objective == "clm":
            b = causal_lm_batch(ids)  # already shifted once: (B, L-1) each
            return {"input_ids": b["input_ids"]}, b["target_ids"], b["loss_weights"]
        m = self._corrupt(ids, index, step)
        x = {"input_ids": m["input_ids"], "mask_positions": m["mask_positions"]}  # (B, L), (B, P)
        return x, m["mask_ids"], m["mask_weights"]  # (B, P), (B, P)

    def _corrupt(self, ids: np.ndarray, index: np.ndarray, step: int) -> dict[str, np.ndarray]:
        if not self.static_masks:
            rng = np.random.default_rng([self.seed, _DYNAMIC_STREAM, step])
            return mask_tokens(ids, rng, self.masking, self.vocab_size)
        rows = [mask_tokens(ids[i:i + 1],
                            np.random.default_rng([self.seed, _STATIC_STREAM, int(w)]),
                            self.masking, self.vocab_size) for i, w in enumerate(index)]
        return {key: np.concatenate([r[key] for r in rows]) for key in rows[0]}
