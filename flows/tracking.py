"""MLflow tracking with explicit run ids: one parent run per pipeline run, one child per
executed stage.

Nothing here relies on MLflow's thread-local "active run": every call names its
run id, so Prefect's task threads and a resumed run cannot log to the wrong place.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import socket
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import requests
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

from selfsup_model.artifacts import StageManifest
from selfsup_model.config import SPLITS
from selfsup_model.errors import UserError

log = logging.getLogger("selfsup.tracking")

_PARAM_MAX = 6000
_BATCH = 900  # MLflow accepts at most 1000 metrics per log_batch call

# The experiment kind the MLflow 3 UI's own kind selector writes; "custom_model_development" is its
# "Machine learning" kind (runs, not GenAI traces). Set on create and on an existing experiment.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
# MLflow 3.17's UI ignores that tag: it picks the experiment's landing tab from the browser's
# "GenAI / Model training" toggle (default GenAI -> Traces), which a link can set with this query.
UI_QUERY = "workflowType=machine_learning"


def ui_url(base: str, experiment_id: str, run_id: str | None = None) -> str:
    """A link into the MLflow UI at `base` that opens as a model-training experiment (runs list)
    or, given `run_id`, on that run's page."""
    page = f"/runs/{run_id}" if run_id else ""
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}{page}?{UI_QUERY}"


def default_tracking_uri(workdir: str | os.PathLike) -> str:
    """`MLFLOW_TRACKING_URI` if set, else a SQLite file inside the workdir."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{Path(workdir).resolve() / 'mlflow.db'}"


def is_tracking_server(uri: str) -> bool:
    """Whether `uri` names an MLflow tracking server (http/https) rather than a store of our own."""
    return urlparse(uri).scheme in ("http", "https")


def flatten(prefix: str, obj: Any) -> dict[str, str]:
    """Nested dict -> {"a.b.c": "value"} for MLflow params."""
    out: dict[str, str] = {}
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            out.update(flatten(f"{prefix}.{key}" if prefix else str(key), value))
    else:
        out[prefix] = str(list(obj) if isinstance(obj, tuple) else obj)[:_PARAM_MAX]
    return out


def numeric_items(obj: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a nested dict (bools as 0/1), for metrics."""
    out: dict[str, float] = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(numeric_items(value, name + "."))
        elif isinstance(value, (int, float)) and not math.isnan(value):  # bools count as 0/1
            out[name] = float(value)
    return out


class TrackingUnavailable(UserError):
    """The MLflow tracking server stopped answering during a run."""


# A tracking server that went away should fail the run in seconds, not after MLflow's default of
# 7 retries with backoff factor 2 (minutes of waiting per call). The user's own settings win.
_HTTP_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


