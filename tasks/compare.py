"""compare: every method x label fraction on the same test split -> report.md/json, \
predictions, plots."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pandas as pd
from prefect.artifacts import create_markdown_artifact
from prefect.context import TaskRunContext

from selfsup_model.artifacts import (
    MANIFEST_NAME,
    StageManifest,
    atomic_path,
    atomic_write_json,
    atomic_write_parquet,
    atomic_write_text,
    read_manifest,
)
from selfsup_model.config import PipelineConfig
from selfsup_model.report.comparison import (
    edge_sentence,
    grid_edges,
    narrow_grids,
    narrow_sentence,
    recompute_results,
    result_key,
    write_report,
)
from selfsup_model.report.effects import effect_sentence, pretraining_effects, seed_spread
from selfsup_model.report.ensemble import (
    PROBABILITIES_FILE,
    TFIDF_METHOD,
    ensemble_rows,
    merge_probabilities,
)
from selfsup_model.report.plots import plot_versions
from selfsup_model.report.versions import KEY_METHODS, series, version_record, versions_markdown
from selfsup_model.report.versions import PLOT as VERSIONS_PLOT
from selfsup_model.text.masking import load_arrays
from selfsup_model.transfer.sentence_embeddings import SENTENCE_METHOD
from tasks.stage import RunContext, StageOutput
from tasks.versions import RECORD_FILE, earlier_versions, snapshot_file

log = logging.getLogger("selfsup.compare")


def _training_summaries(inputs: dict[str, Path]) -> dict[tuple[str, float], dict]:
    out = {}
    for stage in ("finetune", "baseline"):
        for s in json.loads(inputs[f"{stage}/results.json"].read_text())["results"]:
            out[(s["method"], float(s["fraction"]))] = s
    return out


def _ensemble(inputs: dict[str, Path], trained: dict[tuple[str, float], dict],
              predictions: pd.DataFrame, weights: tuple[float, ...],
              ) -> tuple[pd.DataFrame, list[dict]]:
    """The ensemble row's test rows and summaries (`report.ensemble`); none without weights."""
    if not weights:
        return predictions.iloc[:0], []
    arrays = merge_probabilities({stage: load_arrays(inputs[f"{stage}/{PROBABILITIES_FILE}"])
                                  for stage in ("finetune", "baseline")})
    rows, summaries = ensemble_rows(list(trained.values()), predictions, arrays, weights)
    for s in summaries:
        log.info("ensemble at label fraction %g: %s x %g + %s x %g, validation macro-F1 %.4f",
                 s["fraction"], s["selected"]["pretrained_member"], s["selected"]["weight"],
                 TFIDF_METHOD, 1 - s["selected"]["weight"], s["val_macro_f1"])
    return rows, summaries


def kept_classifier(spec_path: Path) -> dict | None:
    """What finetune kept (method, fraction, val_macro_f1, selected, why), or None."""
    spec = json.loads(spec_path.read_text("utf-8"))
    return spec.get("kept")


