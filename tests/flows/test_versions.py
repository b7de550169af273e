"""A workdir whose corpus grows: versions, splits that never move, the version switch."""

from __future__ import annotations

import json
import logging
import signal

import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from flows.pipeline import run_pipeline
from flows.versions import read_lineage
from selfsup_model.nn.saving import load_keras_model
from selfsup_model.presets import build_config
from selfsup_model.report.metrics import macro_f1

CORPUS_STAGES = ["ingest", "dedup", "split"]
# Word sets, so that the Jaccard of a constructed text is exact by hand (A + B: 1/2 with each).
WORDS = ["dedup.shingle=word", "dedup.shingle_size=1"]


def config(*overrides: str):
    return build_config("tiny", overrides=[*WORDS, *overrides])


def words(prefix: str, n: int = 12) -> list[str]:
    return [f"{prefix}{j}" for j in range(n)]


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


@pytest.fixture
def first_rows():
    return [{"id": f"d{i}", "text": " ".join(words(f"t{i}_")), "label": f"c{i % 2}"}
            for i in range(60)]


def run(corpus, wd, **kw):
    return {r.stage: r for r in run_pipeline(config(), str(corpus), workdir=str(wd),
                                             stages=CORPUS_STAGES, tracking=False, **kw)}


def splits(wd) -> pd.Series:
    return pd.read_parquet(wd / "split" / "assignments.parquet").set_index("id")["split"]


def test_a_grown_corpus_is_the_next_version_and_nothing_moves(first_rows, tmp_path, caplog):
    corpus, wd = tmp_path / "corpus.jsonl", tmp_path / "wd"
    write(corpus, first_rows)
    run(corpus, wd)
    before = splits(wd)
    train = before[before == "train"].index[0]
    test, other_test = before[before == "test"].index[:2]
    text = {r["id"]: r["text"] for r in first_rows}
    grown = [r for r in first_rows if r["id"] != "d59"]  # retired
    changed = next(r for r in grown if r["id"] == other_test)
    changed["text"] += " and one more"  # a changed text keeps its split
    grown += [
        {"id": "near_test", "text": " ".join(text[test].split()[:-2] + ["x", "y"]),
         "label": "c0"},  # related to a test document (J = 10/14): joins test
        {"id": "bridge", "text": text[train] + " " + text[test], "label": "c1"},  # quarantined
        *({"id": f"n{i}", "text": " ".join(words(f"new{i}_")), "label": f"c{i % 2}"}
          for i in range(8)),
    ]
    write(corpus, grown)
    with caplog.at_level(logging.INFO, logger="selfsup"):
        second = run(corpus, wd)
    assert "lineage" in caplog.text and "version 1 is the last complete one" in caplog.text
    after = splits(wd)
    kept = before.index.intersection(after.index)
    assert len(kept) == 59 and (after[kept] == before[kept]).all()  # nobody moved
    assert after[other_test] == "test"  # its text changed
    assert after["near_test"] == "test"
    assert "bridge" not in after.index and "d59" not in after.index
    held = pd.read_parquet(wd / "split" / "quarantine.parquet").set_index("id")
    assert held.loc["bridge", "reason"] == "related to earlier documents in test and train"
    counts = second["ingest"].counts
    assert (counts["version_new"], counts["version_changed"], counts["version_retired"]) == (
        10, 1, 1)
    assert second["split"].counts["quarantined_new"] == 1
    state = read_lineage(wd)
    assert [v["version"] for v in state["versions"]] == [1, 2]
    assert state["versions"][1]["counts"] == {"unchanged": 58, "new": 10, "changed": 1,
                                              "retired": 1, "documents": 69}
    snapshot = wd / "versions" / state["lineage"] / "v0001" / "split" / "assignments.parquet"
    assert pd.read_parquet(snapshot).set_index("id")["split"].equals(before)

    again = run(corpus, wd)  # nothing new: nothing reruns, the version stays
    assert {r.status for r in again.values()} == {"skipped"}
    assert [v["version"] for v in read_lineage(wd)["versions"]] == [1, 2]


