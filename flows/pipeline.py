"""The pipeline flow: chain the stages, one MLflow parent run, one child run per executed stage."""

from __future__ import annotations

import contextlib
import logging
import socket
from pathlib import Path
from typing import Any, Literal

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows.executors import Executor, Sharding, open_fan_out
from flows.export import ExportFormat, run_export
from flows.lock import workdir_lock
from flows.predict import label_counts_markdown, run_predict
from flows.settings import RunSettings, changed_keys, read_settings, write_settings
from flows.tracking import (
    PipelineTracking,
    Tracker,
    TrackingUnavailable,
    default_tracking_uri,
    flatten,
)
from flows.versions import (
    LINEAGE_FILE,
    VERSIONS_DIR,
    commit_version,
    open_lineage,
    read_lineage,
)
from selfsup_model.config import DEFAULT_WORKDIR, CorpusFormat, PipelineConfig
from selfsup_model.errors import UserError
from selfsup_model.presets import build_config, deep_merge, parse_override, validate_config
from selfsup_model.pretraining.devices import join_processes, process_index
from selfsup_model.serving.scoring import write_predictions
from tasks import joined
from tasks.registry import STAGE_NAMES, select_stages, stage_tasks, stages_shaped_by
from tasks.stage import RunContext, StageResult
from tasks.stopping import stop_behind, stop_signals_noted, stopped, stopping

log = logging.getLogger("selfsup.pipeline")


def resolve_config(preset: str, config: PipelineConfig | None, overrides: list[str],
                   config_file: str | None = None) -> PipelineConfig:
    """A given config wins over the preset; the YAML file, then overrides, apply on top.
    "custom" labels a given config (e.g. a workdir's stored one) and needs one."""
    if config is None:
        if preset == "custom":
            raise UserError("preset 'custom' names a given config; pass config, or choose "
                            "tiny, demo or base")
        return build_config(preset, config_file, overrides)
    if config_file:
        raise UserError("pass either a config object or a config file, not both")
    data = config.model_dump(mode="json")
    for item in overrides:
        data = deep_merge(data, parse_override(item))
    return validate_config(data)


