"""MLflow as a reviewer reads it: a model-training experiment whose stage runs list the splits they
read as dataset inputs (name, context, digest, row count), checked through the API against the
split files themselves."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from flows.tracking import (
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    STAGE_SPLITS,
    Tracker,
    frame_digest,
    ui_url,
)
from tasks.registry import PIPELINE, STAGE_NAMES

ALL = {"train": "training", "val": "validation", "test": "test"}
# What each stage's run must show: {split: context}, and the file its rows come from.
EXPECTED = {
    "tokenizer": ({"train": "training", "val": "validation"}, "split/assignments.parquet"),
    "encode": (ALL, "split/assignments.parquet"),
    "masks": ({"val": "validation"}, "encode/{split}_docs.parquet"),
    "pretrain": ({"train": "training", "val": "validation"}, "encode/{split}_docs.parquet"),
    "finetune": (ALL, "encode/{split}_docs.parquet"),
    "baseline": (ALL, "encode/{split}_docs.parquet"),
    "compare": ({"test": "test"}, "encode/{split}_docs.parquet"),
}


def _stage_runs(client: MlflowClient, experiment_id: str) -> dict[str, object]:
    runs = client.search_runs([experiment_id])
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    return {r.data.tags["selfsup.stage"]: client.get_run(r.info.run_id) for r in runs
            if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}


def _rows(wd: Path, table: str, split: str) -> pd.DataFrame:
    """The split's rows, read independently of flows.tracking."""
    if table == "split/assignments.parquet":
        assign = pd.read_parquet(wd / table)
        return assign.loc[assign["split"] == split, ["id", "group"]].reset_index(drop=True)
    return pd.read_parquet(wd / table.format(split=split))[["id", "label"]]


def test_experiment_is_marked_as_model_training(tiny_run):
    _, uri, _ = tiny_run
    exp = MlflowClient(uri).get_experiment_by_name("selfsup")
    assert exp.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND == "custom_model_development"


def test_an_existing_experiment_gets_the_kind_once(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    old = client.create_experiment("older", artifact_location=(tmp_path / "a").as_uri())
    assert EXPERIMENT_KIND_TAG not in client.get_experiment(old).tags
    for _ in range(2):  # idempotent
        assert Tracker(uri, "older").experiment_id == old
        assert client.get_experiment(old).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    new = Tracker(uri, "fresh", artifact_root=tmp_path / "b").experiment_id
    assert client.get_experiment(new).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND


def test_stage_runs_list_the_splits_they_read(tiny_run):
    wd, uri, _ = tiny_run
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("selfsup")
    runs = _stage_runs(client, exp.experiment_id)
    assert set(EXPECTED) <= set(runs)
    for stage, run in runs.items():
        inputs = run.inputs.dataset_inputs
        if stage not in EXPECTED:
            assert inputs == [], stage
            continue
        splits, table = EXPECTED[stage]
        contexts = {i.dataset.name: {t.key: t.value for t in i.tags}["mlflow.data.context"]
                    for i in inputs}
        assert contexts == splits, stage
        for item in inputs:
            ds, split = item.dataset, item.dataset.name
            rows = _rows(wd, table, split)
            assert len(rows) > 0
            assert json.loads(ds.profile)["num_rows"] == len(rows), (stage, split)
            assert ds.digest and ds.digest == frame_digest(rows), (stage, split)
            assert ds.source_type == "local"
            assert json.loads(ds.source)["uri"] == str((wd / table.format(split=split)).resolve())
            columns = [c["name"] for c in json.loads(ds.schema)["mlflow_colspec"]]
            assert columns == list(rows.columns)
    # encode's split sizes are what the split stage assigned
    counts = pd.read_parquet(wd / "split" / "assignments.parquet")["split"].value_counts()
    encode = {i.dataset.name: json.loads(i.dataset.profile)["num_rows"]
              for i in runs["encode"].inputs.dataset_inputs}
    assert encode == {s: int(counts[s]) for s in ALL}
    # one dataset per split and table: every reader of encode's train split logs the same digest
    digests = {s: {i.dataset.digest for stage in ("finetune", "baseline", "pretrain")
                   for i in runs[stage].inputs.dataset_inputs if i.dataset.name == s}
               for s in ("train", "val")}
    assert all(len(d) == 1 for d in digests.values()), digests


def test_every_stage_that_reads_a_split_is_in_the_dataset_table():
    """A new stage reading split rows (the assignments or encode's per-split files) must say which
    splits it logs as datasets."""
    readers = {spec.name for spec in PIPELINE
               if any(key == "split/assignments.parquet"
                      or any(key.startswith(f"encode/{s}_") for s in ALL) for key in spec.inputs)}
    assert readers <= set(STAGE_SPLITS)
    assert set(STAGE_SPLITS) <= set(STAGE_NAMES)
    assert {stage: set(splits) for stage, (_, splits) in STAGE_SPLITS.items()} == {
        stage: set(splits) for stage, (splits, _) in EXPECTED.items()}


def test_digest_covers_every_row():
    rows = pd.DataFrame({"id": [f"d{i}" for i in range(20_000)], "label": ["a"] * 20_000})
    same = frame_digest(rows.copy())
    changed = rows.copy()
    changed.loc[19_999, "label"] = "b"  # past MLflow's default 10,000-row digest window
    assert frame_digest(rows) == same and len(same) == 16
    assert frame_digest(changed) != same


@pytest.mark.parametrize("run_id, page", [(None, ""), ("abc", "/runs/abc")])
def test_ui_links_open_as_a_model_training_experiment(run_id, page):
    assert (ui_url("http://127.0.0.1:5000/", "7", run_id)
            == f"http://127.0.0.1:5000/#/experiments/7{page}?workflowType=machine_learning")