def test_a_run_that_fails_leaves_the_last_version_and_a_rerun_completes(
        first_rows, tmp_path, monkeypatch):
    corpus, wd = tmp_path / "corpus.jsonl", tmp_path / "wd"
    write(corpus, first_rows)
    run(corpus, wd)
    write(corpus, first_rows + [{"id": "n0", "text": " ".join(words("new_")), "label": "c0"}])
    import tasks.split
    import tasks.stopping

    def dies(*args, **kwargs):
        raise KeyboardInterrupt  # as a stop during the split of the new version

    monkeypatch.setattr(tasks.split, "extend_splits", dies)
    handlers = {s: signal.getsignal(s) for s in tasks.stopping.STOP_SIGNALS}
    monkeypatch.setattr(tasks.stopping._state, "stopping", False)
    try:
        with pytest.raises(KeyboardInterrupt):
            run(corpus, wd)
        # the run knew it was stopping: a second Ctrl-C would have ended it at once
        assert tasks.stopping.is_stopping()
        assert signal.getsignal(signal.SIGINT) is tasks.stopping._at_once
    finally:  # this is pytest's process: its own handlers back
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert [v["version"] for v in read_lineage(wd)["versions"]] == [1]
    monkeypatch.undo()
    result = run(corpus, wd)
    assert [r.status for r in result.values()] == ["skipped", "skipped", "ran"]
    assert [v["version"] for v in read_lineage(wd)["versions"]] == [1, 2]
    assert "n0" in splits(wd).index


def test_a_setting_that_shapes_the_split_starts_a_new_lineage_in_one_line(
        first_rows, tmp_path, caplog):
    corpus, wd = tmp_path / "corpus.jsonl", tmp_path / "wd"
    write(corpus, first_rows)
    run(corpus, wd)
    with caplog.at_level(logging.INFO, logger="selfsup.versions"):
        first = run_pipeline(config("split.seed=8"), str(corpus), workdir=str(wd),
                             stages=CORPUS_STAGES, tracking=False)
    # A first version is what a new corpus gives: only the split is made again.
    assert [r.status for r in first] == ["skipped", "skipped", "ran"]
    lines = [r.getMessage() for r in caplog.records if "new lineage" in r.getMessage()]
    assert len(lines) == 1 and "split.seed" in lines[0]
    lineage = read_lineage(wd)["lineage"]

    write(corpus, first_rows + [{"id": "n0", "text": " ".join(words("new_")), "label": "c0"}])
    run_pipeline(config("split.seed=8"), str(corpus), workdir=str(wd), stages=CORPUS_STAGES,
                 tracking=False)
    assert [v["version"] for v in read_lineage(wd)["versions"]] == [1, 2]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="selfsup.versions"):
        rows = run_pipeline(config("split.seed=9"), str(corpus), workdir=str(wd),
                            stages=CORPUS_STAGES, tracking=False)
    # A grown version is not: everything from ingest is rebuilt as for a new corpus.
    assert [r.status for r in rows] == ["ran", "ran", "ran"]
    assert sum("new lineage" in r.getMessage() for r in caplog.records) == 1
    state = read_lineage(wd)
    assert state["lineage"] != lineage and [v["version"] for v in state["versions"]] == [1]
    assert not json.loads((wd / "ingest" / "version.json").read_text())["extends"]


def test_new_lineage_rebuilds_the_split_from_scratch(first_rows, tmp_path):
    corpus, wd, fresh = tmp_path / "corpus.jsonl", tmp_path / "wd", tmp_path / "fresh"
    write(corpus, first_rows)
    run(corpus, wd)
    write(corpus, first_rows + [{"id": f"n{i}", "text": " ".join(words(f"new{i}_")),
                                 "label": "c0"} for i in range(6)])
    run(corpus, wd, new_lineage=True)
    run(corpus, fresh)
    for name in ("ingest/documents.parquet", "dedup/clusters.parquet",
                 "split/assignments.parquet"):
        assert (wd / name).read_bytes() == (fresh / name).read_bytes(), name
    assert np.array_equal(np.load(wd / "dedup" / "digests.npy"),
                          np.load(fresh / "dedup" / "digests.npy"))


