"""Data-parallel training under JAX: two devices give the one-device results.

The child process forces two host devices (XLA_FLAGS) and pretrains the same tiny model twice
from the same seed: once on one device (SELFSUP_DATA_PARALLEL=off) and once under Keras'
`DataParallel` (each device holds half of every batch of 8). The token-weighted loss is
total weighted loss over total scored tokens of the global batch, so every logged training
loss and the validation loss must agree to 1e-5. Fine-tuning (the protocol's grid over
pretrained_full and random_init, and the frozen probe's features) likewise: every validation
score, every test prediction and the selected classifiers' weights.

Two processes joined on loopback (one CPU device each) pretrain and then fine-tune together,
and end with the one-process run's results.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.pretraining.jax_children import ROOT, jax_env

# A tiny pretraining problem; `model` has the dropout given by DROPOUT.
_PRETRAIN_SETUP = textwrap.dedent("""
    import json, logging, os, sys, tempfile
    import numpy as np
    from selfsup_model.config import MaskingConfig, ModelConfig, PretrainConfig
    from selfsup_model.text.masking import make_static_masks
    from selfsup_model.pretraining.loop import pretrain

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    rng = np.random.default_rng(0)
    windows = rng.integers(7, 40, size=(64, 16)).astype(np.int32)
    windows[:, 0], windows[:, -1] = 2, 3
    masks = MaskingConfig(max_predictions=4)
    val = make_static_masks(windows[:11], masks, 40, seed=0)  # 11: an uneven last batch
    cfg = PretrainConfig(batch_size=8, steps=6, warmup_steps=1, log_every=1, eval_every=3,
                         checkpoint_every=3)
    model = ModelConfig(hidden=16, layers=1, heads=2, ff=32, dropout=DROPOUT)
""")

_CHILD = _PRETRAIN_SETUP.replace("DROPOUT", "0.0") + textwrap.dedent("""
    from selfsup_model.pretraining.devices import data_parallel
    from selfsup_model.errors import UserError

    out = {}
    for mode in ("off", "auto"):
        os.environ["SELFSUP_DATA_PARALLEL"] = mode
        wd = tempfile.mkdtemp()
        result = pretrain(windows, val, 40, model, cfg, masks, wd, progress=False)
        history = json.load(open(f"{wd}/history.json"))
        out[mode] = {"train": [e["train/mlm_loss"] for e in history if "train/mlm_loss" in e],
                     "val": result.val_metrics["val/mlm_loss"]}
    try:
        data_parallel(7)
    except UserError as exc:
        out["uneven"] = str(exc)
    print("RESULT", json.dumps(out))
""")


def test_data_parallel_pretraining_matches_one_device():
    if os.environ.get("SELFSUP_REQUIRE_JAX") != "1":  # CI installs the jax extra and sets it
        pytest.importorskip("jax")
    env = jax_env(devices=2)
    proc = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the second run really was split
    assert "pretraining: data-parallel over 2 devices" in proc.stderr
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    one, two = out["off"], out["auto"]
    assert len(one["train"]) == 6
    assert two["train"] == pytest.approx(one["train"], abs=1e-5)
    assert two["val"] == pytest.approx(one["val"], abs=1e-5)
    assert "does not divide over 2 devices" in out["uneven"]


# A tiny labelled problem and a small saved encoder; `methods` fine-tune it and train it afresh.
_FINETUNE_SETUP = textwrap.dedent("""
    import json, logging, os, sys, tempfile
    import keras
    import numpy as np
    from selfsup_model.config import FinetuneConfig, ModelConfig
    from selfsup_model.nn.model import build_backbone
    from selfsup_model.transfer.protocol import (LabelledData, LabelledSplit, NeuralMethod,
                                                 frozen_probe, train_neural_methods)
    from selfsup_model.pretraining.devices import join_processes
    from tests.library.toy import make_docs

    join_processes()  # several processes (the launch variables) join before any computation
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    keras.utils.set_random_seed(0)
    path = os.path.join(tempfile.mkdtemp(), "encoder.keras")  # each process its own copy
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
""")

_FINETUNE_CHILD = _FINETUNE_SETUP + textwrap.dedent("""
    out = {}
    for mode in ("off", "auto"):
        os.environ["SELFSUP_DATA_PARALLEL"] = mode
        results, kept = train_neural_methods(data, methods, cfg)
        probe, _ = frozen_probe("pretrained_probe", data, load, cfg)
        out[mode] = {
            "grid": [g["val_macro_f1"] for s in results.summaries for g in s["grid"]],
            "rows": [list(map(str, r)) for r in results.rows + probe.rows],
            "weights": [float(np.abs(w).sum()) for m in kept.values()
                        for w in m.model.get_weights()]}
    print("RESULT", json.dumps(out))
