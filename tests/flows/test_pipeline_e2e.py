"""End to end: the tiny preset on the embedded corpus through the Prefect flow, tracked in MLflow."""

import json

import numpy as np
import pandas as pd
from mlflow.tracking import MlflowClient

from flows.pipeline import run_pipeline
from flows.report import collect_report
from selfsup_model.artifacts import read_manifest, sha256_file
from selfsup_model.config import build_config
from selfsup_model.masking import load_masks
from selfsup_model.specials import PAD_ID

DETERMINISTIC = [
    "ingest/documents.parquet", "ingest/rejects.parquet", "dedup/clusters.parquet", "dedup/signatures.npy",
    "split/assignments.parquet", "tokenizer/tokenizer.json", "encode/train_windows.npy",
    "encode/val_windows.npy", "encode/test_windows.npy", "masks/val_masks.npz",
]
UP_TO_MASKS = ["ingest", "dedup", "split", "tokenizer", "encode", "masks"]


def test_every_stage_ran_and_the_accounting_balances(tiny_run):
    wd, _, results = tiny_run
    assert [r["status"] for r in results] == ["ran"] * len(results)
    report = collect_report(wd)
    assert all(info["status"] == "complete" for info in report["stages"].values())
    acc = report["accounting"]
    assert acc["balanced"] and acc["read"] == acc["kept"] + acc["duplicates"] + acc["rejected"]
    split = report["stages"]["split"]["counts"]
    assert split["leakage_pairs"] == 0 and split["groups_across_splits"] == 0


def test_splits_are_disjoint_and_groups_never_cross(tiny_run):
    wd, _, _ = tiny_run
    assign = pd.read_parquet(wd / "split" / "assignments.parquet")
    assert assign["id"].is_unique
    assert (assign.groupby("group")["split"].nunique() == 1).all()
    assert (assign.groupby("unit_id")["split"].nunique() == 1).all()


def test_static_masks_score_only_real_tokens(tiny_run):
    wd, _, _ = tiny_run
    masks = load_masks(wd / "masks" / "val_masks.npz")
    windows = np.load(wd / "encode" / "val_windows.npy")
    np.testing.assert_array_equal(masks["target_ids"], windows)
    scored = masks["loss_weights"] > 0
    assert scored.any() and not (windows[scored] == PAD_ID).any()
    counts = read_manifest(wd / "masks").counts
    assert counts["scored_tokens"] == int(scored.sum())


def test_rerun_skips_everything_and_same_seed_is_byte_identical(tiny_run, tmp_path):
    wd, _, _ = tiny_run
    again = run_pipeline(build_config("tiny"), "pydocs", workdir=str(wd), stages=UP_TO_MASKS, tracking=False)
    assert {r.status for r in again} == {"skipped"}
    fresh = tmp_path / "fresh"
    run_pipeline(build_config("tiny"), "pydocs", workdir=str(fresh), stages=UP_TO_MASKS, tracking=False)
    for key in DETERMINISTIC:
        assert sha256_file(wd / key) == sha256_file(fresh / key), key


def test_changed_parameter_reruns_that_stage_and_downstream_only(tiny_run, tmp_path):
    wd, _, _ = tiny_run
    cfg = build_config("tiny", overrides=["tokenizer.vocab_size=280"])
    results = run_pipeline(cfg, "pydocs", workdir=str(wd), stages=UP_TO_MASKS, tracking=False)
    assert {r.stage: r.status for r in results} == {
        "ingest": "skipped", "dedup": "skipped", "split": "skipped",
        "tokenizer": "ran", "encode": "ran", "masks": "ran"}
    # and back again, so later tests see the preset's artifacts
    run_pipeline(build_config("tiny"), "pydocs", workdir=str(wd), stages=UP_TO_MASKS, tracking=False)


def test_mlflow_has_one_parent_and_a_child_per_stage(tiny_run):
    wd, uri, results = tiny_run
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("selfsup")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert sorted(r.data.tags["selfsup.stage"] for r in children) == sorted(r["stage"] for r in results)
    parent = parents[0]
    assert parent.data.tags["selfsup.preset"] == "tiny"
    assert parent.data.metrics["masks.scored_tokens"] > 0
    manifests = [a.path for a in client.list_artifacts(children[0].info.run_id, "manifests")]
    assert manifests == ["manifests/manifest.json"]
    assert json.loads((wd / "ingest" / "manifest.json").read_text())["stage"] == "ingest"
