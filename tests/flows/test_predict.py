"""`selfsup predict` and the selfsup-predict flow on the tiny end-to-end run: the kept
classifier is the one best on validation, and new text takes the training path exactly."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from flows.cli import main
from flows.pipeline import predict_flow
from selfsup_model.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


def _test_documents(wd: Path) -> pd.DataFrame:
    docs = pd.read_parquet(wd / "ingest" / "documents.parquet", columns=["id", "text"])
    assign = pd.read_parquet(wd / "split" / "assignments.parquet")
    return docs[docs["id"].isin(assign.loc[assign["split"] == "test", "id"])]


def _kept_rows(wd: Path) -> pd.DataFrame:
    kept = json.loads((wd / "compare" / "report.json").read_text())["kept_classifier"]
    rows = pd.read_parquet(wd / "compare" / "predictions.parquet")
    return rows[(rows["method"] == kept["method"]) & (rows["fraction"] == kept["fraction"])]


def test_the_kept_classifier_is_the_best_on_validation_at_the_largest_fraction(tiny_run):
    wd, _, _ = tiny_run
    report = json.loads((wd / "compare" / "report.json").read_text())
    kept = report["kept_classifier"]
    spec = json.loads((wd / "finetune" / "classifier.json").read_text())
    assert kept == spec["kept"]
    summaries = json.loads((wd / "finetune" / "results.json").read_text())["results"]
    largest = max(s["fraction"] for s in summaries)
    at_largest = {s["method"]: s["val_macro_f1"] for s in summaries if s["fraction"] == largest}
    assert set(at_largest) == {"pretrained_probe", "pretrained_full", "pretrained_staged"}
    assert kept["fraction"] == largest
    assert kept["val_macro_f1"] == max(at_largest.values()) == at_largest[kept["method"]]
    assert "classifier handed over" in report["context"]


def test_predict_reproduces_the_kept_methods_test_predictions(tiny_run, tmp_path):
    wd, _, _ = tiny_run
    docs = _test_documents(wd)
    table = tmp_path / "new.parquet"
    docs.to_parquet(table)
    out = tmp_path / "pred.jsonl"
    assert main(["predict", str(table), "--workdir", str(wd), "--out", str(out)]) == 0
    got = pd.read_json(out, lines=True, dtype={"id": str})
    expected = _kept_rows(wd)
    assert len(got) == len(docs) == len(expected) > 0
    merged = expected.merge(got, on="id", suffixes=("_test", "_predict"))
    assert len(merged) == len(expected)
    assert (merged["prediction"] == merged["label_predict"]).all()
    classes = json.loads((wd / "finetune" / "classifier.json").read_text())["classes"]
    probs = got[[f"p_{c}" for c in classes]].to_numpy()
    assert abs(probs.sum(axis=1) - 1).max() < 1e-5


def test_predict_reads_stdin_and_lists_rejects(tiny_run):
    wd, _, _ = tiny_run
    text = _test_documents(wd)["text"].iloc[0].replace("\n", " ")
    stdin = f"{text}\n\n".encode() + b"\xff\xfe\n" + b"email message headers\n"
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "predict", "-", "--workdir",
                           str(wd)], input=stdin, capture_output=True, cwd=ROOT, env=env,
                          timeout=120, check=False)
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, err[-2000:]
    assert "line-1" in out and "line-4" in out and "line-2" not in out
    assert "rejected 2 of 4 inputs: empty=1, not_utf8=1" in err
    assert "oneDNN" not in err and "absl" not in err  # TensorFlow's start-up lines held back


@pytest.mark.parametrize("args, message", [
    (["predict", "{tmp}/nope.csv"], "does not exist"),
    (["predict", "{tmp}", "--out", "{tmp}/p.txt"], "file type comes from its extension"),
    (["predict", "{tmp}", "--batch-size", "0"], "--batch-size must be at least 1"),
])
def test_bad_predict_arguments_exit_2_with_one_line(tiny_run, tmp_path, capsys, args, message):
    wd, _, _ = tiny_run
    argv = [a.format(tmp=tmp_path) for a in args] + ["--workdir", str(wd)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_workdir_without_a_classifier_exits_2(tmp_path, capsys):
    (tmp_path / "in.csv").write_text("text\nhello\n")
    assert main(["predict", str(tmp_path / "in.csv"), "--workdir", str(tmp_path / "wd")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no finished classifier" in err[0]


def test_all_inputs_rejected_exits_2(tiny_run, tmp_path, capsys):
    wd, _, _ = tiny_run
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "blank.txt").write_text("  ")
    assert main(["predict", str(tmp_path / "in"), "--workdir", str(wd)]) == 2
    assert "all rejected (empty=1)" in capsys.readouterr().err


def test_predict_flow_writes_predictions_rejects_and_a_summary(tiny_run, tmp_path):
    wd, _, _ = tiny_run
    folder = tmp_path / "incoming"
    folder.mkdir()
    for doc_id, text in _test_documents(wd).head(3).itertuples(index=False):
        (folder / f"{doc_id.replace(':', '_')}.txt").write_text(text, encoding="utf-8")
    (folder / "broken.txt").write_bytes(b"\x00\x01")
    out = tmp_path / "scored.parquet"
    summary = predict_flow(source=str(folder), out=str(out), workdir=str(wd))
    assert summary["read"] == 4 and summary["scored"] == 3 and summary["rejected"] == 1
    assert sum(summary["labels"].values()) == 3
    assert len(pd.read_parquet(out)) == 3
    rejects = pd.read_csv(tmp_path / "scored.rejects.csv")
    assert rejects[["id", "reason"]].values.tolist() == [["broken.txt", "binary"]]
    # The next run over clean input leaves no earlier run's rejects beside its predictions.
    (folder / "broken.txt").unlink()
    assert predict_flow(source=str(folder), out=str(out), workdir=str(wd))["rejected"] == 0
    assert not (tmp_path / "scored.rejects.csv").exists()


def test_fill_mask_prints_top_k_per_mask_and_generate_refuses_a_masked_lm(tiny_run, capsys):
    wd, _, _ = tiny_run
    assert main(["fill-mask", "the [MASK] module parses [MASK] messages", "--workdir", str(wd),
                 "--top-k", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["[MASK] 1", "[MASK] 2"]
    probs = [float(word) for word in lines[0].split(":", 1)[1].split()[1::2]]
    assert len(probs) == 3 and probs == sorted(probs, reverse=True)
    assert main(["generate", "import", "--workdir", str(wd)]) == 2
    assert "needs a causal-LM run" in capsys.readouterr().err


def test_generate_on_a_causal_run_and_fill_mask_refuses_it(tiny_run, tmp_path, capsys):
    import shutil

    reference, _, _ = tiny_run
    wd = tmp_path / "clm"
    shutil.copytree(reference, wd, ignore=shutil.ignore_patterns(
        "pretrain", "finetune", "baseline", "compare", "mlflow.db", "mlartifacts"))
    assert main(["run", "--workdir", str(wd), "--to", "pretrain", "--no-tracking",
                 "--set", "pretrain.objective=clm"]) == 0
    capsys.readouterr()
    assert main(["generate", "the email", "--workdir", str(wd), "--max-new-tokens", "5",
                 "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip().startswith("the email")
    assert "stopped: " in captured.err
    assert main(["fill-mask", "the [MASK]", "--workdir", str(wd)]) == 2
    assert "needs a masked-LM run" in capsys.readouterr().err


def test_fill_mask_refuses_a_tokenizer_refitted_after_pretraining(tiny_run, tmp_path, capsys):
    import shutil

    reference, _, _ = tiny_run
    wd = tmp_path / "refit"
    shutil.copytree(reference, wd, ignore=shutil.ignore_patterns("mlflow.db", "mlartifacts"))
    assert main(["run", "--workdir", str(wd), "--only", "tokenizer", "--no-tracking",
                 "--set", "tokenizer.lowercase=false"]) == 0
    capsys.readouterr()
    assert main(["fill-mask", "the [MASK] module", "--workdir", str(wd)]) == 2
    assert "not the one its pretrained model was trained with" in capsys.readouterr().err


@pytest.mark.parametrize("name, message", [
    ("classifier.json", "changed after the run wrote"),  # checked against the manifest
    ("classifier.keras", "does not match the sha256"),  # checked against classifier.json
])
def test_a_changed_classifier_file_exits_2(tiny_run, tmp_path, capsys, name, message):
    import shutil

    reference, _, _ = tiny_run
    wd = tmp_path / "wd"
    shutil.copytree(reference / "finetune", wd / "finetune")
    with open(wd / "finetune" / name, "ab") as fh:
        fh.write(b" ")
    (tmp_path / "in.csv").write_text("text\nhello there\n")
    assert main(["predict", str(tmp_path / "in.csv"), "--workdir", str(wd)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_the_predict_flow_refuses_a_batch_size_below_one_before_any_work(tmp_path):
    # A deployment's parameters skip the CLI's check; the flow must refuse the size in its
    # own words, not fail deep in batching. The workdir does not exist: the size comes first.
    with pytest.raises(UserError, match="batch_size must be at least 1"):
        predict_flow(source=str(tmp_path), out=str(tmp_path / "out.parquet"),
                     workdir=str(tmp_path / "nowhere"), batch_size=0)
    assert not (tmp_path / "out.parquet").exists()
