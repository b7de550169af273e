"""The stage runner: skip what is up to date, rerun what changed, write the manifest last.

A stage is up to date when its manifest exists, was written by this code
version, records the same parameters and the same input hashes as now, and
every output it records still has the recorded size and sha256. Anything else
reruns it. Before running, the old manifest is removed, so a stage killed
half-way is never trusted by a later run.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Protocol

from selfsup_model import __version__
from selfsup_model.artifacts import (
    MANIFEST_NAME,
    StageManifest,
    cached_sha256,
    read_manifest,
    record_outputs,
    remove_temporaries,
    verify_outputs,
)
from selfsup_model.config import PipelineConfig
from selfsup_model.corpus.sharding import FanOut, InProcess
from selfsup_model.errors import ArtifactError
from tasks.stopping import stop_behind, stopped, stopping

log = logging.getLogger("selfsup.stage")
IN_PROCESS = InProcess()

Status = Literal["up-to-date", "stale", "missing", "blocked"]
LogFn = Callable[[dict[str, float], int], None]


class StageTracking(Protocol):
    """Where the runner reports stages; the flow hands in an MLflow-backed one (`flows.tracking`).

    A stage that runs gets its own tracked run (a handle the runner passes back);
    a skipped stage is only noted. `publish` attaches files to the pipeline run
    as a whole (the comparison report).
    """

    def stage_started(self, stage: str, params: dict[str, Any], reason: str) -> str: ...

    def stage_failed(self, run: str, status: str = "FAILED") -> None: ...

    def stage_finished(self, run: str, manifest: StageManifest, manifest_path: Path,
                       artifacts: list[Path]) -> None: ...

    def stage_skipped(self, manifest: StageManifest) -> None: ...

    def metric_logger(self, run: str) -> LogFn: ...

    def publish(self, paths: list[Path], folder: str) -> None: ...

    def publish_metrics(self, metrics: dict[str, float], step: int = 0) -> None: ...

    def log_classifier(self, run: str, bundle_dir: Path) -> None: ...


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """What a stage reads and which configuration sections shape its output."""

    name: str
    inputs: tuple[str, ...]  # "stage/file" artifact keys
    sections: tuple[str, ...]  # PipelineConfig sections fingerprinted into params
    version: int = 1  # bump when the stage's output format or semantics change
    # e.g. the corpus fingerprint
    extra_params: Callable[[RunContext], dict[str, Any]] | None = None
    manifests: tuple[str, ...] = ()  # stages whose manifest (counts, metrics) this stage reads

    @property
    def upstream(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(key.split("/", 1)[0] for key in self.inputs))


@dataclasses.dataclass(frozen=True)
class RunContext:
    """Everything a stage needs to know about the run it is part of."""

    workdir: Path
    config: PipelineConfig
    corpus: str = "pydocs"
    corpus_format: str = "auto"
    force: frozenset[str] = frozenset()
    tracking: StageTracking | None = None
    stage_run: str | None = None  # the tracked run of the stage being computed
    # where sharded stages run their shard tasks; not a parameter of any output
    fan_out: FanOut = IN_PROCESS
    # the corpus lineage (`flows.versions`) and the snapshot of the version whose corpus this
    # run's extends (None: a first version, or a new lineage)
    lineage: str | None = None
    previous: Path | None = None

    def metric_logger(self) -> LogFn | None:
        """Per-step metric logging into the current stage's run, or None when untracked."""
        if self.tracking is None or self.stage_run is None:
            return None
        return self.tracking.metric_logger(self.stage_run)

    def publish(self, paths: list[Path], folder: str) -> None:
        """Attach files to the pipeline's tracked run (nothing happens when untracked)."""
        if self.tracking is not None:
            self.tracking.publish(paths, folder)

    def publish_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        """Log headline numbers on the pipeline's tracked run at `step` (nothing happens when
        untracked)."""
        if self.tracking is not None:
            self.tracking.publish_metrics(metrics, step)

    def log_classifier(self, bundle_dir: Path) -> None:
        """Log the classifier bundle in `bundle_dir` as a model of the current stage's run (and
        register it); nothing happens when untracked."""
        if self.tracking is not None and self.stage_run is not None:
            self.tracking.log_classifier(self.stage_run, bundle_dir)

    def stage_dir(self, stage: str) -> Path:
        return self.workdir / stage

    def artifact(self, key: str) -> Path:
        stage, name = key.split("/", 1)
        return self.stage_dir(stage) / name