""")


def test_data_parallel_fine_tuning_matches_one_device():
    if os.environ.get("SELFSUP_REQUIRE_JAX") != "1":
        pytest.importorskip("jax")
    env = jax_env(devices=2)
    proc = subprocess.run([sys.executable, "-c", _FINETUNE_CHILD], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fine-tuning: data-parallel over 2 devices" in proc.stderr
    assert "frozen features: data-parallel over 2 devices" in proc.stderr
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    one, two = out["off"], out["auto"]
    assert len(one["grid"]) == 2 * 2 and len(one["weights"]) > 10  # methods x rates
    assert two["grid"] == pytest.approx(one["grid"], abs=1e-5)
    assert two["rows"] == one["rows"]
    assert two["weights"] == pytest.approx(one["weights"], rel=1e-5, abs=1e-5)


# Pretrain into argv[1], then fine-tune a small saved encoder, full and staged, over the grid.
_PROCESS_CHILD = _PRETRAIN_SETUP.replace("DROPOUT", "0.1") + textwrap.dedent("""
    result = pretrain(windows, val, 40, model, cfg, masks, sys.argv[1], progress=False)
    pretrain_val = None if result is None else result.val_metrics["val/mlm_loss"]
""") + _FINETUNE_SETUP + textwrap.dedent("""
    from selfsup_model.artifacts import sha256_arrays

    methods = [methods[0], NeuralMethod("pretrained_staged", "staged", load)]
    results, kept = train_neural_methods(data, methods, cfg)
    print("RESULT", json.dumps({
        "pretrain_val": pretrain_val,
        "grid": [g["val_macro_f1"] for s in results.summaries for g in s["grid"]],
        "stages": [[st["kept"] for st in s.get("stages", [])] for s in results.summaries],
        "rows": [list(map(str, r)) for r in results.rows],
        "weights": [float(np.abs(w).sum()) for m in kept.values() for w in m.model.get_weights()],
        "digests": [sha256_arrays(m.model.get_weights()) for m in kept.values()]}))
""")


def test_two_training_processes_on_loopback_train_like_one(tmp_path):
    """Two processes joined through Keras' launch variables (one CPU device each, dropout 0.1)
    pretrain together: both end with the same weights, process 0 alone writes, and its losses
    are the one-process run's. Then they fine-tune together, full and staged, over the
    protocol's grid: both return the same results and selected weights, and those are the
    one-process run's (scores and weights to 1e-5, identical test predictions)."""
    if os.environ.get("SELFSUP_REQUIRE_JAX") != "1":
        pytest.importorskip("jax")
    from tests.integration.servers import free_port

    env = jax_env()
    address = f"127.0.0.1:{free_port()}"
    joined = {**env, "KERAS_DISTRIBUTION_JOB_ADDRESSES": address,
              "KERAS_DISTRIBUTION_NUM_PROCESSES": "2"}
    # The one-process reference runs beside the pair: the pair waits on each other, not on it.
    runs = [("alone", env), *((f"process{i}", {**joined, "KERAS_DISTRIBUTION_PROCESS_ID": str(i)})
                              for i in (0, 1))]
    procs = [subprocess.Popen([sys.executable, "-c", _PROCESS_CHILD, str(tmp_path / name)],
                              cwd=ROOT, env=run_env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for name, run_env in runs]
    results = []
    try:
        for proc in procs:
            results.append(proc.communicate(timeout=400))
    finally:
        for proc in procs:
            proc.kill()
    for proc, (_, err) in zip(procs, results):
        assert proc.returncode == 0, err[-3000:]
    one, first, second = (json.loads(out.split("RESULT ", 1)[1]) for out, _ in results)
    outs = results[1:]

    # pretraining
    digests = [re.findall(r"process (\d) of 2: trained weights sha256 (\w+)", err)
               for _, err in outs]
    assert [d[0][0] for d in digests] == ["0", "1"]
    assert digests[0][0][1] == digests[1][0][1]  # the replicas did not drift apart
    assert "pretraining: data-parallel over 2 devices" in outs[0][1]
    assert not (tmp_path / "process1").exists()  # only process 0 writes
    assert second["pretrain_val"] is None

    def losses(wd: Path) -> list[float]:
        history = json.loads((wd / "history.json").read_text())
        return [e["train/mlm_loss"] for e in history if "train/mlm_loss" in e]

    assert len(losses(tmp_path / "alone")) == 6
    assert losses(tmp_path / "process0") == pytest.approx(losses(tmp_path / "alone"), abs=1e-5)
    assert first["pretrain_val"] == pytest.approx(one["pretrain_val"], abs=1e-5)
    assert (tmp_path / "process0" / "encoder.keras").is_file()
    assert not list((tmp_path / "process0" / "checkpoints").glob("ckpt-*.keras"))

    # fine-tuning
    assert "fine-tuning: data-parallel over 2 devices" in outs[0][1]
    del first["pretrain_val"], second["pretrain_val"]
    assert first == second  # the processes took the same branches and ended alike
    assert len(one["grid"]) == 2 * 2 and len(one["digests"]) == 2  # methods x rates
    assert [len(st) for st in one["stages"]] == [0, 3]  # staged: head, top, all
    assert first["stages"] == one["stages"]
    assert first["grid"] == pytest.approx(one["grid"], abs=1e-5)
    assert first["rows"] == one["rows"]
    assert first["weights"] == pytest.approx(one["weights"], rel=1e-5, abs=1e-5)
