"""The handed-over classifier: which one is kept, the probe folded into Keras, the bundle's
integrity checks, and new text read and judged for scoring."""

import json

import numpy as np
import pandas as pd
import pytest
from sklearn.linear_model import LogisticRegression

from selfsup_model.artifacts import atomic_write_json
from selfsup_model.config import EncodeConfig, IngestConfig, ModelConfig, TokenizerConfig
from selfsup_model.errors import ArtifactError, UserError
from selfsup_model.nn.model import build_backbone
from selfsup_model.serving.inference import (
    SPEC_FILE,
    ClassifierBundle,
    KeptCandidate,
    choose_kept,
    probe_classifier,
    read_spec,
    softmax,
    write_bundle,
    write_no_classifier,
)
from selfsup_model.serving.scoring import check_output_path, read_inputs, score, write_predictions
from selfsup_model.text.tokenization import fit_tokenizer, save_tokenizer
from selfsup_model.transfer.features import frozen_features
from tests.library.toy import make_docs

MODEL = ModelConfig(hidden=16, heads=2, ff=32, layers=1, dropout=0.0)


def _candidate(method, f1):
    return KeptCandidate(method, 1.0, f1, {}, lambda: None)


def test_kept_is_the_best_on_validation_and_a_tie_keeps_the_earlier():
    chosen = choose_kept([_candidate("probe", 0.5), _candidate("full", 0.7),
                          _candidate("staged", 0.7)])
    assert chosen.method == "full"
    assert choose_kept([_candidate("probe", 0.6), _candidate("full", 0.6)]).method == "probe"
    # a tie between pretrained methods goes to the cheaper one, whatever the caller's order
    tied = [_candidate("pretrained_staged", 0.6), _candidate("pretrained_full", 0.6),
            _candidate("pretrained_probe", 0.6)]
    assert choose_kept(tied).method == "pretrained_probe"
    assert choose_kept(tied[:2]).method == "pretrained_full"
    with pytest.raises(ValueError):
        choose_kept([])


@pytest.mark.parametrize("n_classes", [2, 3])
def test_the_folded_probe_gives_the_regressions_probabilities(n_classes):
    backbone = build_backbone(40, 8, MODEL)
    ids, y = make_docs(60, seed=1)
    y = np.arange(60) % n_classes
    classes = [f"c{k}" for k in range(n_classes)]
    x = frozen_features(backbone, ids)  # (60, H)
    mean, scale = x.mean(axis=0), x.std(axis=0) + 0.5  # a scale != 1 exercises the folding
    clf = LogisticRegression(C=10.0, solver="newton-cg", max_iter=1000)
    clf.fit((x - mean) / scale, np.asarray(classes)[y])
    model = probe_classifier(backbone, "mean", clf, mean, scale, classes)
    expected = clf.predict_proba((x - mean) / scale)
    got = softmax(model.predict_on_batch(ids))
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert (got.argmax(1) == expected.argmax(1)).all()
    with pytest.raises(ValueError, match="differ"):
        probe_classifier(backbone, "mean", clf, mean, scale, [*classes[::-1]])


def test_softmax_hand_computed():
    np.testing.assert_allclose(softmax(np.array([[0.0, np.log(3.0)]])), [[0.25, 0.75]],
                               rtol=1e-6)


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory):
    """A real bundle: a tiny tokenizer and an (untrained) probe classifier over a tiny encoder."""
    out = tmp_path_factory.mktemp("bundle")
    texts = ["the heron waits in the reeds", "salmon swim upstream", "a storm over the sea",
             "birds fly south", "fish under the ice"] * 4
    tok = fit_tokenizer(texts, TokenizerConfig(vocab_size=64, min_frequency=1))
    save_tokenizer(tok, out / "source_tokenizer.json")
    backbone = build_backbone(tok.get_vocab_size(), 16, MODEL)
    clf = LogisticRegression().fit(np.eye(16)[:4], ["birds", "fish", "birds", "fish"])
    model = probe_classifier(backbone, "mean", clf, np.zeros(16), np.ones(16),
                             ["birds", "fish"])
    write_bundle(out, KeptCandidate("pretrained_probe", 1.0, 0.9, {"C": 1.0}, lambda: model),
                 model, out / "source_tokenizer.json", ["birds", "fish"],
                 EncodeConfig(max_len=16, overlap=2, max_windows_per_doc=3), None, "mean",
                 backbone)
    return out