def test_a_grown_corpus_keeps_its_tokenizer_and_says_when_new_text_drifts(
        first_rows, tmp_path, caplog):
    corpus, wd = tmp_path / "corpus.jsonl", tmp_path / "wd"
    stages = [*CORPUS_STAGES, "tokenizer"]
    write(corpus, first_rows)
    run_pipeline(config(), str(corpus), workdir=str(wd), stages=stages, tracking=False)
    fitted = (wd / "tokenizer" / "tokenizer.json").read_bytes()
    alike = [{"id": f"a{i}", "text": " ".join(words(f"t{i}_")[::-1]), "label": "c0"}
             for i in range(100, 104)]
    write(corpus, first_rows + alike)
    grown = run_pipeline(config(), str(corpus), workdir=str(wd), stages=stages, tracking=False)
    tok = grown[-1]
    assert (wd / "tokenizer" / "tokenizer.json").read_bytes() == fitted
    assert tok.counts["reused_from"].endswith("v0001") and tok.counts["new_documents"] == 4
    assert not tok.counts["drift"]
    # Letters the tokenizer never saw: [UNK] for every word of the new documents.
    foreign = [{"id": f"f{i}", "text": " ".join(f"ψλ{i}ω{j}" for j in range(12)),
                "label": "c1"} for i in range(4)]
    write(corpus, first_rows + alike + foreign)
    with caplog.at_level(logging.WARNING, logger="selfsup.tokenizer"):
        drifted = run_pipeline(config(), str(corpus), workdir=str(wd), stages=stages,
                               tracking=False)[-1]
    assert drifted.counts["drift"] and drifted.counts["reused_from"].endswith("v0002")
    assert drifted.metrics["new_unk_rate"] > 0.5
    assert drifted.metrics["fitted_val_unk_rate"] == tok.metrics["fitted_val_unk_rate"]
    assert "past the drift thresholds" in caplog.text
    assert (wd / "tokenizer" / "tokenizer.json").read_bytes() == fitted


def test_a_tracked_run_records_its_corpus_version_on_the_parent_run(tiny_run):
    wd, uri, _ = tiny_run
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("selfsup")
    parent = next(r for r in client.search_runs([exp.experiment_id])
                  if "mlflow.parentRunId" not in r.data.tags)
    state = read_lineage(wd)
    assert parent.data.tags["selfsup.corpus_version"] == "1"
    assert parent.data.tags["selfsup.lineage"] == state["lineage"]
    assert [a.path for a in client.list_artifacts(parent.info.run_id, "corpus")] == [
        "corpus/lineage.json"]
    # the whole run's stages are in the version's snapshot, manifests included
    assert state["versions"][0]["stages"][-1] == "compare"
    snapshot = wd / "versions" / state["lineage"] / "v0001"
    assert (snapshot / "pretrain" / "encoder.keras").samefile(wd / "pretrain" / "encoder.keras")


UP_TO_PRETRAIN = [*CORPUS_STAGES, "tokenizer", "encode", "masks", "pretrain"]
# The whole pipeline, kept small: one label fraction, one fine-tuning mode, no sentence model.
SMALL = ["finetune.fractions=[1.0]", "finetune.modes=[full]", "finetune.learning_rates=[1e-3]",
         "baseline.sentence_embeddings=off"]