@dataclasses.dataclass(frozen=True)
class StageOutput:
    """What a stage's compute function returns: files it wrote (relative names) and its numbers."""

    files: list[str]
    counts: dict[str, Any]
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    log_artifacts: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class StageResult:
    """The small, JSON-able value a task returns to the flow."""

    stage: str
    status: Literal["ran", "skipped"]
    stage_dir: str
    counts: dict[str, Any]
    metrics: dict[str, Any]
    duration_s: float
    reason: str


Compute = Callable[[RunContext, Path, dict[str, Path]], StageOutput]

def _canonical(obj: Any) -> Any:
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def stage_params(spec: StageSpec, ctx: RunContext) -> dict[str, Any]:
    params = {s: getattr(ctx.config, s).model_dump(mode="json") for s in spec.sections}
    if spec.extra_params is not None:
        params.update(spec.extra_params(ctx))
    return _canonical(params)


def resolve_inputs(spec: StageSpec, ctx: RunContext) -> dict[str, str]:
    """sha256 of each input, checked against the manifest of the stage that wrote it."""
    hashes = {}
    for key in spec.inputs:
        stage, name = key.split("/", 1)
        manifest = read_manifest(ctx.stage_dir(stage))
        if manifest is None:
            raise ArtifactError(f"stage {spec.name!r} needs {key}, but stage {stage!r} has not "
                                "completed; run it first")
        record = manifest.outputs.get(name)
        if record is None:
            raise ArtifactError(f"stage {stage!r} did not write {name!r}, which stage "
                                f"{spec.name!r} needs; rerun {stage!r}")
        path = ctx.artifact(key)
        if not path.is_file() or cached_sha256(path) != record.sha256:
            raise ArtifactError(
                f"{path} no longer matches the hash its stage recorded (changed or deleted); "
                f"rerun with --force {stage}"
            )
        hashes[key] = record.sha256
    for stage in spec.manifests:
        path = ctx.stage_dir(stage) / MANIFEST_NAME
        if read_manifest(ctx.stage_dir(stage)) is None:
            raise ArtifactError(f"stage {spec.name!r} reads the manifest of {stage!r}, which has "
                                "not completed; run it first")
        hashes[f"{stage}/{MANIFEST_NAME}"] = cached_sha256(path)
    return hashes


def code_version(spec: StageSpec) -> str:
    return f"{__version__}+{spec.name}.v{spec.version}"


def check_stage(spec: StageSpec, ctx: RunContext,
                params: dict[str, Any] | None = None) -> tuple[Status, str]:
    """(status, why) without running anything."""
    params = stage_params(spec, ctx) if params is None else params
    try:
        inputs = resolve_inputs(spec, ctx)
    except ArtifactError as exc:
        return "blocked", str(exc)
    manifest = read_manifest(ctx.stage_dir(spec.name))
    if manifest is None:
        return "missing", "no valid manifest"
    if manifest.code_version != code_version(spec):
        return "stale", f"code version {manifest.code_version} -> {code_version(spec)}"
    if manifest.params != params:
        changed = sorted(k for k in set(params) | set(manifest.params)
                         if params.get(k) != manifest.params.get(k))
        return "stale", f"parameters changed: {', '.join(changed)}"
    if manifest.inputs != inputs:
        changed = sorted(k for k in set(inputs) | set(manifest.inputs)
                         if inputs.get(k) != manifest.inputs.get(k))
        return "stale", f"inputs changed: {', '.join(changed)}"
    modified = verify_outputs(ctx.stage_dir(spec.name), manifest, hasher=cached_sha256)
    if modified:
        return "stale", f"output {modified[0]} is missing or was modified"
    return "up-to-date", "manifest matches inputs and parameters"