def test_bundle_round_trip_and_spec(bundle_dir):
    spec = read_spec(bundle_dir)
    assert spec["classes"] == ["birds", "fish"] and spec["kept"]["method"] == "pretrained_probe"
    assert spec["objective"] == "mlm" and spec["causal"] is False
    bundle = ClassifierBundle.load(bundle_dir)
    probs, kept = bundle.predict_proba(["the heron waits", "   ", "salmon swim"])
    assert kept.tolist() == [0, 2]  # the blank text has no tokens: left out, not guessed
    assert probs.shape == (2, 2) and np.allclose(probs.sum(axis=1), 1.0, atol=1e-6)
    # Every window, up to the run's max_windows_per_doc: a long text is three rows, and its
    # probabilities the mean of theirs.
    assert spec["read_windows"] == "all"
    long = ["birds fly south " * 40]
    enc = bundle.encode_texts(long)
    assert enc.ids.shape == (3, 16) and enc.owner.tolist() == [0, 0, 0]
    per_window = softmax(np.asarray(bundle.model.predict_on_batch(enc.ids)))
    probs, kept = bundle.predict_proba(long)
    assert kept.tolist() == [0]
    np.testing.assert_allclose(probs, per_window.mean(axis=0, keepdims=True), atol=1e-6)


def test_a_bundle_from_before_read_windows_reads_first_windows(bundle_dir, tmp_path):
    import shutil

    copy = tmp_path / "b"
    shutil.copytree(bundle_dir, copy)
    spec = json.loads((copy / "classifier.json").read_text())
    del spec["read_windows"]
    (copy / "classifier.json").write_text(json.dumps(spec))
    enc = ClassifierBundle.load(copy).encode_texts(["birds fly south " * 40, "fish"])
    assert enc.ids.shape == (2, 16) and enc.owner.tolist() == [0, 1]


def test_a_changed_bundle_file_is_refused(bundle_dir, tmp_path):
    import shutil

    copy = tmp_path / "b"
    shutil.copytree(bundle_dir, copy)
    with open(copy / "tokenizer.json", "a", encoding="utf-8") as fh:
        fh.write(" ")
    with pytest.raises(ArtifactError, match="does not match the sha256"):
        ClassifierBundle.load(copy)


def test_a_spec_that_leaves_a_file_unhashed_is_refused(bundle_dir, tmp_path):
    import shutil

    copy = tmp_path / "b"
    shutil.copytree(bundle_dir, copy)
    spec = json.loads((copy / SPEC_FILE).read_text())
    del spec["sha256"]["tokenizer.json"]  # the tokenizer would load unverified
    (copy / SPEC_FILE).write_text(json.dumps(spec))
    with pytest.raises(ArtifactError, match="no sha256 for .'tokenizer.json'"):
        ClassifierBundle.load(copy)


def test_missing_or_skipped_spec_is_one_clear_error(tmp_path):
    with pytest.raises(UserError, match="no finished classifier"):
        read_spec(tmp_path)
    write_no_classifier(tmp_path, "the corpus has fewer than two labels")
    with pytest.raises(UserError, match="fewer than two labels"):
        read_spec(tmp_path)
    atomic_write_json(tmp_path / SPEC_FILE, {"version": 99})
    with pytest.raises(ArtifactError, match="version 99"):
        read_spec(tmp_path)


# ---------------------------------------------------------------- reading inputs to score


