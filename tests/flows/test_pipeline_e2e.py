"""End to end: the tiny preset on the embedded corpus through the Prefect flow, tracked in
MLflow."""

import json
import shutil

import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from flows.pipeline import run_pipeline
from flows.summary import collect_report
from selfsup_model.artifacts import read_manifest, sha256_file
from selfsup_model.presets import build_config
from selfsup_model.text.masking import load_masks
from selfsup_model.text.specials import PAD_ID

DETERMINISTIC = [
    "ingest/documents.parquet", "ingest/rejects.parquet", "dedup/clusters.parquet",
    "dedup/signatures.npy",
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


def test_the_report_shows_where_the_wall_time_went(tiny_run):
    from tasks.compare import time_split

    wd, _, _ = tiny_run
    compare = read_manifest(wd / "compare")
    stages = ["ingest", "dedup", "split", "tokenizer", "encode", "masks", "pretrain", "finetune",
              "baseline"]
    seconds = {s: compare.metrics[f"time/{s}_s"] for s in stages}
    assert all(v >= 0 for v in seconds.values()) and seconds["pretrain"] > 0
    for stage in ("pretrain", "finetune", "baseline"):  # no other test reruns these
        assert seconds[stage] == read_manifest(wd / stage).duration_s
    assert compare.metrics["time/pretrain_share"] == pytest.approx(
        seconds["pretrain"] / sum(seconds.values()))
    context = json.loads((wd / "compare" / "report.json").read_text())["context"]
    assert context["stage wall time"] == time_split(seconds)
    assert time_split({"pretrain": 30.0, "finetune": 10.0}) == \
        "pretrain 30 s (75%), finetune 10 s (25%); 40 s in all"


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
    # preset named as the run made it: the workdir's recorded settings stay the same
    again = run_pipeline(build_config("tiny"), "pydocs", workdir=str(wd), stages=UP_TO_MASKS,
                         tracking=False, preset="tiny")
    assert {r.status for r in again} == {"skipped"}
    fresh = tmp_path / "fresh"
    run_pipeline(build_config("tiny"), "pydocs", workdir=str(fresh), stages=UP_TO_MASKS,
                 tracking=False)
    for key in DETERMINISTIC:
        assert sha256_file(wd / key) == sha256_file(fresh / key), key


def test_changed_parameter_reruns_that_stage_and_downstream_only(tiny_run, tmp_path):
    # a copy: the shared run's stages must stay as the preset made them for later tests
    # (rerun stages write new manifests, which compare reads, even when their outputs are
    # byte-identical)
    wd = tmp_path / "wd"
    shutil.copytree(tiny_run[0], wd)
    cfg = build_config("tiny", overrides=["tokenizer.vocab_size=280"])
    results = run_pipeline(cfg, "pydocs", workdir=str(wd), stages=UP_TO_MASKS, tracking=False)
    assert {r.stage: r.status for r in results} == {
        "ingest": "skipped", "dedup": "skipped", "split": "skipped",
        "tokenizer": "ran", "encode": "ran", "masks": "ran"}


def test_mlflow_has_one_parent_and_a_child_per_stage(tiny_run):
    wd, uri, results = tiny_run
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("selfsup")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert (sorted(r.data.tags["selfsup.stage"] for r in children)
            == sorted(r["stage"] for r in results))
    parent = parents[0]
    assert parent.data.tags["selfsup.preset"] == "tiny"
    assert parent.data.metrics["masks.scored_tokens"] > 0
    manifests = [a.path for a in client.list_artifacts(children[0].info.run_id, "manifests")]
    assert manifests == ["manifests/manifest.json"]
    assert json.loads((wd / "ingest" / "manifest.json").read_text())["stage"] == "ingest"


def test_report_is_recomputable_and_lists_every_method(tiny_run):
    from selfsup_model.report.comparison import recompute_results
    from selfsup_model.transfer.sentence_embeddings import sentence_embedding_status

    wd, _, _ = tiny_run
    report = json.loads((wd / "compare" / "report.json").read_text())
    predictions = pd.read_parquet(wd / "compare" / "predictions.parquet")
    assert set(predictions.columns) >= {"id", "method", "fraction", "label", "prediction"}
    test_ids = set(pd.read_parquet(wd / "split" / "assignments.parquet")
                   .query("split == 'test'")["id"])
    assert set(predictions["id"]) <= test_ids  # only the test split is ever scored
    again = {(r["method"], r["fraction"]): r for r in recompute_results(predictions, 50, 5)}
    for row in report["results"]:
        fresh = again[(row["method"], row["fraction"])]
        assert row["test_macro_f1"] == pytest.approx(fresh["test_macro_f1"])
        assert row["test_accuracy"] == pytest.approx(fresh["test_accuracy"])
    methods = {r["method"] for r in report["results"]}
    assert {"pretrained_probe", "pretrained_full", "random_init", "tfidf_logreg", "majority",
            "bag_of_embeddings"} <= methods
    installed, _ = sentence_embedding_status()
    if installed:
        assert "sentence_minilm_probe" in methods
    else:
        assert "not run: sentence_minilm_probe" in report["context"]
    assert {r["fraction"] for r in report["results"]} == {0.5, 1.0}
    for png in ("macro_f1_vs_fraction.png", "confusion_best.png", "pretrain_loss_curve.png"):
        assert (wd / "compare" / png).stat().st_size > 1000


def test_every_neural_method_had_the_same_search_and_budget(tiny_run):
    wd, _, _ = tiny_run
    summaries = [s for stage in ("finetune", "baseline")
                 for s in json.loads((wd / stage / "results.json").read_text())["results"]]
    neural = [s for s in summaries if "grid" in s]
    assert {s["method"] for s in neural} == {"pretrained_full", "pretrained_staged", "random_init",
                                             "bag_of_embeddings"}
    for fraction in {s["fraction"] for s in neural}:
        at = [s for s in neural if s["fraction"] == fraction]
        # the same rate grid on the first seed, and as many runs with the other seeds
        searched = {s["method"]: (sorted(g["learning_rate"] for g in s["grid"]
                                         if g["seed"] == s["grid"][0]["seed"]),
                                  sorted(g["seed"] for g in s["grid"])) for s in at}
        assert len({repr(v) for v in searched.values()}) == 1, searched
        assert len({(s["budget_updates"], s["n_train"]) for s in at}) == 1
    staged = [s for s in neural if s["method"] == "pretrained_staged"]
    assert all([st["stage"] for st in s["stages"]] == ["head", "top", "all"] for s in staged)
    report = json.loads((wd / "compare" / "report.json").read_text())
    effects = {(e["fraction"], e["reference"]) for e in report["pretraining_effect"]}
    assert effects == {(f, ref) for f in (0.5, 1.0) for ref in ("random_init", "tfidf_logreg")}
    assert "What pretraining bought" in (wd / "compare" / "report.md").read_text()
    # The tiny preset searches one rate and one C: no selection, so no grid edge to report.
    assert report["grid_edges"] == []
    assert "every setting chosen on validation lies inside its grid" in (
        wd / "compare" / "report.md").read_text()


def test_pretraining_reads_only_the_training_split_and_its_loss_is_recomputable(tiny_run):
    from selfsup_model.nn.saving import load_keras_model
    from selfsup_model.pretraining.evaluation import evaluate_masked_lm

    wd, _, _ = tiny_run
    manifest = read_manifest(wd / "pretrain")
    assert [k for k in manifest.inputs if "windows" in k] == ["encode/train_windows.npy"]
    model = load_keras_model(wd / "pretrain" / "pretrain_model.keras")
    # From the saved model's full (B, L, V) logits: not the route training logged it by.
    val = evaluate_masked_lm(model, load_masks(wd / "masks" / "val_masks.npz"), batch_size=16,
                             scored_only=False)
    assert val["loss"] == pytest.approx(manifest.metrics["val/mlm_loss"], abs=1e-5)
    assert val["scored_tokens"] == manifest.metrics["val/scored_tokens"]


def test_the_ensemble_row_recomputes_from_the_stages_probabilities(tiny_run):
    from selfsup_model.report.ensemble import ENSEMBLE_METHOD, probabilities_key
    from selfsup_model.report.metrics import macro_f1
    from selfsup_model.text.masking import load_arrays

    wd, _, _ = tiny_run
    arrays = {stage: load_arrays(wd / stage / "probabilities.npz")
              for stage in ("finetune", "baseline")}
    predictions = pd.read_parquet(wd / "compare" / "predictions.parquet")
    report = json.loads((wd / "compare" / "report.json").read_text())
    classes = arrays["finetune"]["classes"]
    # The stored probabilities are those behind every method's reported test predictions and
    # its validation score.
    for stage, a in arrays.items():
        for s in json.loads((wd / stage / "results.json").read_text())["results"]:
            key = probabilities_key(s["method"], s["fraction"], "val")
            if s["method"] == "majority":
                assert key not in a
                continue
            assert macro_f1(a["val_y"], np.argmax(a[key], axis=1)) == s["val_macro_f1"]
            rows = predictions[(predictions["method"] == s["method"])
                               & (predictions["fraction"] == s["fraction"])].set_index("id")
            test = a[probabilities_key(s["method"], s["fraction"], "test")]
            np.testing.assert_array_equal(rows.loc[a["test_ids"], "prediction"],
                                          classes[np.argmax(test, axis=1)])
    a = {**arrays["baseline"], **arrays["finetune"]}
    rows = [r for r in report["results"] if r["method"] == ENSEMBLE_METHOD]
    assert {r["fraction"] for r in rows} == {0.5, 1.0}
    for r in rows:
        w, member = r["selected"]["weight"], r["selected"]["pretrained_member"]
        assert member.startswith("pretrained_") and 0.0 <= w <= 1.0
        mixed = {split: w * a[probabilities_key(member, r["fraction"], split)]
                 + (1 - w) * a[probabilities_key("tfidf_logreg", r["fraction"], split)]
                 for split in ("val", "test")}
        assert macro_f1(a["val_y"], np.argmax(mixed["val"], axis=1)) == r["val_macro_f1"]
        got = predictions[(predictions["method"] == ENSEMBLE_METHOD)
                          & (predictions["fraction"] == r["fraction"])].set_index("id")
        np.testing.assert_array_equal(got.loc[a["test_ids"], "prediction"],
                                      classes[np.argmax(mixed["test"], axis=1)])
    assert all(e["pretrained_method"] != ENSEMBLE_METHOD for e in report["pretraining_effect"])