def run_pipeline(
    config: PipelineConfig,
    corpus: str = "pydocs",
    corpus_format: CorpusFormat = "auto",
    workdir: str = DEFAULT_WORKDIR,
    stages: list[str] | None = None,
    force: list[str] | tuple[str, ...] = (),
    preset: str = "custom",
    tracking: bool = True,
    sharding: Sharding | None = None,
    new_lineage: bool = False,
) -> list[StageResult]:
    """Visit `stages` in order under the workdir lock, tracked in one MLflow parent run;
    sharded stages send their shard tasks where `sharding` says (in this process by default).

    A grown corpus extends the workdir's last complete corpus version (`flows.versions`);
    `new_lineage` starts a new lineage instead (ingest, dedup and split rebuilt). A finished
    run records its version last."""
    sharding = sharding or Sharding()
    stages = stages or list(STAGE_NAMES)
    # Several training processes (Keras' launch variables) join before any JAX computation.
    processes = join_processes()
    if processes > 1 and process_index() > 0:
        return _follow(config, str(corpus), corpus_format, Path(workdir), force)
    unknown = [f for f in force if f not in STAGE_NAMES]
    if unknown:
        raise UserError(f"unknown stage(s) for --force: {', '.join(unknown)}; "
                        f"stages are: {', '.join(STAGE_NAMES)}")
    wd = Path(workdir)
    with workdir_lock(wd), open_fan_out(sharding) as fan_out, stop_signals_noted():
        _record_settings(wd, RunSettings(str(corpus), corpus_format, preset, config))
        lineage = open_lineage(wd, config, str(corpus), corpus_format, new_lineage)
        if new_lineage:
            force = [*force, "ingest", "dedup", "split"]
        tracker = parent = None
        if tracking:
            tracker = Tracker(default_tracking_uri(wd), config.experiment,
                              artifact_root=wd / "mlartifacts")
            if closed := tracker.close_abandoned(wd):
                log.info("MLflow: %d earlier run(s) on this workdir never finished (killed, or "
                         "their tracking server went away); marked FAILED", closed)
            parent = tracker.start_run(f"pipeline:{Path(str(corpus)).name}", {
                "selfsup.corpus": str(corpus), "selfsup.preset": preset,
                "selfsup.workdir": str(wd.resolve()), "selfsup.host": socket.gethostname(),
                "selfsup.objective": config.pretrain.objective, "selfsup.stages": ",".join(stages),
                "selfsup.executor": sharding.executor, "selfsup.shards": str(fan_out.shards),
                "mlflow.note.content": f"selfsup pipeline on `{corpus}` (preset `{preset}`); "
                                       "child runs hold each executed stage.",
            })
            tracker.log_params(parent, flatten("", config.model_dump(mode="json")))
        ctx = RunContext(workdir=wd, config=config, corpus=str(corpus), corpus_format=corpus_format,
                         force=frozenset(force), fan_out=fan_out, lineage=lineage.lineage,
                         previous=lineage.extends,
                         tracking=(PipelineTracking(tracker, parent, config.registered_model,
                                                    config.logged_model)
                                   if tracker else None))
        tasks = stage_tasks()
        results: list[StageResult] = []
        try:
            for name in stages:
                results.append(tasks[name](ctx))
            version = commit_version(wd, lineage)  # the version switch: the run's last write
        except BaseException as exc:
            halted = stopped(exc)
            if halted:
                stopping(exc)  # a second signal now stops at once
            if tracker:  # a stopped run is KILLED, as its stage in flight
                with contextlib.suppress(TrackingUnavailable):  # the first error is the one
                    tracker.end_run(parent, "KILLED" if halted else "FAILED")
            if (stop := stop_behind(exc)) is not None:
                raise stop from exc
            raise
        if tracker:
            if version is not None:  # the corpus lineage: a digest and counts per version
                tracker.set_tags(parent, {"selfsup.lineage": read_lineage(wd)["lineage"],
                                          "selfsup.corpus_version": str(version)})
                tracker.log_artifact(parent, wd / VERSIONS_DIR / LINEAGE_FILE, "corpus")
            tracker.end_run(parent, "FINISHED")
        joined.release()  # other training processes, if any, may exit
        return results


def _follow(config: PipelineConfig, corpus: str, corpus_format: CorpusFormat, workdir: Path,
            force: list[str] | tuple[str, ...]) -> list[StageResult]:
    """Training process k > 0 of a run: no lock, no tracking, no files. It joins process 0
    (the run itself) in the work they share, pretraining and the neural classifiers, taking
    its share of every batch, until the run ends (processes leave the group together)."""
    ctx = RunContext(workdir=workdir, config=config, corpus=corpus,
                     corpus_format=corpus_format, force=frozenset(force))
    done = joined.serve(ctx)
    log.info("process %d: the run is over; joined process 0 in %s", process_index(),
             ", ".join(done) or "nothing")
    return []


def _record_settings(workdir: Path, settings: RunSettings) -> None:
    """Store what this run uses; say which stages a change from the last run will rerun."""
    before = read_settings(workdir)
    if before is not None:
        changed = changed_keys(before, settings)
        if changed:
            shown = ", ".join(changed[:8]) + (f" and {len(changed) - 8} more"
                                              if len(changed) > 8 else "")
            rerun = stages_shaped_by(changed)
            log.info("settings differ from this workdir's last run (%s): %s will rerun", shown,
                     ", ".join(rerun) if rerun else "no stage")
    write_settings(workdir, settings)


