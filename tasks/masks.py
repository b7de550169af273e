"""masks: the static validation corruption, generated once from a seed -> val_masks.npz."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from selfsup_model.errors import CorpusError
from selfsup_model.text.masking import make_static_masks, mask_counts, save_masks
from selfsup_model.text.tokenization import load_tokenizer
from tasks.stage import RunContext, StageOutput


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    vocab_size = load_tokenizer(inputs["tokenizer/tokenizer.json"]).get_vocab_size()
    windows = np.load(inputs["encode/val_windows.npy"], mmap_mode="r", allow_pickle=False)
    masks = make_static_masks(windows, ctx.config.masks, vocab_size, seed=ctx.config.masks.seed)
    save_masks(out / "val_masks.npz", masks)
    counts = mask_counts(masks)
    if counts["selected"] == 0:
        raise CorpusError("masks: the validation windows hold no maskable token; the corpus is "
                          "too small or too short for validation (add documents or lower "
                          "ingest.min_chars)")
    return StageOutput(["val_masks.npz"], {**counts, "scored_tokens": counts["selected"]})