def test_a_folder_is_read_recursively_and_every_file_is_accounted_for(tmp_path):
    (tmp_path / "in" / "sub").mkdir(parents=True)
    (tmp_path / "in" / "a.txt").write_text("A  heron\r\nwaits.", encoding="utf-8")
    (tmp_path / "in" / "sub" / "b.txt").write_text("ok", encoding="utf-8")
    (tmp_path / "in" / "latin1.txt").write_bytes("Caf\xe9".encode("latin-1"))
    (tmp_path / "in" / "nul.txt").write_bytes(b"abc\x00def")
    (tmp_path / "in" / "blank.txt").write_text(" \n\t", encoding="utf-8")
    (tmp_path / "in" / "notes.md").write_text("not a txt", encoding="utf-8")
    got = read_inputs(str(tmp_path / "in"), IngestConfig())
    assert got.read == 6 == len(got.documents) + len(got.rejects)
    # Normalised as ingest does; a two-character text is kept (no minimum length to score).
    assert dict(zip(got.documents["id"], got.documents["text"], strict=True)) == {
        "a.txt": "A heron\nwaits.", "sub/b.txt": "ok"}
    assert dict(zip(got.rejects["id"], got.rejects["reason"], strict=True)) == {
        "blank.txt": "empty", "latin1.txt": "not_utf8", "notes.md": "not_txt",
        "nul.txt": "binary"}


def test_lines_and_tables_with_duplicate_ids(tmp_path):
    got = read_inputs("-", IngestConfig(), [b"first doc\n", b"\n", b"\xff\xfe bad\n", b"last"])
    assert got.documents["id"].tolist() == ["line-1", "line-4"]
    assert dict(zip(got.rejects["id"], got.rejects["reason"], strict=True)) == {
        "line-2": "empty", "line-3": "not_utf8"}
    table = tmp_path / "t.csv"
    pd.DataFrame({"doc": ["x", "x", "y"], "body": ["one", "two", "three"]}).to_csv(table,
                                                                                 index=False)
    cfg = IngestConfig(text_column="body", id_column="doc")
    got = read_inputs(str(table), cfg)
    assert got.documents["id"].tolist() == ["x", "y"]
    assert got.rejects["reason"].tolist() == ["duplicate_id"]
    with pytest.raises(UserError, match="no 'text' column"):
        read_inputs(str(table), IngestConfig())
    with pytest.raises(UserError, match="does not exist"):
        read_inputs(str(tmp_path / "nope.csv"), IngestConfig())
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(UserError, match="cannot read"):
        read_inputs(str(tmp_path / "x.bin"), IngestConfig())


def test_score_accounts_for_every_document_and_writes_each_format(bundle_dir, tmp_path):
    bundle = ClassifierBundle.load(bundle_dir)
    inputs = read_inputs("-", IngestConfig(), [b"the heron waits", b"", b"salmon swim"])
    predictions, rejects = score(bundle, inputs)
    assert predictions["id"].tolist() == ["line-1", "line-3"]
    assert rejects["id"].tolist() == ["line-2"]
    assert list(predictions.columns) == ["id", "label", "probability", "p_birds", "p_fish"]
    best = predictions[["p_birds", "p_fish"]].to_numpy().max(axis=1)
    np.testing.assert_allclose(predictions["probability"], best)
    for suffix in (".parquet", ".jsonl", ".csv"):
        path = write_predictions(predictions, tmp_path / f"p{suffix}")
        back = (pd.read_parquet(path) if suffix == ".parquet" else
                pd.read_json(path, lines=True) if suffix == ".jsonl" else pd.read_csv(path))
        assert back["label"].tolist() == predictions["label"].tolist()
    with pytest.raises(UserError, match="extension"):
        check_output_path(str(tmp_path / "p.txt"))
    with pytest.raises(UserError, match="does not exist"):
        check_output_path(str(tmp_path / "missing" / "p.csv"))


def test_spec_json_is_plain_json(bundle_dir):
    assert json.loads((bundle_dir / SPEC_FILE).read_text())["sha256"].keys() == {
        "classifier.keras", "tokenizer.json"}