@flow(name="selfsup-pipeline", persist_result=False, log_prints=True)
def pipeline_flow(
    corpus: str = "pydocs",
    corpus_format: CorpusFormat = "auto",
    workdir: str = DEFAULT_WORKDIR,
    preset: Literal["tiny", "demo", "base", "custom"] = "demo",
    config: PipelineConfig | None = None,
    overrides: list[str] | None = None,
    only: str | None = None,
    from_stage: str | None = None,
    to_stage: str | None = None,
    force: list[str] | None = None,
    tracking: bool = True,
    executor: Executor = "local",
    shards: int | None = None,
    workers: int | None = None,
    dask_address: str | None = None,
    new_lineage: bool = False,
) -> list[dict[str, Any]]:
    """Run the selfsup pipeline: ingest -> ... -> compare, skipping stages that are up to date.

    A corpus that grew since the workdir's last run makes its next version: only the new
    documents are deduplicated and placed, and no document changes split; new_lineage
    rebuilds from scratch instead (docs/operations.md "A corpus that grows").
    executor/shards/workers/dask_address choose where sharded stages run their shard tasks
    (`flows.executors`); they never change an output."""
    cfg = resolve_config(preset, config, overrides or [])
    sharding = Sharding(executor, shards, workers, dask_address)
    force = list(force or [])
    if from_stage:
        force.append(from_stage)
    results = run_pipeline(cfg, corpus, corpus_format, workdir,
                           select_stages(only, from_stage, to_stage), force, preset,
                           tracking=tracking, sharding=sharding, new_lineage=new_lineage)
    return [r.__dict__ for r in results]


@flow(name="selfsup-stage", persist_result=False, log_prints=True)
def stage_flow(
    stage: str,
    workdir: str = DEFAULT_WORKDIR,
    corpus: str = "pydocs",
    corpus_format: CorpusFormat = "auto",
    preset: Literal["tiny", "demo", "base", "custom"] = "demo",
    config: PipelineConfig | None = None,
    overrides: list[str] | None = None,
    executor: Executor = "local",
    shards: int | None = None,
    workers: int | None = None,
    dask_address: str | None = None,
) -> list[dict[str, Any]]:
    """Rerun one named stage (its inputs must already exist in the workdir)."""
    cfg = resolve_config(preset, config, overrides or [])
    results = run_pipeline(cfg, corpus, corpus_format, workdir, select_stages(only=stage),
                           [stage], preset,
                           sharding=Sharding(executor, shards, workers, dask_address))
    return [r.__dict__ for r in results]


@flow(name="selfsup-predict", persist_result=False, log_prints=True)
def predict_flow(source: str, out: str, workdir: str = DEFAULT_WORKDIR,
                 text_column: str | None = None, id_column: str | None = None,
                 batch_size: int = 256, engine: Literal["keras", "onnx"] = "keras") -> dict:
    """Score a folder or table of new documents with a finished run's classifier (through Keras
    or ONNX Runtime); write the predictions to `out` (.parquet/.jsonl/.csv; its folder is
    created) and a label-count summary artifact."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    outcome = run_predict(workdir, source, out, text_column=text_column, id_column=id_column,
                          batch_size=batch_size, engine=engine)
    if outcome.out is not None:
        rejects_path = outcome.out.with_name(outcome.out.stem + ".rejects.csv")
        if len(outcome.rejects):
            write_predictions(outcome.rejects, rejects_path)
        else:  # an earlier night's rejects must not pass for tonight's
            rejects_path.unlink(missing_ok=True)
    create_markdown_artifact(key="selfsup-predictions",
                             markdown=label_counts_markdown(outcome, source, workdir),
                             description="selfsup: label counts of a scoring run")
    return {"read": outcome.read, "scored": len(outcome.predictions),
            "rejected": len(outcome.rejects), "out": str(outcome.out),
            "labels": outcome.predictions["label"].value_counts().to_dict()}


@flow(name="selfsup-export", persist_result=False, log_prints=True)
def export_flow(out: str, export_format: ExportFormat = "hf",
                workdir: str = DEFAULT_WORKDIR) -> dict:
    """Publish a finished run's model: hf, the pretrained encoder and masked-LM head as a
    transformers checkpoint directory; onnx, the kept classifier as an ONNX model with its spec
    and tokenizer beside it. The run's files are checked against their manifests first."""
    summary = run_export(workdir, export_format, out)
    files = "\n".join(f"- `{f}`" for f in summary["files"])
    create_markdown_artifact(key="selfsup-export", description="selfsup: an exported model",
                             markdown=f"# selfsup export ({export_format})\n\n{summary['what']} "
                                      f"of `{workdir}` -> `{out}`, {summary['bytes']} bytes in "
                                      f"{summary['seconds']} s:\n\n{files}\n")
    return summary
