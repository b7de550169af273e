"""Rerun semantics: skip what is up to date, rerun on changed parameters, inputs or tampered
outputs."""

import time

import pytest
from mlflow.tracking import MlflowClient

from flows.pipeline import run_pipeline
from selfsup_model.errors import UserError
from selfsup_model.presets import build_config


def _statuses(results):
    return {r.stage: r.status for r in results}


def test_second_identical_run_skips_ingest_fast(folder_corpus, tmp_path, mlflow_uri):
    cfg = build_config("tiny")
    wd = tmp_path / "wd"
    first = run_pipeline(cfg, str(folder_corpus), workdir=str(wd), stages=["ingest"])
    assert _statuses(first) == {"ingest": "ran"}
    t0 = time.perf_counter()
    second = run_pipeline(cfg, str(folder_corpus), workdir=str(wd), stages=["ingest"],
                          tracking=False)
    assert _statuses(second) == {"ingest": "skipped"}
    assert time.perf_counter() - t0 < 1.0


def test_changed_parameter_reruns_and_force_reruns(folder_corpus, tmp_path):
    wd = str(tmp_path / "wd")
    run_pipeline(build_config("tiny"), str(folder_corpus), workdir=wd, stages=["ingest"],
                 tracking=False)
    changed = build_config("tiny", overrides=["ingest.min_chars=72"])
    result = run_pipeline(changed, str(folder_corpus), workdir=wd, stages=["ingest"],
                          tracking=False)
    assert _statuses(result) == {"ingest": "ran"}
    assert result[0].counts["rejected_too_short"] > 0
    again = run_pipeline(changed, str(folder_corpus), workdir=wd, stages=["ingest"],
                         force=["ingest"], tracking=False)
    assert _statuses(again) == {"ingest": "ran"}


def test_tampered_output_is_detected_and_rebuilt(folder_corpus, tmp_path):
    wd = tmp_path / "wd"
    cfg = build_config("tiny")
    run_pipeline(cfg, str(folder_corpus), workdir=str(wd), stages=["ingest"], tracking=False)
    docs = wd / "ingest" / "documents.parquet"
    original = docs.read_bytes()
    docs.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    result = run_pipeline(cfg, str(folder_corpus), workdir=str(wd), stages=["ingest"],
                          tracking=False)
    assert _statuses(result) == {"ingest": "ran"}
    assert "modified" in result[0].reason
    assert docs.read_bytes() == original  # deterministic rebuild


def test_changed_corpus_file_reruns_ingest(folder_corpus, tmp_path):
    wd = str(tmp_path / "wd")
    cfg = build_config("tiny")
    run_pipeline(cfg, str(folder_corpus), workdir=wd, stages=["ingest"], tracking=False)
    (folder_corpus / "birds" / "new.txt").write_text(
        "An owl hunts silently across the moonlit field.")
    result = run_pipeline(cfg, str(folder_corpus), workdir=wd, stages=["ingest"], tracking=False)
    assert _statuses(result) == {"ingest": "ran"}
    assert result[0].counts["kept"] == 5


def test_mlflow_parent_and_child_runs(folder_corpus, tmp_path, mlflow_uri):
    cfg = build_config("tiny")
    wd = str(tmp_path / "wd")
    run_pipeline(cfg, str(folder_corpus), workdir=wd, stages=["ingest"], preset="tiny")
    run_pipeline(cfg, str(folder_corpus), workdir=wd, stages=["ingest"], preset="tiny")
    client = MlflowClient(mlflow_uri)
    exp = client.get_experiment_by_name(cfg.experiment)
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 2 and len(children) == 1  # the second run skipped ingest: no child
    child = children[0]
    assert child.data.tags["mlflow.parentRunId"] == parents[0].info.run_id
    assert child.data.metrics["counts.kept"] == 4
    assert child.data.params["ingest.min_chars"] == "20"
    assert parents[1].data.tags["stage.ingest"].startswith("skipped")
    assert parents[1].data.metrics["ingest.read"] == 7
    assert all(r.info.status == "FINISHED" for r in runs)


def test_several_training_processes_need_jax(folder_corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_DISTRIBUTION_NUM_PROCESSES", "2")
    with pytest.raises(UserError, match="need KERAS_BACKEND=jax"):
        run_pipeline(build_config("tiny"), str(folder_corpus), workdir=str(tmp_path / "wd"),
                     stages=["ingest"], tracking=False)
    assert not (tmp_path / "wd").exists()  # refused before anything was written
