"""Continued pretraining: run B starts from run A's encoder and keeps A's tokenizer; a checkpoint
that does not fit is refused with the reason."""

import keras
import numpy as np
import pytest

from flows.pipeline import run_pipeline
from selfsup_model.continued import check_compatible, resolve_init_source
from selfsup_model.errors import UserError
from selfsup_model.presets import build_config
from selfsup_model.saving import load_keras_model

# Another corpus than the tiny run's (email, xml, unittest): other standard-library docstrings.
OTHER = ["ingest.pydocs_libraries=[json, logging, http]"]
UP_TO_PRETRAIN = ["ingest", "dedup", "split", "tokenizer", "encode", "masks", "pretrain"]


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
    # Its documents really are another corpus.
    assert results["ingest"].counts["kept"] > 0


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