def report_context(ctx: RunContext, inputs: dict[str, Path], n_test: int) -> dict:
    """The numbers a reader needs beside the table: corpus, pretraining, audit, methods not run."""
    unavailable = json.loads(inputs["baseline/results.json"].read_text()).get("unavailable", {})
    pre, enc = (StageManifest.read(inputs[f"{stage}/{MANIFEST_NAME}"])
                for stage in ("pretrain", "encode"))
    audit = json.loads(inputs["split/audit.json"].read_text())["audit"]
    return {
        "test documents": n_test,
        "pretraining corpus (train split)": (
            f"{enc.counts['splits']['train']['kept_docs']} documents, "
            f"{enc.counts['splits']['train']['sequences']} windows"),
        "pretraining": f"{pre.counts['steps']} steps, {pre.counts['tokens_seen']} input tokens, "
                       f"{pre.counts['scored_tokens']} scored tokens "
                       + (f"(rtd: the generator's; the discriminator scored "
                          f"{pre.counts['detection_scored_tokens']})"
                          if "detection_scored_tokens" in pre.counts
                          else f"({ctx.config.pretrain.objective})"),
        "encoder started from": pre.counts.get("initialised_from", "random initialisation"),
        "fine-tuning protocol": _protocol(ctx.config.finetune),
        "final validation loss": {k: round(v, 4) for k, v in pre.metrics.items()
                                  if k.startswith("val/")},
        "leakage audit": "passed (no near-duplicates or groups across splits)"
                         if audit.get("passed") else f"FAILED: {audit.get('message')}",
        **_source_check(StageManifest.read(inputs[f"tokenizer/{MANIFEST_NAME}"]).counts),
        "what each method reads": _reads(ctx.config),
        **{f"not run: {method}": reason for method, reason in sorted(unavailable.items())},
    }


def _source_check(tokenizer_counts: dict) -> dict[str, str]:
    """The continued-pretraining leak check's line (none for a run that started from scratch)."""
    if "source_audit_passed" not in tokenizer_counts:  # no encoder continued (or the
        return {}  # tokenizer was only kept through a corpus lineage)
    c = tokenizer_counts
    found = (f"{c['source_documents_checked']} val/test documents against the "
             f"{c['source_train_documents']} documents the continued encoder's lineage "
             "pretrained on")
    return {"continued-pretraining leak check":
            f"passed ({found}: no near-copies)" if c["source_audit_passed"] else
            f"FAILED ({found}): {c['source_leaking_documents']} leaking document(s) or an "
            "unreadable lineage; see tokenizer/source_audit.json"}


def stage_seconds(inputs: dict[str, Path]) -> dict[str, float]:
    """Wall time of every stage before compare, in pipeline order, from their manifests (the
    run that wrote each stage's current outputs; a skipped stage keeps its earlier time)."""
    return {key.split("/")[0]: StageManifest.read(path).duration_s
            for key, path in inputs.items() if key.endswith(f"/{MANIFEST_NAME}")}


def time_split(seconds: dict[str, float]) -> str:
    """'pretrain 322 s (55%), finetune 120 s (20%), ...' over the stages' total."""
    total = sum(seconds.values()) or 1.0
    parts = [f"{stage} {s:.0f} s ({s / total:.0%})" for stage, s in seconds.items()]
    return f"{', '.join(parts)}; {total:.0f} s in all"


def _reads(config: PipelineConfig) -> str:
    tokens = config.finetune.max_len or config.encode.max_len
    how = ("every window of a document: each trains with the document's label, and a "
           "document's prediction is the class of highest mean probability over its windows"
           if config.finetune.read_windows == "all" else "each document's first window")
    return (f"neural methods and the linear probe: windows of up to {tokens} tokens, "
            f"{how}. TF-IDF and sentence embeddings: the document text (the sentence model "
            "truncates at its own limit)")


def _protocol(cfg) -> str:
    decays = (f" x layer-wise decays {list(cfg.layer_decays)}" if len(cfg.layer_decays) > 1
              else "")
    return (f"every neural method: peak learning rates {list(cfg.learning_rates)}{decays} "
            f"(chosen on validation), the updates of {cfg.epochs} passes over the subset's "
            f"documents clipped to [{cfg.min_updates}, {cfg.max_updates}], {cfg.warmup_fraction:g} "
            f"warmup then linear decay, early stopping after {cfg.patience} of {cfg.evals} "
            f"validation checks without gain, the grid on seed {cfg.seeds[0]}"
            + (f" and the chosen rate repeated with training seeds {list(cfg.seeds[1:])} up "
               f"to fraction {cfg.repeat_seeds_up_to:g}" if len(cfg.seeds) > 1 else "")
            + f"; linear probe: C in {list(cfg.probe_c)} on standardised frozen features")


