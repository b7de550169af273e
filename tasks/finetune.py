"""finetune: the pretrained encoder + a new head, probe and full modes, at several label fractions."""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE

from selfsup_model.artifacts import atomic_write_json
from selfsup_model.classify import stratified_subset, train_classifier
from selfsup_model.model import load_keras_model
from selfsup_model.pretrain_callbacks import save_keras_atomic
from selfsup_model.report import PREDICTION_COLUMNS
from tasks.io import write_parquet
from tasks.labelled import ENCODED_INPUTS, LabelledData, load_labelled, prediction_rows, result_key
from tasks.stage import RunContext, StageOutput, StageResult, StageSpec, run_stage

log = logging.getLogger("selfsup.finetune")
SPEC = StageSpec("finetune", inputs=("pretrain/encoder.keras", *ENCODED_INPUTS), sections=("finetune",))


def train_at_fractions(data: LabelledData, cfg, methods: dict[str, tuple[str, object]]):
    """Train every method at every label fraction on identical subsets; yield (method, fraction, result)."""
    train = data.splits["train"]
    y_train, y_val = data.y("train"), data.y("val")
    val_known = y_val >= 0  # selection can only score labels the model can predict
    val = (data.splits["val"].windows[val_known], y_val[val_known])
    for fraction in cfg.fractions:
        subset = stratified_subset(train.labels, fraction, cfg.seed)
        for method, (mode, factory) in methods.items():
            log.info("%s at label fraction %g: %d training documents", method, fraction, len(subset))
            result = train_classifier(factory, (train.windows[subset], y_train[subset]), val,
                                      len(data.classes), mode, cfg, cfg.seed,
                                      eval_sets={"test": data.splits["test"].windows})
            yield method, fraction, len(subset), result


def summary(method: str, fraction: float, n_train: int, result) -> dict:
    return {"method": method, "fraction": float(fraction), "n_train": n_train,
            "val_macro_f1": result.val_macro_f1, "best_epoch": result.best_epoch,
            "epochs_run": result.epochs_run, "train_time_s": round(result.train_time_s, 3)}


def write_skipped(out: Path, reason: str) -> StageOutput:
    log.warning("%s skipped: %s", out.name, reason)
    files = [write_parquet(pd.DataFrame(columns=list(PREDICTION_COLUMNS)), out / "predictions.parquet"),
             atomic_write_json(out / "results.json", {"skipped": reason, "results": []}).name]
    return StageOutput(files, {"skipped": 1, "runs": 0})


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    data = load_labelled(inputs, ctx.config.finetune.max_len)
    if data is None:
        return write_skipped(out, "the corpus has fewer than two labels in the training split")
    encoder_path = inputs["pretrain/encoder.keras"]

    def pretrained():  # a fresh copy per run: full fine-tuning changes the weights it is given
        return load_keras_model(encoder_path)  # safe_mode=True, our layers registered

    methods = {f"pretrained_{mode}": (mode, pretrained) for mode in ctx.config.finetune.modes}
    rows, summaries, last = [], [], None
    for method, fraction, n_train, result in train_at_fractions(data, ctx.config.finetune, methods):
        rows += prediction_rows(method, fraction, data.splits["test"], result.predictions["test"], data.classes)
        summaries.append(summary(method, fraction, n_train, result))
        last = result
    files = [write_parquet(pd.DataFrame(rows, columns=list(PREDICTION_COLUMNS)), out / "predictions.parquet"),
             atomic_write_json(out / "results.json", {"classes": data.classes, "results": summaries}).name]
    # The classifier kept is the last one trained: the last configured mode at the largest fraction.
    save_keras_atomic(last.model, out / "classifier.keras")
    files.append("classifier.keras")
    return StageOutput(files, {**data.counts, "runs": len(summaries)},
                       {result_key(s["method"], s["fraction"], "val_macro_f1"): s["val_macro_f1"] for s in summaries})


@task(name="finetune", cache_policy=NO_CACHE, persist_result=False)
def finetune_task(ctx: RunContext) -> StageResult:
    """Fine-tune the pretrained encoder for classification (probe and full) at each label fraction."""
    return run_stage(SPEC, ctx, compute)
