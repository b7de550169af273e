"""Pretraining: `model.fit` over step-addressed batches, with exact kill-and-resume.

The backend's own train_step does gradients, AdamW, XLA and mixed precision;
only `compute_loss` is ours (the token-weighted loss, see `PretrainingModel`).
The run is cut into "epochs" of `checkpoint_every` steps over one persistent
data iterator, so a checkpoint lands at every epoch end and a resumed run is
`fit(initial_epoch=...)` over the same step-addressed batches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import keras
import numpy as np
from keras import ops

from selfsup_model.artifacts import atomic_write_json, save_keras_atomic, sha256_arrays, sha256_json
from selfsup_model.config import MaskingConfig, ModelConfig, PretrainConfig
from selfsup_model.errors import UserError
from selfsup_model.nn.model import (
    build_backbone,
    build_pretrain_export_model,
    build_pretraining_model,
    build_rtd_export_model,
    build_rtd_model,
    token_embedding_of,
    with_dropout,
)
from selfsup_model.nn.optimizers import SelectiveAdamW, WarmupDecay
from selfsup_model.nn.saving import load_keras_model
from selfsup_model.pretraining.batches import (
    PretrainBatches,
    ProcessSlice,
    budget_steps,
    check_windows,
    fit_input,
)
from selfsup_model.pretraining.callbacks import (
    JOURNAL,
    LATEST,
    CheckpointSaver,
    LogFn,
    MetricsReporter,
    read_checkpoint,
    restore_rng_state,
)
from selfsup_model.pretraining.continued import InitSource, check_compatible
from selfsup_model.pretraining.devices import (
    data_parallel_scope,
    no_distribution,
    process_count,
    process_index,
    resolve_jit,
    resolve_precision,
    xla_dropout_warning,
)
from selfsup_model.pretraining.embedding_init import cooccurrence_embeddings
from selfsup_model.pretraining.evaluation import (
    detection_corruption,
    unigram_log_probs,
    validation_metrics,
    validation_unigram_loss,
)
from selfsup_model.report.plots import plot_loss_curve
from selfsup_model.text.masking import save_arrays

log = logging.getLogger("selfsup.pretraining")

# rtd: the stored corruption its discriminator is validated on (`detection_corruption`).
DETECTION_FILE = "detection_val.npz"


def build_schedule(cfg: PretrainConfig, total_steps: int) -> WarmupDecay:
    return WarmupDecay(cfg.learning_rate, min(cfg.warmup_steps, total_steps), total_steps,
                       decay=cfg.decay)


def build_optimizer(cfg: PretrainConfig, total_steps: int) -> SelectiveAdamW:
    return SelectiveAdamW(learning_rate=build_schedule(cfg, total_steps),
                          weight_decay=cfg.weight_decay, global_clipnorm=cfg.clip_norm)


@dataclasses.dataclass(frozen=True)
class PretrainResult:
    steps: int
    tokens_seen: int  # input positions fed (sum of batch * length over steps), padding included
    real_tokens_seen: int  # of which not [PAD]
    scored_tokens: float  # predictions that counted in the loss (rtd: the generator's)
    tokens_per_s: float  # input positions/s of this process's steps (compile steps excluded)
    real_tokens_per_s: float  # real input tokens/s of the same steps
    empty_batches: int  # batches with nothing scored (loss 0, counted)
    resumed_from_step: int
    val_metrics: dict[str, float]
    unigram_baseline_loss: float
    encoder_path: Path
    pretrain_model_path: Path
    history_path: Path
    loss_curve_path: Path
    checkpoint_dir: Path
    detection_scored_tokens: float = 0.0  # rtd: tokens the discriminator's loss counted


def pretrain(train_windows, val_masks, vocab_size: int, model_cfg: ModelConfig,
             pretrain_cfg: PretrainConfig,
             masking_cfg: MaskingConfig, out_dir, log_metrics: LogFn | None = None,
             progress: bool = True, init: InitSource | None = None,
             tokenizer_sha256: str | None = None,
             doc_offsets: np.ndarray | None = None,
             inputs_sha256: Mapping[str, str] | None = None,
             log_destination: str | None = None) -> PretrainResult | None:
    """Pretrain an encoder on (n, max_len) windows, resuming from `out_dir/checkpoints` if
    present; with `init`, start from that run's pretrained model (continued pretraining),
    whose tokenizer must be this run's (`tokenizer_sha256`). `doc_offsets` ((docs + 1,), the
    first window of each document) is what a contrastive term pairs windows by
    (`pretrain_cfg.contrastive_weight`). `inputs_sha256` (what the inputs and the code are:
    file hashes, the stage's version) joins the configuration in the checkpoints' fingerprint,
    so a checkpoint of other data or older code is never resumed. `log_destination` names
    where `log_metrics` writes (an MLflow run id): resumed into a new destination, the run
    reports the steps before its checkpoint there again. Under JAX with several devices
    it runs data-parallel (`devices.data_parallel`).

    Several processes (Keras' ``KERAS_DISTRIBUTION_*`` launch variables, `devices.
    join_processes`) each call this with the same arguments; each feeds its slice of every
    global batch. Process 0 alone evaluates, reports `log_metrics` and writes `out_dir`, from
    a host copy of the trained weights; the others return None. Such a run starts afresh and
    writes no mid-run checkpoints (nothing to resume from)."""
    with data_parallel_scope(pretrain_cfg.batch_size, "pretraining"):
        return _pretrain(train_windows, val_masks, vocab_size, model_cfg, pretrain_cfg,
                         masking_cfg, out_dir, log_metrics, progress, init, tokenizer_sha256,
                         doc_offsets, inputs_sha256, log_destination)


def _pretrain(train_windows, val_masks, vocab_size: int, model_cfg: ModelConfig,
              pretrain_cfg: PretrainConfig, masking_cfg: MaskingConfig, out_dir,
              log_metrics: LogFn | None, progress: bool, init: InitSource | None,
              tokenizer_sha256: str | None, doc_offsets: np.ndarray | None,
              inputs_sha256: Mapping[str, str] | None,
              log_destination: str | None) -> PretrainResult:
    check_windows(train_windows, vocab_size)
    out_dir, obj, cfg = Path(out_dir), pretrain_cfg.objective, pretrain_cfg
    processes, writer = process_count(), process_index() == 0
    _check_val_masks(val_masks, int(train_windows.shape[1]))
    ckpt_dir = out_dir / "checkpoints"
    if writer:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    max_len = int(train_windows.shape[1])
    total = budget_steps(cfg, max_len)
    per_epoch = min(cfg.checkpoint_every, total)
    fingerprint = sha256_json({"model": model_cfg.model_dump(), "pretrain": cfg.model_dump(),
                               "masks": masking_cfg.model_dump(), "vocab_size": vocab_size,
                               "windows": list(train_windows.shape),
                               "init": init.pretrain_model_sha256 if init else None,
                               "inputs": dict(sorted((inputs_sha256 or {}).items()))})

    record = read_checkpoint(ckpt_dir) if processes == 1 else None
    if record is not None and record.get("fingerprint") != fingerprint:
        record = None  # another configuration's checkpoint: never resume from it
    if record is None:
        if writer:
            for stale in [*ckpt_dir.glob("ckpt-*.keras"), ckpt_dir / LATEST, ckpt_dir / JOURNAL]:
                stale.unlink(missing_ok=True)
        model = _fresh_model(vocab_size, max_len, model_cfg, cfg, total, init, tokenizer_sha256,
                             train_windows)
        start_step, initial_epoch, state = 0, 0, None
    else:
        model = load_keras_model(record["path"])  # safe_mode=True
        restore_rng_state(model, record.get("rng", {}))
        start_step, initial_epoch, state = record["step"], record["epoch"] + 1, record["reporter"]
    # With several processes the trained weights span devices no one process can run or save
    # alone: process 0 evaluates and saves a copy on its own device, synced from them.
    host = model
    if processes > 1:
        with no_distribution():
            host = _fresh_model(vocab_size, max_len, model_cfg, cfg, total, init,
                                tokenizer_sha256)  # its weights come from `model` (sync_host)

    def sync_host() -> None:
        if host is not model:  # replicated weights: each process reads its own replica
            host.set_weights(model.get_weights())

    export_model = (build_rtd_export_model(host) if obj == "rtd" else
                    build_pretrain_export_model(host.backbone, host.head, obj))
    log_probs = unigram_log_probs(train_windows, vocab_size, obj)
    baseline = validation_unigram_loss(log_probs, obj, val_masks)
    detection = detection_corruption(val_masks, log_probs, cfg.seed) if obj == "rtd" else None

    def evaluate() -> dict[str, float]:
        if not writer:
            return {}
        sync_host()
        with no_distribution() if host is not model else contextlib.nullcontext():
            return {**validation_metrics(export_model, obj, val_masks, cfg.batch_size,
                                         detection),
                    "val/unigram_baseline_loss": baseline}

    schedule = build_schedule(cfg, total)  # the optimiser's own (same config: same fingerprint)
    data = PretrainBatches(train_windows, objective=obj, batch_size=cfg.batch_size,
                           total_steps=total, seed=cfg.seed, masking=masking_cfg,
                           vocab_size=vocab_size, static_masks=cfg.static_train_masks,
                           start_step=start_step, length_buckets=cfg.length_buckets,
                           pairs=cfg.contrastive_weight > 0, doc_offsets=doc_offsets,
                           packing=cfg.packing)
    reporter = MetricsReporter(
        # rtd: train/mlm_loss is its generator's; the discriminator's is train/rtd_loss
        objective="mlm" if obj == "rtd" else obj, steps_per_epoch=per_epoch, total_steps=total,
        step_tokens=data.step_tokens,
        log_every=cfg.log_every, eval_every=cfg.eval_every, evaluate=evaluate,
        learning_rate=lambda step: float(ops.convert_to_numpy(schedule(step - 1))),
        log_metrics=log_metrics if writer else None, journal_dir=ckpt_dir if writer else None,
        state=state, log_destination=log_destination)
    callbacks: list[keras.callbacks.Callback] = [reporter]
    if processes == 1:
        callbacks.append(CheckpointSaver(ckpt_dir, steps_per_epoch=per_epoch, total_steps=total,
                                         reporter=reporter, fingerprint=fingerprint))
    reporter.replay_history()
    if start_step < total:
        verbose = (1 if sys.stdout.isatty() else 2) if progress and writer else 0
        with warnings.catch_warnings():
            # The last epoch is shorter when checkpoint_every does not divide the budget;
            # Keras warns that the data "ran out", which is exactly the plan.
            warnings.filterwarnings("ignore", message="Your input ran out of data")
            # shuffle=False: Keras would otherwise permute a PyDataset's batch indices, and
            # index i must stay global step start_step + i (the order is shuffled per pass inside).
            model.fit(fit_input(data) if processes == 1 else ProcessSlice(data),
                      epochs=math.ceil(total / per_epoch),
                      steps_per_epoch=per_epoch, initial_epoch=initial_epoch,
                      callbacks=callbacks, verbose=verbose, shuffle=False)

    if (not reporter.history or reporter.history[-1]["step"] != total
            or not _has_val(reporter.history[-1])):
        reporter.emit(total, evaluate())  # e.g. resumed from the final checkpoint
    if processes > 1:  # replicas that drifted apart would be a bug: make it visible
        log.info("process %d of %d: trained weights sha256 %s", process_index(), processes,
                 sha256_arrays(model.get_weights()))
    if not writer:
        return None
    sync_host()
    if detection is not None:
        save_arrays(out_dir / DETECTION_FILE, detection)
    return _write_outputs(out_dir, host, export_model, reporter, total, start_step, cfg, baseline)


def _check_val_masks(val_masks, max_len: int) -> None:
    ids = val_masks.get("input_ids") if hasattr(val_masks, "get") else None
    if ids is None or np.ndim(ids) != 2 or len(ids) == 0:
        raise UserError("validation masks need a non-empty (n, L) 'input_ids' array; "
                        "rerun the masks stage")
    if ids.shape[1] > max_len:
        raise UserError(f"validation windows are {ids.shape[1]} tokens but training windows "
                        f"{max_len}; encode both splits with the same encode.max_len")


def _fresh_model(vocab_size: int, max_len: int, model_cfg: ModelConfig, cfg: PretrainConfig,
                 total: int, init: InitSource | None = None, tokenizer_sha256: str | None = None,
                 train_windows=None):
    keras.utils.set_random_seed(cfg.seed)
    causal = cfg.objective == "clm"
    if init is None:
        backbone = build_backbone(vocab_size, max_len, model_cfg, causal=causal,
                                  dtype=resolve_precision(cfg.mixed_precision), seed=cfg.seed,
                                  documents=cfg.packing)
        if cfg.embedding_init == "cooccurrence" and train_windows is not None:
            _initialise_from_counts(backbone, train_windows, cfg.seed)
        return _compiled(_objective_model(backbone, model_cfg, cfg, cfg.seed), cfg, total)
    source = load_keras_model(init.pretrain_model)  # safe_mode=True, bytes verified by sha256
    source_rtd = getattr(source, "objective", None) == "rtd"
    if source_rtd != (cfg.objective == "rtd"):
        was = "rtd" if source_rtd else source.objective
        raise UserError(f"{init.describe()} was pretrained with the {was} objective; set "
                        f"pretrain.objective={was} to continue it")
    head = source.generator.head if source_rtd else source.head
    check_compatible(source.backbone, vocab_size=vocab_size, max_len=max_len, causal=causal,
                     model_cfg=model_cfg, tokenizer_sha256=tokenizer_sha256 or "",
                     source=init, head_tied=head.tie_embeddings)
    # The run's own precision, not the source's: a bf16 GPU encoder continued on a CPU computes
    # in float32 there, and its random_init baseline is built at the same precision.
    model = _objective_model(
        with_dropout(source.backbone, model_cfg.dropout, seed=cfg.seed,
                     dtype=resolve_precision(cfg.mixed_precision), documents=cfg.packing),
        model_cfg, cfg, None)
    if source_rtd:  # the generator (blocks and head) and the detection head continue too
        if source.generator_blocks != cfg.generator_blocks:
            raise UserError(f"{init.describe()} has a generator of {source.generator_blocks} "
                            f"blocks; set pretrain.generator_blocks={source.generator_blocks}")
        model.generator.set_weights(source.generator.get_weights())
        model.detector.set_weights(source.detector.get_weights())
    else:
        model.head.set_weights(source.head.get_weights())  # the objective head continues too
    return _compiled(model, cfg, total)


def _initialise_from_counts(backbone, train_windows, seed: int) -> None:
    """Token embeddings from the training windows' co-occurrence counts
    (`pretrain.embedding_init=cooccurrence`)."""
    embedding = token_embedding_of(backbone).token_embedding
    random_rows = ops.convert_to_numpy(embedding.embeddings)
    start = time.perf_counter()
    rows, counted = cooccurrence_embeddings(train_windows, random_rows.shape[0],
                                            random_rows.shape[1], random_rows, seed=seed)
    embedding.embeddings.assign(rows.astype(random_rows.dtype))
    log.info("pretrain: %d of %d token embeddings initialised from co-occurrence counts in "
             "%.1f s (the rest stay random)", counted, rows.shape[0], time.perf_counter() - start)


def _objective_model(backbone, model_cfg: ModelConfig, cfg: PretrainConfig, seed: int | None):
    """`backbone` with the objective's head (and for rtd its generator), seeded by `seed`."""
    if cfg.objective == "rtd":
        return build_rtd_model(backbone, model_cfg, cfg.generator_blocks, cfg.rtd_weight, seed,
                               **_contrastive(cfg))
    return build_pretraining_model(backbone, cfg.objective, model_cfg, seed, **_contrastive(cfg))


def _contrastive(cfg: PretrainConfig) -> dict[str, float]:
    return {"contrastive_weight": cfg.contrastive_weight,
            "contrastive_temperature": cfg.contrastive_temperature}


def _compiled(model, cfg: PretrainConfig, total: int):
    jit = resolve_jit(cfg.jit)
    if slow := xla_dropout_warning(jit, model):
        log.warning(slow)
    model.compile(optimizer=build_optimizer(cfg, total), jit_compile=jit)
    return model


def _has_val(entry: dict[str, Any]) -> bool:
    return any(k.startswith("val/") and k != "val/unigram_baseline_loss" for k in entry)


def _write_outputs(out_dir: Path, model, export_model, reporter: MetricsReporter, total: int,
                   start_step: int, cfg: PretrainConfig, baseline: float) -> PretrainResult:
    encoder_path = save_keras_atomic(model.backbone, out_dir / "encoder.keras")
    export_path = save_keras_atomic(export_model, out_dir / "pretrain_model.keras")
    history_path = atomic_write_json(out_dir / "history.json", reporter.history)
    curve_path = plot_loss_curve(reporter.history, cfg.objective, out_dir / "loss_curve.png")
    final, totals = reporter.history[-1], reporter.totals
    return PretrainResult(
        steps=total, tokens_seen=int(totals["positions"]),
        real_tokens_seen=int(totals["real_tokens"]), scored_tokens=totals["scored_tokens"],
        tokens_per_s=reporter.tokens_per_s, real_tokens_per_s=reporter.real_tokens_per_s,
        empty_batches=int(reporter.totals["empty_batches"]), resumed_from_step=start_step,
        val_metrics={k: v for k, v in final.items() if k.startswith("val/")},
        unigram_baseline_loss=baseline, encoder_path=encoder_path, pretrain_model_path=export_path,
        history_path=history_path, loss_curve_path=curve_path,
        checkpoint_dir=out_dir / "checkpoints",
        detection_scored_tokens=totals.get("rtd_scored_tokens", 0.0),
    )
