"""A tracking server that goes away mid-run: the run fails within seconds in one line naming it,
completed stages stay valid, and a rerun once the server is back skips them and tracks the run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.pipeline import run_pipeline
from flows.tracking import TrackingUnavailable
from selfsup_model.artifacts import read_manifest, verify_outputs
from selfsup_model.presets import build_config
from tests.integration.servers import free_port, start_mlflow_server, stop_group

STAGES = ["ingest", "dedup", "split"]


def _server(home: Path, port: int):
    """`mlflow server` on a SQLite store in `home` (the same store across restarts)."""
    return start_mlflow_server(f"sqlite:///{home / 'store.db'}", home / "artifacts", home, port)


def test_a_lost_tracking_server_fails_the_run_in_seconds_and_a_rerun_completes(
        tmp_path, monkeypatch):
    home, port = tmp_path / "mlflow", free_port()
    home.mkdir()
    url = f"http://127.0.0.1:{port}"
    for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)  # the run's own defaults, restored after
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    corpus, wd = tmp_path / "corpus.jsonl", tmp_path / "wd"
    rows = [{"id": f"d{i}", "text": " ".join(f"t{i}w{j}" for j in range(12)), "label": f"c{i % 2}"}
            for i in range(30)]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    server = _server(home, port)
    import tasks.split

    real_compute, stopped_at = tasks.split.compute, []

    def server_goes_away(*args, **kwargs):  # while the split computes
        stop_group(server)
        stopped_at.append(time.monotonic())
        return real_compute(*args, **kwargs)

    monkeypatch.setattr(tasks.split, "compute", server_goes_away)
    try:
        with pytest.raises(TrackingUnavailable) as lost:
            run_pipeline(build_config("tiny"), str(corpus), workdir=str(wd), stages=STAGES)
        assert time.monotonic() - stopped_at[0] < 30  # not minutes of retries
        message = str(lost.value)
        assert "\n" not in message and f"tracking server {url} stopped answering" in message
        for stage in STAGES:  # the split finished before its tracking call failed
            manifest = read_manifest(wd / stage)
            assert manifest is not None and not verify_outputs(wd / stage, manifest), stage

        monkeypatch.setattr(tasks.split, "compute", real_compute)
        server = _server(home, port)
        again = run_pipeline(build_config("tiny"), str(corpus), workdir=str(wd), stages=STAGES)
        assert [r.status for r in again] == ["skipped"] * 3
        client = MlflowClient(url)
        runs = client.search_runs([client.get_experiment_by_name("selfsup").experiment_id])
        parents = sorted((r for r in runs if "mlflow.parentRunId" not in r.data.tags),
                         key=lambda r: r.info.start_time)
        assert [p.info.status for p in parents] == ["FAILED", "FINISHED"]
        assert {parents[1].data.tags[f"stage.{s}"] for s in STAGES} == {"skipped (up to date)"}
    finally:
        stop_group(server)
