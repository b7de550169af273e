"""finetune: the pretrained encoder + a new head, probe and full modes, at several label \
fractions."""

from __future__ import annotations

from pathlib import Path

from selfsup_model.artifacts import save_keras_atomic
from selfsup_model.saving import load_keras_model
from selfsup_model.transfer import (
    MethodResults,
    NeuralMethod,
    load_labelled,
    result_key,
    train_neural_methods,
    write_method_results,
)
from tasks.stage import RunContext, StageOutput


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    cfg = ctx.config.finetune
    data = load_labelled(ctx.stage_dir("encode"), cfg.max_len)
    if data is None:
        reason = "the corpus has fewer than two labels in the training split"
        return StageOutput(write_method_results(out, MethodResults(), skipped=reason),
                           {"skipped": 1, "runs": 0})
    encoder_path = inputs["pretrain/encoder.keras"]

    def pretrained():  # a fresh copy per run: full fine-tuning changes the weights it is given
        return load_keras_model(encoder_path)  # safe_mode=True

    methods = [NeuralMethod(f"pretrained_{mode}", mode, pretrained, cfg) for mode in cfg.modes]
    results, last = train_neural_methods(data, methods, cfg)
    files = write_method_results(out, results, classes=data.classes)
    # The classifier kept is the last one trained: the last configured mode at the largest fraction.
    save_keras_atomic(last.model, out / "classifier.keras")
    files.append("classifier.keras")
    return StageOutput(files, {**data.counts, "runs": len(results.summaries)},
                       {result_key(s["method"], s["fraction"], "val_macro_f1"): s["val_macro_f1"]
                        for s in results.summaries})

