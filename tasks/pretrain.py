"""pretrain: training windows + static validation masks -> encoder.keras, \
pretrain_model.keras, history."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from selfsup_model.artifacts import sha256_file, sha256_json
from selfsup_model.config import PretrainConfig
from selfsup_model.errors import ArtifactError
from selfsup_model.pretraining.batches import budget_steps
from selfsup_model.pretraining.continued import (
    continuation_budget,
    continuation_windows,
    recorded_file,
    resolve_init_source,
)
from selfsup_model.pretraining.loop import DETECTION_FILE, pretrain
from selfsup_model.text.masking import load_masks
from selfsup_model.text.tokenization import load_tokenizer
from tasks.joined import invite
from tasks.registry import PIPELINE
from tasks.stage import RunContext, StageOutput, code_version
from tasks.versions import snapshot_file, version_number, warm_start, warm_start_params

log = logging.getLogger("selfsup.pretrain")

OUTPUTS = ["encoder.keras", "pretrain_model.keras", "history.json", "loss_curve.png"]


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    invite("pretrain")  # other training processes, if any, join in (`follow`)
    result, windows, init, continued = _pretrain(ctx, out, inputs)
    counts = {**continued, "steps": result.steps, "tokens_seen": result.tokens_seen,
              "real_tokens_seen": result.real_tokens_seen,
              "scored_tokens": int(result.scored_tokens), "empty_batches": result.empty_batches,
              "resumed_from_step": result.resumed_from_step, "train_windows": int(windows.shape[0]),
              "initialised_from": init.describe() if init else fresh_start(ctx.config.pretrain)}
    if ctx.config.pretrain.objective == "rtd":  # scored_tokens above are its generator's
        counts["detection_scored_tokens"] = int(result.detection_scored_tokens)
    metrics = {**result.val_metrics, "val/unigram_baseline_loss": result.unigram_baseline_loss,
               "train/tokens_per_s": result.tokens_per_s,
               "train/real_tokens_per_s": result.real_tokens_per_s}
    outputs = OUTPUTS + ([DETECTION_FILE] if ctx.config.pretrain.objective == "rtd" else [])
    return StageOutput(outputs, counts, metrics, log_artifacts=["history.json", "loss_curve.png"])


def fresh_start(cfg: PretrainConfig) -> str:
    """What an encoder that continues no other starts from (`pretrain.embedding_init`)."""
    if cfg.embedding_init == "cooccurrence":
        return "random initialisation, token embeddings from co-occurrence counts"
    return "random initialisation"


def _pretrain(ctx: RunContext, out: Path, inputs: dict[str, Path]):
    vocab_size = load_tokenizer(inputs["tokenizer/tokenizer.json"]).get_vocab_size()
    windows = np.load(inputs["encode/train_windows.npy"], mmap_mode="r", allow_pickle=False)
    val_masks = load_masks(inputs["masks/val_masks.npz"])
    doc_offsets = np.load(inputs["encode/train_doc_offsets.npy"], allow_pickle=False)
    cfg, pretrain_cfg, counts = ctx.config, ctx.config.pretrain, {}
    init = resolve_init_source(cfg.pretrain.init_from) if cfg.pretrain.init_from else None
    snapshot, why = warm_start(ctx)
    if why:
        log.info("pretrain: from %s (%s)", fresh_start(ctx.config.pretrain), why)
    if snapshot is not None:  # a later corpus version: continue the last version's encoder
        init = resolve_init_source(str(snapshot))
        windows, doc_offsets, pretrain_cfg, counts = _continuation(ctx, snapshot, windows,
                                                                   doc_offsets)
    result = pretrain(windows, val_masks, vocab_size, cfg.model, pretrain_cfg, cfg.masks, out,
                      log_metrics=ctx.metric_logger(), init=init,
                      tokenizer_sha256=sha256_file(inputs["tokenizer/tokenizer.json"]),
                      doc_offsets=doc_offsets, inputs_sha256=_fingerprint_inputs(ctx, inputs),
                      log_destination=ctx.stage_run)
    return result, windows, init, counts


def _continuation(ctx: RunContext, snapshot: Path, windows: np.ndarray,
                  doc_offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray, PretrainConfig, dict]:
    """The windows, offsets and schedule of a version that continues `snapshot`'s encoder: its
    new training documents plus a replay sample of earlier ones (`continuation_windows`), the
    first version's schedule scaled to them (`continuation_budget`)."""
    cfg = ctx.config.pretrain
    earlier = pq.read_table(snapshot_file(snapshot, "split", "assignments.parquet"),
                            columns=["id", "split"]).to_pydict()
    earlier_train = [i for i, s in zip(earlier["id"], earlier["split"], strict=True)
                     if s == "train"]
    docs = recorded_file(ctx.workdir, "encode", "train_docs.parquet", "pretrain")[0]
    ids = pq.read_table(docs, columns=["id"]).column("id").to_numpy(zero_copy_only=False)
    if len(ids) != len(doc_offsets) - 1:
        raise ArtifactError(f"{docs} lists {len(ids)} documents but the training windows' "
                            f"offsets {len(doc_offsets) - 1}; rerun with --force encode")
    chosen = continuation_windows(doc_offsets, np.isin(ids, np.asarray(earlier_train, object)),
                                  cfg.replay, cfg.seed, cfg.batch_size)
    full = budget_steps(cfg, int(windows.shape[1]))
    steps, warmup = continuation_budget(full, cfg.warmup_steps, len(chosen.rows),
                                        int(windows.shape[0]))
    version = version_number(snapshot)
    log.info("pretrain: continuing corpus version %d's encoder over its %d new training "
             "documents and %d replayed earlier ones (%d of %d windows): %d steps, %d of them "
             "warm-up (pretrain.versions=scratch trains from random initialisation instead)",
             version, chosen.new_documents, chosen.replayed_documents, len(chosen.rows),
             windows.shape[0], steps, warmup)
    counts = {"continued_version": version, "new_train_documents": chosen.new_documents,
              "replayed_documents": chosen.replayed_documents,
              "split_train_windows": int(windows.shape[0])}
    return (np.asarray(windows[chosen.rows]), chosen.doc_offsets,
            cfg.model_copy(update={"steps": steps, "max_tokens": None, "warmup_steps": warmup}),
            counts)


def _fingerprint_inputs(ctx: RunContext, inputs: dict[str, Path]) -> dict[str, str]:
    """The inputs' hashes, the stage's version and the version it continues, if any: a
    checkpoint left by a run on other data or by older code (an earlier stage version) must not
    be resumed as if it were this run's."""
    spec = next(s for s in PIPELINE if s.name == "pretrain")
    continues = warm_start_params(ctx)
    return {**{name: sha256_file(path) for name, path in sorted(inputs.items())},
            "code_version": code_version(spec),
            **({"continues": sha256_json(continues)} if continues else {})}


def follow(ctx: RunContext) -> None:
    """A training process other than 0, invited by process 0: pretrain with it on the inputs it
    wrote (a shared workdir), writing nothing."""
    spec = next(s for s in PIPELINE if s.name == "pretrain")
    _pretrain(ctx, ctx.stage_dir("pretrain"), {k: ctx.artifact(k) for k in spec.inputs})
