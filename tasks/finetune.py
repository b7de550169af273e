"""finetune: the pretrained encoder as a frozen-feature linear probe, fully fine-tuned and \
with staged unfreezing, at several label fractions; hands over the one best on validation."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from selfsup_model.config import FinetuneConfig
from selfsup_model.nn.saving import load_keras_model
from selfsup_model.serving.inference import (
    KeptCandidate,
    choose_kept,
    probe_classifier,
    write_bundle,
    write_no_classifier,
)
from selfsup_model.transfer.protocol import (
    MethodResults,
    NeuralMethod,
    frozen_probe,
    load_labelled,
    summary_metrics,
    train_neural_methods,
    write_method_results,
)
from tasks.joined import invite
from tasks.stage import RunContext, StageOutput


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    cfg = ctx.config.finetune
    data = load_labelled(ctx.stage_dir("encode"), cfg.max_len)
    if data is None:
        reason = "the corpus has fewer than two labels in the training split"
        files = write_method_results(out, MethodResults(), skipped=reason)
        return StageOutput(files + write_no_classifier(out, reason), {"skipped": 1, "runs": 0})
    pretrained = _pretrained(inputs["pretrain/encoder.keras"])
    largest = max(cfg.fractions)
    candidates = []
    results = MethodResults()
    if "probe" in cfg.modes:
        results, fit = frozen_probe("pretrained_probe", data, pretrained, cfg)
        if fit is not None:
            candidates.append(KeptCandidate(
                "pretrained_probe", largest, fit.val_macro_f1, {},
                lambda: probe_classifier(pretrained(), cfg.pooling, fit.model, fit.mean,
                                         fit.scale, data.classes)))
    invite("finetune")  # other training processes, if any, join in (`follow`)
    trained, kept = train_neural_methods(data, _methods(cfg, pretrained), cfg)
    results.extend(trained)
    for name, res in kept.items():
        candidates.append(KeptCandidate(name, largest, res.val_macro_f1, {},
                                        lambda res=res: res.model))
    files = write_method_results(out, results, classes=data.classes)
    settings = {s["method"]: {**s.get("params", {}), **s.get("selected", {})}
                for s in results.summaries if s["fraction"] == largest}
    candidates = [dataclasses.replace(c, selected=settings[c.method]) for c in candidates]
    counts = {**data.counts, "runs": len(results.summaries)}
    metrics = summary_metrics(results.summaries)
    if candidates:
        chosen = choose_kept(candidates)
        files += write_bundle(out, chosen, chosen.build(), inputs["tokenizer/tokenizer.json"],
                              data.classes, ctx.config.encode, cfg.max_len, cfg.pooling,
                              pretrained(), cfg.read_windows)
        ctx.log_classifier(out)  # an MLflow model of this stage's run, registered
        counts["kept_classifier"] = chosen.method
        metrics["kept_classifier/val_macro_f1"] = chosen.val_macro_f1
    else:
        files += write_no_classifier(out, "no method of the pretrained encoder ran")
    return StageOutput(files, counts, metrics)


def _pretrained(encoder_path: Path) -> Callable[[], object]:
    def load():  # a fresh copy per run: fine-tuning changes the weights it is given
        return load_keras_model(encoder_path)  # safe_mode=True

    return load


def _methods(cfg: FinetuneConfig, pretrained: Callable[[], object]) -> list[NeuralMethod]:
    return [NeuralMethod(f"pretrained_{mode}", mode, pretrained) for mode in cfg.modes
            if mode != "probe"]


def follow(ctx: RunContext) -> None:
    """A training process other than 0, invited by process 0: train the pretrained encoder's
    neural methods with it (a shared workdir), writing nothing."""
    cfg = ctx.config.finetune
    data = load_labelled(ctx.stage_dir("encode"), cfg.max_len)
    assert data is not None  # process 0 invites only when there is something to classify
    train_neural_methods(data, _methods(cfg, _pretrained(ctx.artifact("pretrain/encoder.keras"))),
                         cfg)
