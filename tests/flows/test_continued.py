"""Continued pretraining: run B starts from run A's encoder and keeps A's tokenizer; a checkpoint
that does not fit is refused with the reason."""

import json
import shutil

import keras
import numpy as np
import pandas as pd
import pytest

from flows.pipeline import run_pipeline
from selfsup_model.artifacts import StageManifest
from selfsup_model.errors import ArtifactError, UserError
from selfsup_model.nn.saving import load_keras_model
from selfsup_model.presets import build_config
from selfsup_model.pretraining.continued import check_compatible, lineage, resolve_init_source

# Another corpus than the tiny run's (email, xml, unittest): other standard-library docstrings.
OTHER = ["ingest.pydocs_libraries=[json, logging, http]"]
UP_TO_TOKENIZER = ["ingest", "dedup", "split", "tokenizer"]
UP_TO_PRETRAIN = [*UP_TO_TOKENIZER, "encode", "masks", "pretrain"]


def _shingles(text: str) -> set[str]:
    """Character 5-grams of the folded text, as the dedup settings say (an independent
    recomputation: no hashing, no LSH)."""
    folded = " ".join(text.lower().split())
    return {folded[i:i + 5] for i in range(max(len(folded) - 4, 1))}


def _brute_force_leaks(run, lineage_runs, threshold=0.5) -> set[tuple[str, str]]:
    """(this run's val/test id, the lineage run) for every held-out document at exact Jaccard
    >= threshold with some training document of that lineage run."""
    def split_of(wd):
        docs = pd.read_parquet(wd / "ingest" / "documents.parquet", columns=["id", "text"])
        return docs.merge(pd.read_parquet(wd / "split" / "assignments.parquet"), on="id")

    mine = split_of(run)
    held = [(i, _shingles(t)) for i, t in mine.loc[mine["split"] != "train", ["id", "text"]]
            .itertuples(index=False)]
    found = set()
    for source in lineage_runs:
        theirs = split_of(source)
        train = [_shingles(t) for t in theirs.loc[theirs["split"] == "train", "text"]]
        found |= {(i, str(source.resolve())) for i, a in held
                  if any(len(a & b) >= threshold * len(a | b) for b in train)}
    return found


def _weights(path):
    return load_keras_model(path).get_weights()


def test_run_b_continues_run_a_with_its_tokenizer(tiny_run, tmp_path):
    a, _, _ = tiny_run
    # A rate of ~0: B's encoder must come out as A's, which proves where B started from.
    # B computes in mixed bf16 where A computed in float32: B's own precision wins.
    cfg = build_config("tiny", overrides=[*OTHER, f"pretrain.init_from={a}",
                                          "pretrain.learning_rate=1e-12",
                                          "pretrain.mixed_precision=bf16"])
    b = tmp_path / "b"
    results = {r.stage: r for r in run_pipeline(cfg, "pydocs", workdir=str(b),
                                                stages=UP_TO_PRETRAIN, tracking=False)}
    assert (b / "tokenizer" / "tokenizer.json").read_bytes() == \
        (a / "tokenizer" / "tokenizer.json").read_bytes()
    assert results["tokenizer"].counts["reused_from"] == str(a.resolve())
    assert str(a.resolve()) in results["pretrain"].counts["initialised_from"]
    for mine, theirs in zip(_weights(b / "pretrain" / "encoder.keras"),
                            _weights(a / "pretrain" / "encoder.keras")):
        np.testing.assert_allclose(mine, theirs, atol=1e-6)
    policies = {run.name: {layer.dtype_policy.name
                           for layer in load_keras_model(run / "pretrain" / "encoder.keras").layers
                           if layer.name not in ("input_ids", "padding_mask")}
                for run in (a, b)}
    assert policies == {a.name: {"float32"}, "b": {"mixed_bfloat16"}}, policies
    # Its documents really are another corpus: none of B's val/test is a near-copy of A's train.
    assert results["ingest"].counts["kept"] > 0
    tok = results["tokenizer"].counts
    assert tok["source_audit_passed"] and tok["source_leaking_documents"] == 0
    assert tok["source_documents_checked"] > 0
    a_train = pd.read_parquet(a / "split" / "assignments.parquet")["split"].eq("train").sum()
    assert tok["source_train_documents"] == a_train

    # C continues B on A's corpus, split another way: B's encoder carries A's pretraining, so
    # C's val/test documents that were A's train leak through B, and only through A.
    c = tmp_path / "c"
    cfg = build_config("tiny", overrides=[f"pretrain.init_from={b}", "split.seed=8",
                                          "split.audit_action=warn"])
    tok = {r.stage: r for r in run_pipeline(cfg, "pydocs", workdir=str(c), stages=UP_TO_TOKENIZER,
                                            tracking=False)}["tokenizer"].counts
    audit = json.loads((c / "tokenizer" / "source_audit.json").read_text())
    assert audit["lineage"] == [str(b.resolve()), str(a.resolve())]
    assert {e["source_run"] for e in audit["examples"]} == {str(a.resolve())}
    expected = _brute_force_leaks(c, [b, a])
    assert {run for _, run in expected} == {str(a.resolve())}
    assert tok["source_leaking_documents"] == len(expected) > 0
    assert not tok["source_audit_passed"]