def _answering(method):
    """A Tracker method whose failure to reach a tracking server raises TrackingUnavailable
    (one line naming the server); once lost, later calls fail at once instead of retrying."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if self.lost is not None:
            raise self.lost
        with self.answering():
            return method(self, *args, **kwargs)

    return call


class Tracker:
    """A thin, explicit-run-id wrapper around `MlflowClient`."""

    def __init__(self, tracking_uri: str, experiment: str, artifact_root: Path | None = None):
        self.tracking_uri = tracking_uri
        self.lost: TrackingUnavailable | None = None
        if is_tracking_server(tracking_uri):
            for name, value in _HTTP_RETRIES.items():
                os.environ.setdefault(name, value)
        self.client = MlflowClient(tracking_uri=tracking_uri)
        try:
            found = self.client.get_experiment_by_name(experiment)
        except Exception as exc:  # noqa: BLE001 - any failure here means the store is unusable
            raise UserError(
                f"MLflow tracking store {tracking_uri} is unavailable ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:200]}); "
                "fix MLFLOW_TRACKING_URI or run with --no-tracking"
            ) from None
        if found is not None:
            self.experiment_id = found.experiment_id
            if found.tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:
                self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND_TAG,
                                               EXPERIMENT_KIND)
        else:
            self.experiment_id = self._create_experiment(experiment, artifact_root)

    def _create_experiment(self, name: str, artifact_root: Path | None) -> str:
        """Create the experiment; if a run started at the same moment created it first, use it.

        A tracking server places the artifacts itself (its --artifacts-destination): pinned to
        this client's workdir, every other machine's runs would log to a path only this one has.
        """
        location = (artifact_root.resolve().as_uri()
                    if artifact_root and not is_tracking_server(self.tracking_uri) else None)
        try:
            return self.client.create_experiment(name, artifact_location=location,
                                                 tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
        except MlflowException as exc:
            if exc.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
                raise
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            log.info("experiment %r was created by another run a moment ago; using it (id %s)",
                     name, found.experiment_id)
            return found.experiment_id

    @contextlib.contextmanager
    def answering(self) -> Iterator[None]:
        """Raise TrackingUnavailable where a tracking server fails to answer; remember it."""
        if not is_tracking_server(self.tracking_uri):
            yield
            return
        try:
            yield
        except (MlflowException, requests.exceptions.RequestException) as exc:
            text = str(exc).strip().splitlines()
            if isinstance(exc, MlflowException) and "API request to" not in (text or [""])[0]:
                raise  # the server answered: an error of ours, not a lost server
            self.lost = TrackingUnavailable(
                f"MLflow tracking server {self.tracking_uri} stopped answering "
                f"({(text or [type(exc).__name__])[0][:160]}); the stages completed so far are "
                "kept: rerun once it is back (they are skipped, and tracked again), or with "
                "--no-tracking")
            raise self.lost from None

    @_answering
    def close_abandoned(self, workdir: Path) -> int:
        """End as FAILED the runs an earlier pipeline run on `workdir` of this host left RUNNING
        (it was killed, or lost its tracking server); the caller holds the workdir lock, so none
        of them is still going. Returns how many parent runs were closed."""
        running = self.client.search_runs([self.experiment_id],
                                          "attributes.status = 'RUNNING'", max_results=5000)
        where, host = str(workdir.resolve()), socket.gethostname()
        parents = {r.info.run_id for r in running if r.data.tags.get("selfsup.workdir") == where
                   and r.data.tags.get("selfsup.host") == host  # this machine's lock held
                   and "mlflow.parentRunId" not in r.data.tags}
        for run in running:
            if run.info.run_id in parents or run.data.tags.get("mlflow.parentRunId") in parents:
                self.client.set_tag(run.info.run_id, "selfsup.ended_by",
                                    "a later run on its workdir: it never finished")
                self.client.set_terminated(run.info.run_id, "FAILED")
        return len(parents)

    @_answering
    def start_run(self, name: str, tags: Mapping[str, str], parent_id: str | None = None) -> str:
        tags = dict(tags)
        if parent_id:
            tags["mlflow.parentRunId"] = parent_id
        run = self.client.create_run(self.experiment_id, run_name=name, tags=tags)
        return run.info.run_id

    @_answering
    def log_params(self, run_id: str, params: Mapping[str, str]) -> None:
        items = [Param(k, v) for k, v in sorted(params.items())]
        for i in range(0, len(items), 90):  # MLflow caps params per batch at 100
            self.client.log_batch(run_id, params=items[i : i + 90])

    @_answering
    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int = 0) -> None:
        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, int(step)) for k, v in sorted(metrics.items())]
        for i in range(0, len(items), _BATCH):
            self.client.log_batch(run_id, metrics=items[i : i + _BATCH])

    @_answering
    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    @_answering
    def log_artifact(self, run_id: str, path: str | os.PathLike,
                     artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), artifact_path)

    @_answering
    def log_inputs(self, run_id: str, datasets: list[DatasetInput]) -> None:
        self.client.log_inputs(run_id, datasets=datasets)

    @_answering
    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

    def metric_logger(self, run_id: str):
        """A `log_metrics(metrics, step)` callable for library code that must not import mlflow."""

        def _log(metrics: Mapping[str, float], step: int) -> None:
            self.log_metrics(run_id, metrics, step)

        return _log


class PipelineTracking:
    """The runner's `tasks.stage.StageTracking` over MLflow: a child run per executed stage.

    Every stage's counts also land on the parent run (prefixed by the stage
    name), with a `stage.<name>` tag saying whether it ran or was skipped.
    """

    def __init__(self, tracker: Tracker, parent_run_id: str,
                 registered_model: str | None = None, logged_model: str = "keras"):
        self.tracker, self.parent = tracker, parent_run_id
        self.registered_model, self.logged_model = registered_model, logged_model

    def stage_started(self, stage: str, params: dict[str, Any], reason: str) -> str:
        run_id = self.tracker.start_run(stage, {"selfsup.stage": stage,
                                                "selfsup.reason": reason[:250]},
                                        parent_id=self.parent)
        self.tracker.log_params(run_id, flatten("", params))
        return run_id

    def stage_failed(self, run: str, status: str = "FAILED") -> None:
        with contextlib.suppress(TrackingUnavailable):  # the failure itself is what to report
            self.tracker.end_run(run, status)

    def stage_finished(self, run: str, manifest: StageManifest, manifest_path: Path,
                       artifacts: list[Path]) -> None:
        numbers = numeric_items({"counts": manifest.counts, "metrics": manifest.metrics})
        self.tracker.log_metrics(run, {**numbers, "duration_s": manifest.duration_s})
        self.tracker.log_artifact(run, manifest_path, "manifests")
        for path in artifacts:
            self.tracker.log_artifact(run, path, manifest.stage)
        # the workdir is <workdir>/<stage>/manifest.json's grandparent (DESIGN.md's layout)
        datasets = split_datasets(manifest.stage, manifest_path.parent.parent)
        if datasets:
            self.tracker.log_inputs(run, datasets)
        self.tracker.end_run(run, "FINISHED")
        self._note_on_parent(manifest, "ran")

    def stage_skipped(self, manifest: StageManifest) -> None:
        self._note_on_parent(manifest, "skipped (up to date)")

    def metric_logger(self, run: str):
        return self.tracker.metric_logger(run)

    def publish(self, paths: list[Path], folder: str) -> None:
        for path in paths:
            self.tracker.log_artifact(self.parent, path, folder)

    def publish_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        self.tracker.log_metrics(self.parent, metrics, step)

    def log_classifier(self, run: str, bundle_dir: Path) -> None:
        from flows.model_registry import log_classifier

        with self.tracker.answering():
            uri, version = log_classifier(self.tracker.tracking_uri, run, bundle_dir,
                                          self.registered_model, self.logged_model)
        tags = {"selfsup.classifier_uri": uri}
        if version is not None:
            tags["selfsup.registered_model"] = f"models:/{self.registered_model}/{version}"
        self.tracker.set_tags(run, tags)
        self.tracker.set_tags(self.parent, tags)

    def _note_on_parent(self, manifest: StageManifest, status: str) -> None:
        self.tracker.set_tags(self.parent, {f"stage.{manifest.stage}": status})
        self.tracker.log_metrics(self.parent, numeric_items(manifest.counts, f"{manifest.stage}."))


# The splits each stage's run reads, as MLflow dataset inputs: (table, splits). Before encode a
# split is its rows of the split stage's assignments; from encode on it is encode's per-split
# document table (row i <-> doc_offsets[i]; documents with no tokens dropped), which is what the
# windows, masks and labelled data are made of.
_ASSIGNED = "split/assignments.parquet"
_ENCODED = "encode/{split}_docs.parquet"
STAGE_SPLITS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tokenizer": (_ASSIGNED, ("train", "val")),  # fitted on train, unk rate measured on val
    "encode": (_ASSIGNED, SPLITS),
    "masks": (_ENCODED, ("val",)),
    "pretrain": (_ENCODED, ("train", "val")),  # val through the static val masks
    "finetune": (_ENCODED, SPLITS),
    "baseline": (_ENCODED, SPLITS),
    "compare": (_ENCODED, ("test",)),  # scores every method's test-split predictions
}
SPLIT_CONTEXT = {"train": "training", "val": "validation", "test": "test"}
_DATASETS: dict[tuple[str, int, int, str], Dataset] = {}


def split_datasets(stage: str, workdir: Path) -> list[DatasetInput]:
    """The MLflow dataset inputs of `stage`'s run: one per split it reads (none for other stages),
    named after the split, with an `mlflow.data.context` tag (training / validation / test)."""
    table, splits = STAGE_SPLITS.get(stage, ("", ()))
    return [DatasetInput(split_dataset(workdir / table.format(split=split), split),
                         [InputTag(MLFLOW_DATASET_CONTEXT, SPLIT_CONTEXT[split])])
            for split in splits]


def split_dataset(path: Path, split: str) -> Dataset:
    """One split's rows of a parquet table as an MLflow dataset: source = the file, profile = its
    row count, digest = `frame_digest` of those rows. Only the small key columns are read (id and
    label, or id and group before encode), never the text; memoised per file version."""
    import mlflow.data
    import pandas as pd
    from mlflow.data.dataset_source_registry import get_dataset_source_from_json

    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, split)
    if key in _DATASETS:
        return _DATASETS[key]
    if path.name == Path(_ASSIGNED).name:
        rows = pd.read_parquet(path, columns=["id", "group"], filters=[("split", "==", split)])
        targets = None
    else:
        rows, targets = pd.read_parquet(path, columns=["id", "label"]), "label"
    source = get_dataset_source_from_json(json.dumps({"uri": str(path.resolve())}), "local")
    # MLflow infers the schema value by value (~10 s per million rows): infer it on a sample and
    # state the profile of the whole split.
    info = mlflow.data.from_pandas(rows.head(1000), source=source, targets=targets, name=split,
                                   digest=frame_digest(rows)).to_dict()
    info["profile"] = json.dumps({"num_rows": len(rows), "num_elements": int(rows.size)})
    _DATASETS[key] = Dataset(info["name"], info["digest"], info["source_type"], info["source"],
                             info.get("schema"), info["profile"])
    return _DATASETS[key]


def frame_digest(rows) -> str:
    """16 hex digits of sha256 over the column names and every row's pandas hash, in order: the
    same rows give the same digest (so MLflow shows one dataset across runs); any change, a new
    one. (MLflow's default digest hashes only the first 10,000 rows.)"""
    import pandas as pd

    digest = hashlib.sha256("\0".join(map(str, rows.columns)).encode())
    digest.update(pd.util.hash_pandas_object(rows, index=False).to_numpy().tobytes())
    return digest.hexdigest()[:16]
