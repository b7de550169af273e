"""masks: the static validation corruption, generated once from a seed -> val_masks.npz."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE

from selfsup_model.masking import make_static_masks, mask_counts, save_masks
from selfsup_model.tokenization import load_tokenizer
from tasks.stage import RunContext, StageOutput, StageResult, StageSpec, run_stage

SPEC = StageSpec("masks", inputs=("encode/val_windows.npy", "tokenizer/tokenizer.json"), sections=("masks",))


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    vocab_size = load_tokenizer(inputs["tokenizer/tokenizer.json"]).get_vocab_size()
    windows = np.load(inputs["encode/val_windows.npy"], mmap_mode="r", allow_pickle=False)
    masks = make_static_masks(windows, ctx.config.masks, vocab_size, seed=ctx.config.masks.seed)
    save_masks(out / "val_masks.npz", masks)
    counts = mask_counts(masks)
    if counts["selected"] == 0:
        raise RuntimeError("the validation windows have no maskable tokens; the corpus is too small")
    return StageOutput(["val_masks.npz"], {**counts, "scored_tokens": counts["selected"]})


@task(name="masks", cache_policy=NO_CACHE, persist_result=False)
def masks_task(ctx: RunContext) -> StageResult:
    """Corrupt the validation windows once, so every evaluation scores the same positions."""
    return run_stage(SPEC, ctx, compute)
