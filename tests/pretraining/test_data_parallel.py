"""Data-parallel training under JAX: two devices give the one-device results.

The child process forces two host devices (XLA_FLAGS) and pretrains the same tiny model twice
from the same seed: once on one device (SELFSUP_DATA_PARALLEL=off) and once under Keras'
`DataParallel` (each device holds half of every batch of 8). The token-weighted loss is
total weighted loss over total scored tokens of the global batch, so every logged training
loss and the validation loss must agree to 1e-5. Fine-tuning (the protocol's grid over
pretrained_full and random_init, and the frozen probe's features) likewise: every validation
score, every test prediction and the selected classifiers' weights. One child does both (a
JAX process's start is a good part of its time).

Two processes joined on loopback train like one: tests/integration/test_training_processes.py,
through `selfsup run`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.pretraining.jax_children import ROOT, jax_env

# A tiny pretraining problem, pretrained once on one device and once over two.
_PRETRAIN = textwrap.dedent("""
    import json, logging, os, sys, tempfile
    import numpy as np
    from selfsup_model.config import MaskingConfig, ModelConfig, PretrainConfig
    from selfsup_model.errors import UserError
    from selfsup_model.text.masking import make_static_masks
    from selfsup_model.pretraining.devices import data_parallel
    from selfsup_model.pretraining.loop import pretrain

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    rng = np.random.default_rng(0)
    windows = rng.integers(7, 40, size=(64, 16)).astype(np.int32)
    windows[:, 0], windows[:, -1] = 2, 3
    masks = MaskingConfig(max_predictions=4)
    val = make_static_masks(windows[:11], masks, 40, seed=0)  # 11: an uneven last batch
    cfg = PretrainConfig(batch_size=8, steps=6, warmup_steps=1, log_every=1, eval_every=3,
                         checkpoint_every=3)
    model = ModelConfig(hidden=16, layers=1, heads=2, ff=32, dropout=0.0)
    pretrained = {}
    for mode in ("off", "auto"):
        os.environ["SELFSUP_DATA_PARALLEL"] = mode
        wd = tempfile.mkdtemp()
        result = pretrain(windows, val, 40, model, cfg, masks, wd, progress=False)
        history = json.load(open(f"{wd}/history.json"))
        pretrained[mode] = {"train": [e["train/mlm_loss"] for e in history
                                      if "train/mlm_loss" in e],
                            "val": result.val_metrics["val/mlm_loss"]}
    try:
        data_parallel(7)
    except UserError as exc:
        pretrained["uneven"] = str(exc)
""")

# A tiny labelled problem and a small saved encoder, fine-tuned and trained afresh over the
# protocol's grid, and read by the frozen probe; on one device, then over two.
_FINETUNE = textwrap.dedent("""
    import keras
    from selfsup_model.nn.model import build_backbone
    from selfsup_model.config import FinetuneConfig
    from selfsup_model.transfer.protocol import (LabelledData, LabelledSplit, NeuralMethod,
                                                 frozen_probe, train_neural_methods)
    from tests.library.toy import make_docs

    keras.utils.set_random_seed(0)
    path = os.path.join(tempfile.mkdtemp(), "encoder.keras")
    build_backbone(20, 8, ModelConfig(hidden=8, layers=2, heads=2, ff=16, dropout=0.1,
                                      norm="pre")).save(path)
    load = lambda: keras.saving.load_model(path, safe_mode=True)
    docs = {s: make_docs(n, k) for s, n, k in (("train", 48, 0), ("val", 13, 1), ("test", 11, 2))}
    splits = {s: LabelledSplit(np.array([f"{s}{i}" for i in range(len(y))]),
                               np.where(y == 1, "b", "a"), ids) for s, (ids, y) in docs.items()}
    data = LabelledData(["a", "b"], splits, {}, 8)
    cfg = FinetuneConfig(batch_size=8, eval_batch_size=8, fractions=(1.0,), epochs=2,
                         min_updates=6, max_updates=12, evals=3, learning_rates=(1e-3, 3e-3),
                         dropout=0.1, encoder_dropout=0.1)
    methods = [NeuralMethod("pretrained_full", "full", load),
               NeuralMethod("random_init", "scratch", load)]
    finetuned = {}
    for mode in ("off", "auto"):
        os.environ["SELFSUP_DATA_PARALLEL"] = mode
        results, kept = train_neural_methods(data, methods, cfg)
        probe, _ = frozen_probe("pretrained_probe", data, load, cfg)
        finetuned[mode] = {
            "grid": [g["val_macro_f1"] for s in results.summaries for g in s["grid"]],
            "rows": [list(map(str, r)) for r in results.rows + probe.rows],
            "weights": [float(np.abs(w).sum()) for m in kept.values()
                        for w in m.model.get_weights()]}
    print("RESULT", json.dumps({"pretrained": pretrained, "finetuned": finetuned}))
""")


def test_data_parallel_pretraining_and_fine_tuning_match_one_device():
    if os.environ.get("SELFSUP_REQUIRE_JAX") != "1":  # CI installs the jax extra and sets it
        pytest.importorskip("jax")
    proc = subprocess.run([sys.executable, "-c", _PRETRAIN + _FINETUNE], cwd=ROOT,
                          env=jax_env(devices=2), capture_output=True, text=True, timeout=400,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])

    # pretraining: the second run really was split
    assert "pretraining: data-parallel over 2 devices" in proc.stderr
    one, two = out["pretrained"]["off"], out["pretrained"]["auto"]
    assert len(one["train"]) == 6
    assert two["train"] == pytest.approx(one["train"], abs=1e-5)
    assert two["val"] == pytest.approx(one["val"], abs=1e-5)
    assert "does not divide over 2 devices" in out["pretrained"]["uneven"]

    # fine-tuning and the frozen probe's features
    assert "fine-tuning: data-parallel over 2 devices" in proc.stderr
    assert "frozen features: data-parallel over 2 devices" in proc.stderr
    one, two = out["finetuned"]["off"], out["finetuned"]["auto"]
    assert len(one["grid"]) == 2 * 2 and len(one["weights"]) > 10  # methods x rates
    assert two["grid"] == pytest.approx(one["grid"], abs=1e-5)
    assert two["rows"] == one["rows"]
    assert two["weights"] == pytest.approx(one["weights"], rel=1e-5, abs=1e-5)