def searched_grids(config: PipelineConfig) -> dict[str, dict[str, tuple[float, ...]]]:
    """What each method's selection searched, by method ("*": every neural method)."""
    return {"*": {"learning_rate": config.finetune.learning_rates,
                  "layer_decay": config.finetune.layer_decays},
            "pretrained_probe": {"C": config.finetune.probe_c},
            "tfidf_logreg": {"C": config.baseline.tfidf_c,
                             "ngram_max": config.baseline.tfidf_ngram_max},
            SENTENCE_METHOD: {"C": config.baseline.sentence_c}}


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    predictions = pd.concat([pd.read_parquet(inputs["finetune/predictions.parquet"]),
                             pd.read_parquet(inputs["baseline/predictions.parquet"])],
                            ignore_index=True)
    if predictions.empty:
        log.warning("compare skipped: no method produced predictions "
                    "(the corpus has no usable labels)")
        atomic_write_text(out / "report.md",
                          "# selfsup comparison\n\nSkipped: the corpus has no usable labels.\n")
        return StageOutput(["report.md"], {"skipped": 1, "results": 0})
    cfg = ctx.config.compare
    trained = _training_summaries(inputs)
    ensemble, ensemble_summaries = _ensemble(inputs, trained, predictions, cfg.ensemble_weights)
    if not ensemble.empty:
        predictions = pd.concat([predictions, ensemble], ignore_index=True)
    trained.update({(s["method"], s["fraction"]): s for s in ensemble_summaries})
    results = recompute_results(predictions, cfg.bootstrap, cfg.seed)
    spread = seed_spread(pd.concat([pd.read_parquet(inputs[f"{stage}/seed_predictions.parquet"])
                                    for stage in ("finetune", "baseline")], ignore_index=True))
    for r in results:
        key = (r["method"], r["fraction"])
        extra = trained.get(key, {})
        r.update({k: extra[k] for k in ("val_macro_f1", "train_time_s", "n_train",
                                        "n_train_windows") if k in extra})
        if "selected" in extra or "params" in extra:  # neural: rate and seed; linear: C (n-grams)
            r["selected"] = extra.get("selected", extra.get("params"))
        if "searched" in extra:  # the values a widened search tried (C)
            r["searched"] = extra["searched"]
        if key in spread:
            r["test_macro_f1_seeds"] = spread[key]
    effects = pretraining_effects(results, predictions, cfg.bootstrap, cfg.seed)
    for effect in effects:
        log.info("%s", effect_sentence(effect))
    n_test = predictions.groupby(["method", "fraction"]).size().max()
    kept = kept_classifier(inputs["finetune/classifier.json"])
    context = report_context(ctx, inputs, int(n_test))
    seconds = stage_seconds(inputs)
    context["stage wall time"] = time_split(seconds)
    if kept is not None:
        context["classifier handed over"] = (
            f"{kept['method']} at label fraction {kept['fraction']:g} "
            f"(validation macro-F1 {kept['val_macro_f1']:.3f}; {kept['why']})")
    grids = searched_grids(ctx.config)
    edges, narrow = grid_edges(results, grids), narrow_grids(results, grids)
    for grid in narrow:
        log.info("%s", narrow_sentence(grid))
    for edge in edges:
        log.warning("selected at the edge of its grid: %s", edge_sentence(edge))
    records, frozen = _versions(ctx, inputs, predictions, out)
    plotted = len(records) > 1
    if plotted:
        plot_versions(records, [m for m in KEY_METHODS
                                if any(m in r["macro_f1"]["first_test"] for r in records)],
                      out / VERSIONS_PLOT)
    files = write_report(out, results, context, predictions, effects, kept, edges, narrow,
                         sections=[versions_markdown(records, frozen, plotted)])
    files += [RECORD_FILE, *([VERSIONS_PLOT] if plotted else [])]
    files.append(atomic_write_parquet(out / "predictions.parquet", predictions).name)
    with atomic_path(out / "pretrain_loss_curve.png") as tmp:
        shutil.copyfile(inputs["pretrain/loss_curve.png"], tmp)
    files.append("pretrain_loss_curve.png")
    _publish(ctx, out, [f for f in files if f.endswith((".md", ".json", ".png"))])
    best = max(results, key=lambda r: (r["test_macro_f1"], r["method"]))
    counts = {"results": len(results), "methods": predictions["method"].nunique(),
              "n_test": int(n_test)}
    metrics = {result_key(r["method"], r["fraction"], "test_macro_f1"): r["test_macro_f1"]
               for r in results}
    metrics["best_test_macro_f1"] = best["test_macro_f1"]
    for e in effects:
        name = f"pretrained_minus_{e['reference']}/fraction_{e['fraction']:g}/test_macro_f1"
        metrics.update({name: e["test_macro_f1_difference"], f"{name}_ci_low": e["ci"][0],
                        f"{name}_ci_high": e["ci"][1]})
    total = sum(seconds.values()) or 1.0
    metrics.update({f"time/{stage}_s": s for stage, s in seconds.items()})
    metrics["time/pretrain_share"] = seconds.get("pretrain", 0.0) / total
    ctx.publish_metrics(metrics)
    for version, across in series(records).items():  # a chart over versions in MLflow
        ctx.publish_metrics(across, step=version)
    return StageOutput(files, counts, metrics,
                       log_artifacts=[f for f in files if not f.endswith(".parquet")])