def test_a_lineage_that_pretrained_on_this_runs_test_set_is_refused(tiny_run, tmp_path):
    a, _, _ = tiny_run
    # The same corpus split the same way: A never pretrained on its own val/test.
    same = build_config("tiny", overrides=[f"pretrain.init_from={a}"])
    tok = {r.stage: r for r in run_pipeline(same, "pydocs", workdir=str(tmp_path / "same"),
                                            stages=UP_TO_TOKENIZER, tracking=False)}
    assert tok["tokenizer"].counts["source_leaking_documents"] == 0
    # The check's settings are the tokenizer stage's parameters when continuing: the same
    # settings skip it, another audit_action reruns it (the split's bytes did not change).
    again = {r.stage: r.status for r in run_pipeline(same, "pydocs", workdir=str(tmp_path / "same"),
                                                     stages=UP_TO_TOKENIZER, tracking=False)}
    assert again["tokenizer"] == "skipped"
    warn = same.model_copy(update={"split": same.split.model_copy(update={"audit_action": "warn"})})
    again = {r.stage: r.status for r in run_pipeline(warn, "pydocs", workdir=str(tmp_path / "same"),
                                                     stages=UP_TO_TOKENIZER, tracking=False)}
    assert again == {"ingest": "skipped", "dedup": "skipped", "split": "ran", "tokenizer": "ran"}
    # Split another way, documents A trained on land in this run's val/test.
    other = build_config("tiny", overrides=[f"pretrain.init_from={a}", "split.seed=8"])
    with pytest.raises(UserError, match="val/test document.* are near-copies .* the encoder this "
                                        "run continues was pretrained on"):
        run_pipeline(other, "pydocs", workdir=str(tmp_path / "other"), stages=UP_TO_TOKENIZER,
                     tracking=False)
    warned = other.model_copy(update={"split": other.split.model_copy(
        update={"audit_action": "warn"})})
    tok = {r.stage: r for r in run_pipeline(warned, "pydocs", workdir=str(tmp_path / "other"),
                                            stages=UP_TO_TOKENIZER, tracking=False)}
    expected = _brute_force_leaks(tmp_path / "other", [a])
    assert tok["tokenizer"].counts["source_leaking_documents"] == len(expected) > 0


def _tokenizer_manifest(run, reused_from):
    (run / "tokenizer").mkdir(parents=True)
    StageManifest("tokenizer", "test", {}, {}, {}, {"reused_from": str(reused_from or "")}
                  ).write(run / "tokenizer")


def test_lineage_follows_each_run_back_and_stops_where_it_cannot(tmp_path):
    a, b, c = (tmp_path / name for name in "abc")
    _tokenizer_manifest(a, None)
    _tokenizer_manifest(b, a)
    _tokenizer_manifest(c, b)
    assert lineage(c) == ([c, b, a], None)
    gone = tmp_path / "gone"
    _tokenizer_manifest(tmp_path / "d", gone)
    runs, why = lineage(tmp_path / "d")
    assert runs == [tmp_path / "d"] and str(gone) in why and "no finished tokenizer" in why
    _tokenizer_manifest(tmp_path / "x", tmp_path / "y")
    _tokenizer_manifest(tmp_path / "y", tmp_path / "x")
    with pytest.raises(UserError, match="form a cycle"):
        lineage(tmp_path / "x")


def test_a_checkpoint_that_does_not_fit_is_refused(tiny_run, tmp_path):
    a, _, _ = tiny_run
    encoder = a / "pretrain" / "encoder.keras"
    cfg = build_config("tiny", overrides=[*OTHER, f"pretrain.init_from={encoder}",
                                          "model.hidden=32"])
    with pytest.raises(UserError, match=r"model.hidden=32 \(checkpoint: 16\)"):
        run_pipeline(cfg, "pydocs", workdir=str(tmp_path / "c"), stages=UP_TO_PRETRAIN,
                     tracking=False)
    source = resolve_init_source(str(a))
    backbone = load_keras_model(source.pretrain_model).backbone
    fits = {"max_len": 32, "causal": False, "source": source,
            "model_cfg": cfg.model.model_copy(update={"hidden": 16})}
    vocab = keras.ops.shape(backbone.get_layer("embeddings").embeddings)[0]
    with pytest.raises(UserError, match="tokenizer .* is not the one"):
        check_compatible(backbone, **{**fits, "vocab_size": vocab}, tokenizer_sha256="0" * 64)
    with pytest.raises(UserError, match="do not belong together"):
        check_compatible(backbone, **{**fits, "vocab_size": vocab + 1},
                         tokenizer_sha256=source.tokenizer_sha256)
    with pytest.raises(UserError, match="objective"):
        check_compatible(backbone, **{**fits, "vocab_size": vocab, "causal": True},
                         tokenizer_sha256=source.tokenizer_sha256)
    # The objective head continues too: a tied head cannot load into an untied one.
    with pytest.raises(UserError, match=r"model.tie_embeddings=False \(checkpoint: True\)"):
        check_compatible(backbone, **{**fits, "vocab_size": vocab,
                                      "model_cfg": fits["model_cfg"].model_copy(
                                          update={"tie_embeddings": False})},
                         tokenizer_sha256=source.tokenizer_sha256, head_tied=True)
    with pytest.raises(UserError, match="neither a selfsup workdir"):
        resolve_init_source(str(tmp_path / "nowhere"))


def test_a_source_file_changed_after_its_run_is_never_read(tiny_run, tmp_path):
    a, _, _ = tiny_run
    source = tmp_path / "copy"
    for stage in ("ingest", "split", "tokenizer", "pretrain"):
        shutil.copytree(a / stage, source / stage)
    with open(source / "split" / "assignments.parquet", "ab") as fh:
        fh.write(b"\0")  # edited after its run recorded it
    cfg = build_config("tiny", overrides=[f"pretrain.init_from={source}"])
    with pytest.raises(ArtifactError, match=r"assignments.parquet is missing or no longer matches"):
        run_pipeline(cfg, "pydocs", workdir=str(tmp_path / "c"), stages=UP_TO_TOKENIZER,
                     tracking=False)
