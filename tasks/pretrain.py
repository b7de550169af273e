"""pretrain: training windows + static validation masks -> encoder.keras, \
pretrain_model.keras, history."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from selfsup_model.artifacts import sha256_file
from selfsup_model.pretraining.continued import resolve_init_source
from selfsup_model.pretraining.loop import pretrain
from selfsup_model.text.masking import load_masks
from selfsup_model.text.tokenization import load_tokenizer
from tasks.joined import invite
from tasks.registry import PIPELINE
from tasks.stage import RunContext, StageOutput, code_version

OUTPUTS = ["encoder.keras", "pretrain_model.keras", "history.json", "loss_curve.png"]


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    invite("pretrain")  # other training processes, if any, join in (`follow`)
    result, windows, init = _pretrain(ctx, out, inputs)
    counts = {"steps": result.steps, "tokens_seen": result.tokens_seen,
              "real_tokens_seen": result.real_tokens_seen,
              "scored_tokens": int(result.scored_tokens), "empty_batches": result.empty_batches,
              "resumed_from_step": result.resumed_from_step, "train_windows": int(windows.shape[0]),
              "initialised_from": init.describe() if init else "random initialisation"}
    metrics = {**result.val_metrics, "val/unigram_baseline_loss": result.unigram_baseline_loss,
               "train/tokens_per_s": result.tokens_per_s,
               "train/real_tokens_per_s": result.real_tokens_per_s}
    return StageOutput(OUTPUTS, counts, metrics, log_artifacts=["history.json", "loss_curve.png"])


def _pretrain(ctx: RunContext, out: Path, inputs: dict[str, Path]):
    vocab_size = load_tokenizer(inputs["tokenizer/tokenizer.json"]).get_vocab_size()
    windows = np.load(inputs["encode/train_windows.npy"], mmap_mode="r", allow_pickle=False)
    val_masks = load_masks(inputs["masks/val_masks.npz"])
    doc_offsets = np.load(inputs["encode/train_doc_offsets.npy"], allow_pickle=False)
    cfg = ctx.config
    init = resolve_init_source(cfg.pretrain.init_from) if cfg.pretrain.init_from else None
    result = pretrain(windows, val_masks, vocab_size, cfg.model, cfg.pretrain, cfg.masks, out,
                      log_metrics=ctx.metric_logger(), init=init,
                      tokenizer_sha256=sha256_file(inputs["tokenizer/tokenizer.json"]),
                      doc_offsets=doc_offsets, inputs_sha256=_fingerprint_inputs(inputs),
                      log_destination=ctx.stage_run)
    return result, windows, init


def _fingerprint_inputs(inputs: dict[str, Path]) -> dict[str, str]:
    """The inputs' hashes and the stage's version: a checkpoint left by a run on other data or
    by older code (an earlier stage version) must not be resumed as if it were this run's."""
    spec = next(s for s in PIPELINE if s.name == "pretrain")
    return {**{name: sha256_file(path) for name, path in sorted(inputs.items())},
            "code_version": code_version(spec)}


def follow(ctx: RunContext) -> None:
    """A training process other than 0, invited by process 0: pretrain with it on the inputs it
    wrote (a shared workdir), writing nothing."""
    spec = next(s for s in PIPELINE if s.name == "pretrain")
    _pretrain(ctx, ctx.stage_dir("pretrain"), {k: ctx.artifact(k) for k in spec.inputs})
