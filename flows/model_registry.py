"""Logging the kept classifier as an MLflow model and registering it.

The model is `flows/classifier_pyfunc.py` (models from code) with the bundle's
three files as artifacts, our package as its code, a signature (a `text`
column in; label, probability and one p_<class> column per class out) and an
input example. It is logged into the finetune stage's run and registered as a
new version of the configured registered model.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import keras
import mlflow
import pandas as pd
from mlflow.models import Model, ModelSignature
from mlflow.tracking import MlflowClient
from mlflow.types import ColSpec, Schema

import selfsup_model
from selfsup_model.serving.inference import BUNDLE_FILES, SPEC_FILE, read_spec

log = logging.getLogger("selfsup.tracking")

MODEL_CODE = Path(__file__).with_name("classifier_pyfunc.py")
_PROGRESS_BAR = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
_TRACKING_URI_VAR = "MLFLOW_TRACKING_URI"
EXAMPLE_TEXT = "A new document to classify, as plain text."


def classifier_signature(classes: list[str]) -> ModelSignature:
    outputs = [ColSpec("string", "label"), ColSpec("float", "probability"),
               *(ColSpec("float", f"p_{name}") for name in classes)]
    return ModelSignature(inputs=Schema([ColSpec("string", "text")]), outputs=Schema(outputs))


def requirements(engine: str = "keras") -> list[str]:
    """What loading the model needs, pinned to the versions that trained it: Keras and its
    backend for the Keras model, ONNX Runtime instead for the ONNX one (its text path and
    scoring import neither Keras nor a backend)."""
    dists = ["mlflow", "tokenizers", "numpy", "pandas", "pydantic", "pyarrow"]
    if engine == "onnx":
        dists.append("onnxruntime")
    else:
        dists.append("keras")
        backend = keras.backend.backend()
        dists += {"tensorflow": ["tensorflow-cpu", "tensorflow"], "jax": ["jax"]}.get(backend, [])
    pins = []
    for dist in dists:
        try:
            pins.append(f"{dist}=={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            continue  # e.g. tensorflow when tensorflow-cpu provides the backend
    return pins


@contextlib.contextmanager
def _tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's model logging reads the process-wide URI; point it at our store meanwhile (the
    one place selfsup touches MLflow's global state; runs are still named by id).

    MLflow's `set_tracking_uri` also exports MLFLOW_TRACKING_URI, and "restoring" the default
    would pin the next run of this process to MLflow's default store (./mlflow.db) instead of
    its workdir's: the variable is put back as it was, set or not."""
    before = mlflow.get_tracking_uri()
    saved = {name: os.environ.get(name) for name in (_PROGRESS_BAR, _TRACKING_URI_VAR)}
    mlflow.set_tracking_uri(uri)
    os.environ[_PROGRESS_BAR] = "false"  # no download bars in the run's log
    try:
        yield
    finally:
        mlflow.set_tracking_uri(before)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def log_classifier(tracking_uri: str, run_id: str, bundle_dir: Path,
                   registered_name: str | None, engine: str = "keras") -> tuple[str, str | None]:
    """Log the bundle in `bundle_dir` into `run_id`, as it is (engine "keras") or with its
    classifier converted to ONNX ("onnx"); register it under `registered_name` (None: log
    only). Returns (model URI, registered version or None)."""
    with tempfile.TemporaryDirectory() as staging:
        if engine == "onnx":
            from selfsup_model.serving.inference import ClassifierBundle
            from selfsup_model.serving.onnx_export import write_onnx_bundle

            files = write_onnx_bundle(ClassifierBundle.load(bundle_dir),
                                      Path(staging) / f"{Path(SPEC_FILE).stem}.onnx",
                                      {"bundle": str(Path(bundle_dir).resolve())})
        else:
            files = [Path(bundle_dir) / name for name in BUNDLE_FILES]
        return _log(tracking_uri, run_id, bundle_dir, registered_name, engine, files)


def _log(tracking_uri: str, run_id: str, bundle_dir: Path, registered_name: str | None,
         engine: str, files: list[Path]) -> tuple[str, str | None]:
    spec = read_spec(bundle_dir)
    client = MlflowClient(tracking_uri)
    # Created here, in the run's experiment: left to itself, MLflow would file the model under
    # the process's active (by default the "Default") experiment and its artifact root.
    model = client.create_logged_model(
        experiment_id=client.get_run(run_id).info.experiment_id, name="classifier",
        source_run_id=run_id, tags={"selfsup.kept_method": spec["kept"]["method"],
                                    "selfsup.engine": engine})
    with _tracking_uri(tracking_uri):
        info = Model.log(
            artifact_path=None, name="classifier", flavor=mlflow.pyfunc, run_id=run_id,
            model_id=model.model_id,
            python_model=str(MODEL_CODE),
            artifacts={path.name: str(path) for path in files},
            code_paths=[str(Path(selfsup_model.__file__).parent)],
            pip_requirements=requirements(engine),
            signature=classifier_signature(spec["classes"]),
            input_example=pd.DataFrame({"text": [EXAMPLE_TEXT]}),
            registered_model_name=registered_name,
        )
    version = info.registered_model_version
    log.info("logged the classifier (%s, %s) as %s%s", spec["kept"]["method"], engine,
             info.model_uri,
             f"; registered as {registered_name} version {version}" if version else "")
    return info.model_uri, (str(version) if version is not None else None)
