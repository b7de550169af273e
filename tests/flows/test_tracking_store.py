"""Where the Tracker puts an experiment: its own store pins artifacts into the workdir, a tracking
server places them itself, and an experiment another run created a moment earlier is reused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

import flows.tracking
from flows.tracking import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, Tracker, is_tracking_server

ROOT = Path(__file__).resolve().parents[2]


def _recording_client(created: list[tuple[str, str | None]]) -> type:
    """An MlflowClient stand-in with no experiments that records what `create_experiment` gets."""

    class RecordingClient:
        def __init__(self, tracking_uri: str):
            self.tracking_uri = tracking_uri

        def get_experiment_by_name(self, name: str) -> None:
            return None

        def create_experiment(self, name: str, artifact_location: str | None = None,
                              tags: dict | None = None) -> str:
            created.append((name, artifact_location))
            return "7"

    return RecordingClient


@pytest.mark.parametrize("uri, pinned", [
    ("sqlite:///{tmp}/mlflow.db", True),
    ("postgresql+psycopg2://u@127.0.0.1:5432/mlflow", True),
    ("http://127.0.0.1:5000", False),
    ("https://mlflow.example.org", False),
])
def test_only_a_tracking_server_chooses_the_artifact_location(tmp_path, monkeypatch, uri, pinned):
    created = []
    monkeypatch.setattr(flows.tracking, "MlflowClient", _recording_client(created))
    uri = uri.format(tmp=tmp_path)
    assert Tracker(uri, "exp", artifact_root=tmp_path / "mlartifacts").experiment_id == "7"
    assert is_tracking_server(uri) is not pinned
    expected = (tmp_path / "mlartifacts").resolve().as_uri() if pinned else None
    assert created == [("exp", expected)]


def test_an_experiment_created_between_lookup_and_create_is_reused(tmp_path, monkeypatch):
    """Two runs start together: both look the name up and miss, the other one creates it first;
    this one's create gets RESOURCE_ALREADY_EXISTS from the store and must use theirs."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    theirs = client.create_experiment("shared", tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
    lookups = []
    real_lookup = MlflowClient.get_experiment_by_name

    def lookup_that_misses_first(self, name):
        lookups.append(name)
        return None if len(lookups) == 1 else real_lookup(self, name)

    monkeypatch.setattr(MlflowClient, "get_experiment_by_name", lookup_that_misses_first)
    tracker = Tracker(uri, "shared", artifact_root=tmp_path / "mlartifacts")
    assert tracker.experiment_id == theirs
    assert lookups == ["shared", "shared"]  # missed, create refused, read again
    assert [e.experiment_id for e in client.search_experiments()
            if e.name == "shared"] == [theirs]
    run = tracker.start_run("p", {})
    assert client.get_run(run).info.experiment_id == theirs


def test_other_create_errors_still_surface(tmp_path, monkeypatch):
    monkeypatch.setattr(MlflowClient, "get_experiment_by_name", lambda self, name: None)
    with pytest.raises(Exception, match="Invalid experiment name"):
        Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "")


def test_pydocs_workers_are_not_forked_from_the_caller():
    """By ingest the pipeline process holds MLflow's SQLAlchemy engine (SQLite or PostgreSQL
    connections) and other libraries' threads: the harvest's worker processes must not be forks
    of it. `os.register_at_fork` sees every fork Python makes in this process."""
    probe = (
        "import os\n"
        "forks = []\n"
        "os.register_at_fork(before=lambda: forks.append(1))\n"
        "from selfsup_model.corpus.pydocs import harvest\n"
        "frame = harvest(['email', 'xml', 'unittest'], workers=2, max_per_library=5)\n"
        "assert len(frame) == 15, len(frame)\n"
        "print(len(forks))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "0"