def run_stage(spec: StageSpec, ctx: RunContext, load: Callable[[], Compute]) -> StageResult:
    """Run one stage unless it is up to date (or forced); write its manifest last. `load`
    gives the stage's compute function, and is called only if the stage runs."""
    params = stage_params(spec, ctx)
    status, why = check_stage(spec, ctx, params)
    stage_dir = ctx.stage_dir(spec.name)
    if status == "blocked":
        raise ArtifactError(why)
    if status == "up-to-date" and spec.name not in ctx.force:
        manifest = read_manifest(stage_dir)
        log.info("%s: up to date, skipped", spec.name)
        if ctx.tracking is not None:
            ctx.tracking.stage_skipped(manifest)
        return StageResult(spec.name, "skipped", str(stage_dir), manifest.counts, manifest.metrics,
                           0.0, why)
    reason = "forced" if status == "up-to-date" else why
    log.info("%s: running (%s)", spec.name, reason)
    inputs = resolve_inputs(spec, ctx)
    stage_dir.mkdir(parents=True, exist_ok=True)
    # a half-finished stage must never look done
    (stage_dir / MANIFEST_NAME).unlink(missing_ok=True)
    if stale := remove_temporaries(stage_dir):  # a killed attempt's half-written files
        log.info("%s: removed %d temporary file(s) a stopped attempt left", spec.name, len(stale))
    fault_timer(spec.name)
    started = dt.datetime.now(dt.UTC)
    run = (ctx.tracking.stage_started(spec.name, params, reason)
           if ctx.tracking is not None else None)
    try:
        compute = load()  # the first Keras stage loads TensorFlow: seconds, not the stage's own
        t0 = time.perf_counter()
        out = compute(dataclasses.replace(ctx, stage_run=run), stage_dir,
                      {k: ctx.artifact(k)
                       for k in (*spec.inputs, *(f"{m}/{MANIFEST_NAME}" for m in spec.manifests))})
    except BaseException as exc:
        halted = stopped(exc)
        if halted:
            stopping(exc)  # a second signal now stops at once
        if ctx.tracking is not None:
            ctx.tracking.stage_failed(run, "KILLED" if halted else "FAILED")
        if (stop := stop_behind(exc)) is not None:
            log.warning("%s: stopped (the stop came out as %s: %s)", spec.name,
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            raise stop from exc
        raise
    duration = time.perf_counter() - t0
    fault_point(spec.name)
    manifest = StageManifest(
        stage=spec.name, code_version=code_version(spec), params=params, inputs=inputs,
        outputs=record_outputs(stage_dir, out.files), counts=_canonical(out.counts),
        metrics=_canonical(out.metrics), started_at=started.isoformat(),
        finished_at=dt.datetime.now(dt.UTC).isoformat(), duration_s=round(duration, 3),
    )
    manifest_path = manifest.write(stage_dir)
    if ctx.tracking is not None:
        ctx.tracking.stage_finished(run, manifest, manifest_path,
                                    [stage_dir / a for a in out.log_artifacts])
    log.info("%s: done in %.1fs %s", spec.name, duration, json.dumps(out.counts, default=str)[:400])
    return StageResult(spec.name, "ran", str(stage_dir), manifest.counts, manifest.metrics,
                       duration, reason)


def fault_point(where: str) -> None:
    """Fault injection for the reliability tests: SELFSUP_FAULT_KILL=<where> SIGKILLs this
    process there: a stage's name, after the stage wrote its outputs and before its manifest (the
    worst moment to die); "version-switch", after a corpus version's snapshot and before the
    switch to it."""
    if os.environ.get("SELFSUP_FAULT_KILL") == where:
        os.kill(os.getpid(), signal.SIGKILL)


def fault_timer(stage: str) -> None:
    """Fault injection for the chaos test: SELFSUP_FAULT_KILL_AFTER=<stage>:<seconds> SIGKILLs
    this process that many seconds after `stage` starts running, wherever the run is by then."""
    name, _, seconds = os.environ.get("SELFSUP_FAULT_KILL_AFTER", "").partition(":")
    if name == stage:
        timer = threading.Timer(float(seconds), os.kill, (os.getpid(), signal.SIGKILL))
        timer.daemon = True
        timer.start()


def progress_logger(log: logging.Logger, what: str,
                    every_s: float = 5.0) -> Callable[[int, int], None]:
    """A `progress(done, total)` callback for long library loops; logs at most every `every_s`
    seconds."""
    last = [0.0]

    def _progress(done: int, total: int) -> None:
        now = time.monotonic()
        if done >= total or now - last[0] >= every_s:
            last[0] = now
            log.info("%s: %d/%d (%.0f%%)", what, done, total, 100.0 * done / max(total, 1))

    return _progress
