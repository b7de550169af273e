"""Exports: the masked-LM encoder as a `transformers` checkpoint and the kept classifier as an
ONNX model, each held to selfsup's own outputs.

transformers (with torch) and onnx/onnxruntime come with the `export` and `embeddings` extras;
CI installs them and sets SELFSUP_REQUIRE_EXPORT=1, so there a missing one fails, not skips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from flows.cli import main
from selfsup_model.config import EncodeConfig, ModelConfig, TokenizerConfig
from selfsup_model.corpus.ingest import normalize_document
from selfsup_model.errors import UserError
from selfsup_model.nn.model import (
    build_backbone,
    build_pretrain_export_model,
    build_pretraining_model,
)
from selfsup_model.serving.hf_export import (
    RunInfo,
    check_export,
    safetensors_bytes,
    write_hf_checkpoint,
)
from selfsup_model.text.encoding import encode_split
from selfsup_model.text.specials import CLS_ID, MASK_ID, NUM_SPECIAL, PAD_ID, SEP_ID
from selfsup_model.text.tokenization import fit_tokenizer

L = 24
# Accents (composed and decomposed), CJK, long identifiers, odd whitespace, an empty text.
TEXTS = [
    "Café crème, naïve façade: résumé of the ÉCOLE",
    "Cafe\u0301 de\u0301ja\u0300 vu \u00a0 non\u2003breaking\tspaces\r\nand CRLF lines",
    "東京都の天気は晴れです。北京欢迎你 and mixed 한국어 text",
    ("getHTTPResponseCode_forRequestHandlerFactory(self, max_retry_count=3) -> "
     "Optional[Dict[str, List[int]]]"),
    "  leading   and trailing  \n\n\n\n  blank   runs  \n x ",
    "",
    "email.message_from_bytes parses the message; xml.etree.ElementTree.fromstring too",
]
REQUIRED = os.environ.get("SELFSUP_REQUIRE_EXPORT") == "1"


def _need(*modules: str) -> None:
    if not REQUIRED:
        for module in modules:
            pytest.importorskip(module)


def _tokenizer(kind: str):
    corpus = [t for t in TEXTS if t] * 3 + [f"word{i} token{i % 7} value_{i}" for i in range(80)]
    return fit_tokenizer(corpus, TokenizerConfig(kind=kind, vocab_size=160, min_frequency=1))


def _export_model(vocab: int, norm: str, tie: bool, seed: int = 0):
    """A masked-LM export model whose every weight is off its initial value."""
    cfg = ModelConfig(hidden=16, layers=2, heads=2, ff=32, dropout=0.1, norm=norm,
                      tie_embeddings=tie)
    backbone = build_backbone(vocab, L, cfg, seed=seed)
    trained = build_pretraining_model(backbone, "mlm", cfg, seed=seed + 1)
    rng = np.random.default_rng(seed)
    for w in trained.weights:
        w.assign(w.numpy() + rng.normal(0, 0.05, w.shape).astype("float32"))
    return build_pretrain_export_model(backbone, trained.head, "mlm")


def _windows(tokenizer) -> np.ndarray:
    """Real, right-padded framed windows of TEXTS, some positions replaced by [MASK]."""
    enc = encode_split(tokenizer, [normalize_document(t) for t in TEXTS],
                       EncodeConfig(max_len=L, overlap=4, max_windows_per_doc=2))
    ids = enc.windows.copy()
    content = np.isin(ids, [PAD_ID, CLS_ID, SEP_ID], invert=True)
    ids[content & (np.arange(L)[None] % 5 == 2)] = MASK_ID
    assert (ids == MASK_ID).any() and (ids == PAD_ID).any()
    return ids


def _run_info() -> RunInfo:
    return RunInfo(workdir="(a test model)", pretrain_manifest=None, model_sha256="-",
                   tokenizer_sha256="-")


# ------------------------------------------------------------------------------ safetensors


def test_safetensors_written_by_hand_read_back_with_the_reference_reader(tmp_path):
    _need("safetensors")
    from safetensors.numpy import load_file

    tensors = {"b": np.arange(6, dtype=np.float32).reshape(2, 3),
               "a": np.array([1.5, -2.0], np.float32), "e": np.zeros((0, 4), np.float32)}
    data = safetensors_bytes(tensors, {"format": "pt"})
    header_len = int.from_bytes(data[:8], "little")
    assert (8 + header_len) % 8 == 0  # the data starts aligned
    assert json.loads(data[8:8 + header_len])["__metadata__"] == {"format": "pt"}
    (tmp_path / "t.safetensors").write_bytes(data)
    back = load_file(tmp_path / "t.safetensors")
    assert sorted(back) == ["a", "b", "e"]
    for name, array in tensors.items():
        np.testing.assert_array_equal(back[name], array)
        assert back[name].dtype == np.float32


# ------------------------------------------------------------------------------ transformers


@pytest.mark.parametrize("norm, tie, architecture", [
    ("post", True, "BertForMaskedLM"), ("post", False, "BertForMaskedLM"),
    ("pre", True, "MegatronBertForMaskedLM"), ("pre", False, "MegatronBertForMaskedLM")])
def test_transformers_loads_every_weight_and_computes_our_logits(tmp_path, norm, tie,
                                                                 architecture):
    _need("transformers", "torch")
    import torch
    from transformers import AutoModelForMaskedLM

    tokenizer = _tokenizer("wordpiece")
    model = _export_model(tokenizer.get_vocab_size(), norm, tie)
    written = write_hf_checkpoint(model, tokenizer, tmp_path / "hf", _run_info())
    assert written.architecture == architecture
    assert check_export(tmp_path / "hf")["architecture"] == architecture
    theirs, info = AutoModelForMaskedLM.from_pretrained(tmp_path / "hf",
                                                        output_loading_info=True)
    assert type(theirs).__name__ == architecture
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    theirs.eval()
    ids = _windows(tokenizer)
    ours = np.asarray(model(ids, training=False))  # (B, L, V)
    with torch.no_grad():
        got = theirs(input_ids=torch.from_numpy(ids.astype(np.int64)),
                     attention_mask=torch.from_numpy((ids != PAD_ID).astype(np.int64))
                     ).logits.numpy()
    real = ids != PAD_ID
    assert np.abs(got[real] - ours[real]).max() < 1e-4
    # tied: one matrix in the file, transformers ties the decoder to it
    assert tie == ("cls.predictions.decoder.weight" not in _safetensors_names(tmp_path / "hf"))


def _safetensors_names(directory) -> set[str]:
    data = (directory / "model.safetensors").read_bytes()
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    return set(header) - {"__metadata__"}


@pytest.mark.parametrize("kind", ["wordpiece", "bpe"])
def test_autotokenizer_ids_are_ours(tmp_path, kind):
    _need("transformers")
    from transformers import AutoTokenizer

    tokenizer = _tokenizer(kind)
    write_hf_checkpoint(_export_model(tokenizer.get_vocab_size(), "post", True), tokenizer,
                        tmp_path / "hf", _run_info())
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    enc = encode_split(tokenizer, [normalize_document(t) for t in TEXTS],
                       EncodeConfig(max_len=L, overlap=4, max_windows_per_doc=1))
    first_window = dict(zip(enc.kept.tolist(), enc.windows, strict=True))
    for i, text in enumerate(TEXTS):
        content = tokenizer.encode(normalize_document(text), add_special_tokens=False).ids
        assert theirs(text, add_special_tokens=False)["input_ids"] == content, text
        framed = theirs(text, truncation=True)
        if text:
            window = first_window[i]
            assert framed["input_ids"] == window[window != PAD_ID].tolist(), text
        else:  # selfsup reads no window of an empty text; transformers frames nothing
            assert i in enc.empty and framed["input_ids"] == [CLS_ID, SEP_ID]
        assert set(framed) == {"input_ids", "attention_mask"}  # one token type: none sent
    assert len(theirs(TEXTS[3] * 5, truncation=True)["input_ids"]) == L
    batch = theirs(TEXTS[:3], padding=True, return_tensors="np")
    assert (batch["input_ids"][:, -1] == PAD_ID).any()  # padded on the right with [PAD]


def test_fill_mask_pipeline_gives_selfsup_fill_masks_top_5(tiny_run, tmp_path, capsys):
    _need("transformers", "torch")
    from transformers import pipeline

    from selfsup_model.serving.generation import fill_mask
    from selfsup_model.serving.inference import load_run_pretrained

    wd, _, _ = tiny_run
    out = tmp_path / "hf"
    assert main(["export", "--workdir", str(wd), "--format", "hf", "--out", str(out)]) == 0
    assert "BertForMaskedLM checkpoint ->" in capsys.readouterr().out
    provenance = check_export(out)
    assert provenance["from"]["workdir"] == str(wd.resolve())
    card = (out / "README.md").read_text()
    manifest = json.loads((wd / "pretrain" / "manifest.json").read_text())
    loss, scored = manifest["metrics"]["val/mlm_loss"], manifest["metrics"]["val/scored_tokens"]
    assert f"**{loss:.4f}**" in card and f"**{int(scored)}**" in card and "pydocs" in card

    run = load_run_pretrained(wd)
    # The run's own pretrain_model.keras on its stored validation windows (with their [MASK]s).
    import torch
    from transformers import AutoModelForMaskedLM

    ids = np.load(wd / "masks" / "val_masks.npz")["input_ids"].astype(np.int32)
    theirs = AutoModelForMaskedLM.from_pretrained(out).eval()
    with torch.no_grad():
        got = theirs(input_ids=torch.from_numpy(ids.astype(np.int64)),
                     attention_mask=torch.from_numpy((ids != PAD_ID).astype(np.int64))
                     ).logits.numpy()
    real = ids != PAD_ID
    assert (ids == MASK_ID).any()
    assert np.abs(got[real] - np.asarray(run.model(ids, training=False))[real]).max() < 1e-4
    fill = pipeline("fill-mask", model=str(out), top_k=5 + NUM_SPECIAL)
    for text in ("Parse an email [MASK] from a bytes object.",
                 "The [MASK] module runs the unit [MASK] of a package."):
        ours = fill_mask(run.model, run.tokenizer, text, top_k=5)
        answers = fill(text)
        answers = answers if isinstance(answers[0], list) else [answers]
        assert len(answers) == len(ours)
        for mine, theirs in zip(ours, answers, strict=True):
            kept = [a for a in theirs if a["token"] >= NUM_SPECIAL][:5]
            assert [a["token"] for a in kept] == [c.token_id for c in mine], text
            np.testing.assert_allclose([a["score"] for a in kept],
                                       [c.probability for c in mine], atol=1e-4)

    # A second export replaces the first whole; a directory of something else is refused.
    assert main(["export", "--workdir", str(wd), "--format", "hf", "--out", str(out)]) == 0
    check_export(out)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert main(["export", "--workdir", str(wd), "--format", "hf", "--out", str(other)]) == 2
    assert "holds no earlier selfsup export" in capsys.readouterr().err
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left


@pytest.mark.parametrize("case, why", [
    ("causal", "a causal-LM run"), ("packed", "a packed run")])
def test_what_transformers_cannot_compute_is_refused_in_one_line(tmp_path, case, why):
    cfg = ModelConfig(hidden=16, layers=1, heads=2, ff=32, dropout=0.0)
    objective = "clm" if case == "causal" else "mlm"
    backbone = build_backbone(40, L, cfg, causal=case == "causal", documents=case == "packed")
    head = build_pretraining_model(backbone, objective, cfg).head
    model = build_pretrain_export_model(backbone, head, objective)
    with pytest.raises(UserError) as err:
        write_hf_checkpoint(model, _tokenizer("wordpiece"), tmp_path / "hf", _run_info())
    message = str(err.value)
    assert message.startswith(f"cannot export to transformers: {why}") and "\n" not in message
    assert not (tmp_path / "hf").exists() and not list(tmp_path.iterdir())


def test_export_checks_the_run_against_its_manifests(tiny_run, tmp_path, capsys):
    import shutil

    wd = tmp_path / "wd"
    shutil.copytree(tiny_run[0], wd, ignore=shutil.ignore_patterns("mlflow.db", "mlartifacts"))
    for rel in ("pretrain/pretrain_model.keras", "finetune/classifier.keras"):
        data = bytearray((wd / rel).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (wd / rel).write_bytes(bytes(data))
    hf, onnx = tmp_path / "hf", tmp_path / "m.onnx"
    assert main(["export", "--workdir", str(wd), "--format", "hf", "--out", str(hf)]) == 2
    err = capsys.readouterr().err.strip()
    assert "pretrain_model.keras" in err and "changed after the run wrote" in err
    assert main(["export", "--workdir", str(wd), "--format", "onnx", "--out", str(onnx)]) == 2
    err = capsys.readouterr().err.strip()
    assert "classifier.keras" in err and "does not match the sha256" in err
    assert len(err.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wd"]  # nothing written


# ------------------------------------------------------------------------------ ONNX


@pytest.mark.parametrize("norm, pooling, causal, documents, probe", [
    ("post", "mean", False, False, False),
    ("pre", "cls", False, False, False),
    ("post", "last", True, False, False),
    ("pre", "mean", False, True, False),
    ("pre", "mean", False, False, True),
])
def test_onnx_classifier_computes_our_logits(norm, pooling, causal, documents, probe):
    _need("onnx", "onnxruntime")
    from sklearn.linear_model import LogisticRegression

    from selfsup_model.serving.inference import probe_classifier
    from selfsup_model.serving.onnx_export import OnnxScorer, classifier_onnx
    from selfsup_model.text.specials import BOS_ID, EOS_ID
    from selfsup_model.transfer.classify import build_classifier

    cfg = ModelConfig(hidden=16, layers=2, heads=2, ff=32, dropout=0.1, norm=norm)
    backbone = build_backbone(50, L, cfg, causal=causal, documents=documents, seed=3)
    rng = np.random.default_rng(4)
    if probe:
        fit = LogisticRegression().fit(rng.normal(size=(30, 16)), np.arange(30) % 3)
        model = probe_classifier(backbone, pooling, fit, rng.normal(size=16),
                                 rng.uniform(0.5, 2, 16), ["0", "1", "2"])
    else:
        model = build_classifier(backbone, 3, pooling=pooling, dropout=0.1, seed=5)
    for w in model.weights:
        w.assign(w.numpy() + rng.normal(0, 0.05, w.shape).astype("float32"))
    start, end = (BOS_ID, EOS_ID) if causal else (CLS_ID, SEP_ID)
    ids = np.zeros((5, L), np.int32)
    for row, n in enumerate((L, 17, 9, 3, 12)):
        ids[row, :n] = rng.integers(7, 50, n)
        ids[row, 0], ids[row, n - 1] = start, end
    if documents:  # a row holding two documents: each attends within itself, positions restart
        ids[4, 6], ids[4, 7] = end, start
    expected = np.asarray(model(ids, training=False))
    got = OnnxScorer(classifier_onnx(model).SerializeToString())(ids, batch_size=2)
    assert np.abs(got - expected).max() < 1e-4


@pytest.fixture(scope="module")
def onnx_export(tiny_run, tmp_path_factory):
    """The tiny run's classifier exported with `selfsup export --format onnx`, and the run's
    test documents."""
    _need("onnx", "onnxruntime")
    wd, _, _ = tiny_run
    out = tmp_path_factory.mktemp("onnx") / "classifier.onnx"
    assert main(["export", "--workdir", str(wd), "--format", "onnx", "--out", str(out)]) == 0
    docs = pd.read_parquet(wd / "ingest" / "documents.parquet", columns=["id", "text"])
    assign = pd.read_parquet(wd / "split" / "assignments.parquet")
    test = docs[docs["id"].isin(assign.loc[assign["split"] == "test", "id"])]
    return wd, out, test.reset_index(drop=True)


def test_the_onnx_export_gives_the_keras_classifiers_probabilities(onnx_export):
    from selfsup_model.serving.inference import ClassifierBundle, load_run_classifier

    wd, out, test = onnx_export
    assert sorted(p.name for p in out.parent.iterdir()) == [
        "classifier.json", "classifier.onnx", "classifier.tokenizer.json"]
    spec = json.loads(out.with_suffix(".json").read_text())
    keras_bundle = load_run_classifier(wd)
    assert spec["classes"] == keras_bundle.classes and spec["encode"] == keras_bundle.spec["encode"]
    onnx_bundle = ClassifierBundle.load(out.parent, spec_file="classifier.json")
    assert onnx_bundle.engine == "onnx" and onnx_bundle.model is None
    texts = test["text"].tolist()
    want, kept = keras_bundle.predict_proba(texts)
    got, kept_onnx = onnx_bundle.predict_proba(texts)
    assert len(texts) > 10 and kept.tolist() == kept_onnx.tolist()
    assert np.abs(got - want).max() < 1e-4
    assert (got.argmax(1) == want.argmax(1)).all()


def test_predict_with_the_onnx_engine_writes_what_the_keras_engine_writes(onnx_export, tmp_path):
    wd, _, test = onnx_export
    table = tmp_path / "in.parquet"
    test.to_parquet(table)
    outs = {}
    for engine in ("keras", "onnx"):
        outs[engine] = tmp_path / f"{engine}.parquet"
        assert main(["predict", str(table), "--workdir", str(wd), "--out", str(outs[engine]),
                     "--engine", engine]) == 0
    keras_out, onnx_out = (pd.read_parquet(outs[e]) for e in ("keras", "onnx"))
    assert onnx_out["id"].tolist() == keras_out["id"].tolist()
    assert onnx_out["label"].tolist() == keras_out["label"].tolist()
    numbers = [c for c in keras_out.columns if c == "probability" or c.startswith("p_")]
    pd.testing.assert_frame_equal(onnx_out[numbers], keras_out[numbers], check_dtype=False,
                                  atol=1e-4)


def test_the_mlflow_model_can_carry_the_onnx_classifier(onnx_export, tmp_path):
    import mlflow
    from mlflow.tracking import MlflowClient

    from flows.model_registry import log_classifier
    from selfsup_model.serving.inference import load_run_classifier

    wd, _, test = onnx_export
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("export", str(tmp_path / "artifacts")))
    model_uri, version = log_classifier(uri, run.info.run_id, wd / "finetune", None,
                                        engine="onnx")
    assert version is None
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        model = mlflow.pyfunc.load_model(model_uri)
        got = model.predict(test[["text"]])
    finally:
        mlflow.set_tracking_uri(before)
    artifacts = {p.name for p in (tmp_path / "artifacts").rglob("*") if p.is_file()}
    assert {"classifier.onnx", "classifier.json"} <= artifacts
    assert "classifier.keras" not in artifacts
    probs, _ = load_run_classifier(wd).predict_proba(test["text"].tolist())
    classes = load_run_classifier(wd).classes
    np.testing.assert_allclose(got[[f"p_{c}" for c in classes]].to_numpy(), probs, atol=1e-4)

    # A serving process loads and scores it with neither Keras nor a backend installed or
    # imported: its requirements name ONNX Runtime instead.
    requirements = next((tmp_path / "artifacts").rglob("requirements.txt")).read_text()
    assert "onnxruntime==" in requirements
    assert "keras" not in requirements and "tensorflow" not in requirements
    code = ("import sys, mlflow, pandas as pd; mlflow.set_tracking_uri(sys.argv[1]); "
            "m = mlflow.pyfunc.load_model(sys.argv[2]); "
            "print(m.predict(pd.DataFrame({'text': [sys.argv[3]]}))['label'][0]); "
            "print(sorted({'keras', 'tensorflow', 'jax', 'torch'} & set(sys.modules)))")
    child = subprocess.run([sys.executable, "-c", code, uri, model_uri, test["text"][0]],
                           capture_output=True, text=True, timeout=120, check=False)
    assert child.returncode == 0, child.stderr[-3000:]
    label, imported = child.stdout.splitlines()[-2:]
    assert label == got["label"][0] and imported == "[]"