def test_a_later_version_continues_the_last_encoder_and_is_scored_on_the_first_test_set(
        first_rows, tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # each workdir's own store
    corpus, wd = tmp_path / "corpus.jsonl", tmp_path / "wd"
    # A rate of ~0: the continued encoder must come out as version 1's, which proves where it
    # started from.
    still = [*SMALL, "pretrain.learning_rate=1e-12", "pretrain.replay=0.5"]
    write(corpus, first_rows)
    run_pipeline(config(*still), str(corpus), workdir=str(wd))
    first = load_keras_model(wd / "pretrain" / "encoder.keras").get_weights()
    first_test = splits(wd)[lambda s: s == "test"].index
    new = [{"id": f"n{i}", "text": " ".join(words(f"new{i}_")), "label": f"c{i % 2}"}
           for i in range(12)]
    write(corpus, first_rows + new)
    with caplog.at_level(logging.INFO, logger="selfsup"):
        grown = {r.stage: r for r in run_pipeline(config(*still), str(corpus), workdir=str(wd))}
    train = splits(wd)[lambda s: s == "train"].index
    new_train = sum(i.startswith("n") for i in train)
    pre = grown["pretrain"].counts
    assert pre["continued_version"] == 1 and "v0001" in pre["initialised_from"]
    assert pre["new_train_documents"] == new_train > 0
    assert pre["replayed_documents"] == round(0.5 * new_train)
    # every document here is two windows long: the schedule scales with the windows it reads
    offsets = np.load(wd / "encode" / "train_doc_offsets.npy")
    assert set(np.diff(offsets)) == {2} and pre["split_train_windows"] == 2 * len(train)
    assert pre["train_windows"] == 2 * (new_train + pre["replayed_documents"])
    assert pre["steps"] == -(-12 * pre["train_windows"] // pre["split_train_windows"])
    assert "continuing corpus version 1's encoder" in caplog.text
    # the lineage leak check ran on this version's val/test and passed: nothing moved
    tok = grown["tokenizer"].counts
    held_out = int((splits(wd) != "train").sum())
    assert tok["source_audit_passed"] and tok["source_documents_checked"] == held_out
    assert tok["source_train_documents"] == int((pd.read_parquet(
        wd / "versions" / read_lineage(wd)["lineage"] / "v0001" / "split" / "assignments.parquet")
        ["split"] == "train").sum())
    after = load_keras_model(wd / "pretrain" / "encoder.keras").get_weights()
    assert all(np.allclose(a, b, atol=1e-6) for a, b in zip(first, after, strict=True))

    # Scored on the lineage's first test set (frozen) and on the whole test set (cumulative).
    predictions = pd.read_parquet(wd / "compare" / "predictions.parquet")
    tfidf = predictions[predictions["method"] == "tfidf_logreg"].set_index("id")
    frozen = tfidf.loc[tfidf.index.isin(first_test)]
    assert 0 < len(frozen) < len(tfidf) == int((splits(wd) == "test").sum())
    record = json.loads((wd / "compare" / "version_metrics.json").read_text())
    assert record["version"] == 2
    assert record["test_documents"] == {"first_test": len(frozen), "all_test": len(tfidf)}
    by_hand = macro_f1(frozen["label"], frozen["prediction"])
    assert record["macro_f1"]["first_test"]["tfidf_logreg"]["1"] == pytest.approx(by_hand)
    report = (wd / "compare" / "report.md").read_text()
    assert "## Corpus versions" in report and "![macro-F1 across versions]" in report
    rows = [line for line in report.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert [r.split(" | ")[3] for r in rows] == ["from scratch, 12 steps",
                                                 f"continues v1, {pre['steps']} steps"]
    assert (wd / "compare" / "macro_f1_vs_version.png").stat().st_size > 0
    # Both runs are in the workdir's store; the last holds the series over versions.
    client = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
    parents = [r for r in client.search_runs([client.get_experiment_by_name(
        "selfsup").experiment_id]) if "mlflow.parentRunId" not in r.data.tags]
    assert sorted(p.data.tags["selfsup.corpus_version"] for p in parents) == ["1", "2"]
    last = next(p for p in parents if p.data.tags["selfsup.corpus_version"] == "2")
    history = client.get_metric_history(
        last.info.run_id, "versions/tfidf_logreg/fraction_1/first_test_macro_f1")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [
        (1, pytest.approx(json.loads((wd / "versions" / read_lineage(wd)["lineage"] / "v0001"
                                      / "compare" / "version_metrics.json").read_text())
                          ["macro_f1"]["first_test"]["tfidf_logreg"]["1"])),
        (2, pytest.approx(by_hand))]

    # The control: from random initialisation on the whole training split (another seed: a
    # continued encoder would still come out as version 1's).
    scratch = {r.stage: r for r in run_pipeline(
        config(*still, "pretrain.versions=scratch", "pretrain.seed=7"), str(corpus),
        workdir=str(wd), stages=UP_TO_PRETRAIN, tracking=False)}
    counts = scratch["pretrain"].counts
    assert counts["initialised_from"] == "random initialisation"
    assert counts["train_windows"] == 2 * len(train) and counts["steps"] == 12
    assert "continued_version" not in counts
    control = load_keras_model(wd / "pretrain" / "encoder.keras").get_weights()
    assert not all(np.allclose(a, b, atol=1e-6) for a, b in zip(first, control, strict=True))