def _versions(ctx: RunContext, inputs: dict[str, Path], predictions: pd.DataFrame,
              out: Path) -> tuple[list[dict], list[dict]]:
    """The records of the lineage's versions so far, this one's last (written to RECORD_FILE),
    and this version's results on the lineage's first test set."""
    earlier = earlier_versions(ctx)
    records = [json.loads(snapshot_file(s, "compare", RECORD_FILE).read_text("utf-8"))
               for s in earlier if RECORD_FILE in getattr(read_manifest(s / "compare"),
                                                          "outputs", {})]
    first_test = None
    if earlier:
        first = pd.read_parquet(snapshot_file(earlier[0], "split", "assignments.parquet"),
                                columns=["id", "split"])
        first_test = set(first.loc[first["split"] == "test", "id"])
    ingest, split, pre = (StageManifest.read(inputs[f"{stage}/{MANIFEST_NAME}"])
                          for stage in ("ingest", "split", "pretrain"))
    sizes = split.counts.get("docs_per_split", {})
    how = (f"continues v{pre.counts['continued_version']}" if "continued_version" in pre.counts
           else "from scratch" if pre.counts.get("initialised_from", "").startswith("random")
           else "continues init_from")
    about = {"documents": ingest.counts.get("kept"),
             "split_sizes": " / ".join(str(sizes.get(s, 0)) for s in ("train", "val", "test")),
             "pretraining": f"{how}, {pre.counts['steps']} steps",
             "val_loss": pre.metrics.get(f"val/{ctx.config.pretrain.objective}_loss")}
    cfg = ctx.config.compare
    record, frozen = version_record(len(earlier) + 1,
                                    earlier[0].parent.name if earlier else ctx.lineage or "",
                                    predictions, first_test, cfg.bootstrap, cfg.seed, about)
    atomic_write_json(out / RECORD_FILE, record)
    return [*records, record], frozen


def _publish(ctx: RunContext, out: Path, files: list[str]) -> None:
    """The report on the tracked pipeline run and as a Prefect markdown artifact."""
    ctx.publish([out / name for name in files], "report")
    # called outside Prefect (plain function): nowhere to attach
    if TaskRunContext.get() is not None:
        create_markdown_artifact(
            key="selfsup-comparison", markdown=(out / "report.md").read_text(),
            description="selfsup: test metrics of every method x label fraction")

