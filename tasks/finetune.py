"""finetune: the pretrained encoder as a frozen-feature linear probe, fully fine-tuned and \
with staged unfreezing, at several label fractions."""

from __future__ import annotations

from pathlib import Path

from selfsup_model.artifacts import save_keras_atomic
from selfsup_model.saving import load_keras_model
from selfsup_model.transfer import (
    MethodResults,
    NeuralMethod,
    frozen_probe,
    load_labelled,
    summary_metrics,
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

    def pretrained():  # a fresh copy per run: fine-tuning changes the weights it is given
        return load_keras_model(encoder_path)  # safe_mode=True

    results = frozen_probe("pretrained_probe", data, pretrained, cfg) if "probe" in cfg.modes \
        else MethodResults()
    methods = [NeuralMethod(f"pretrained_{mode}", mode, pretrained) for mode in cfg.modes
               if mode != "probe"]
    trained, kept = train_neural_methods(data, methods, cfg)
    results.extend(trained)
    files = write_method_results(out, results, classes=data.classes)
    if kept:
        # The fine-tuned classifier this stage hands over: the best on validation at the
        # largest label fraction (the linear probe has no Keras model to hand over).
        best = max(kept.values(), key=lambda result: result.val_macro_f1)
        save_keras_atomic(best.model, out / "classifier.keras")
        files.append("classifier.keras")
    return StageOutput(files, {**data.counts, "runs": len(results.summaries)},
                       summary_metrics(results.summaries))
