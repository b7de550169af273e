"""`selfsup run` as two training processes on loopback (Keras' launch variables, JAX on CPU).

Both processes run the same command on one workdir. Process 0 is the run: it takes the lock,
runs every stage, and invites process 1 to the work they share: pretraining, then the neural
classifiers of finetune and baseline. Process 1 writes nothing and takes its share of every
batch; both end with the same trained and selected weights. A second run finds pretraining
up to date, so process 1 joins only the classifiers.

A one-process run of the same command on its own workdir, beside the pair, is the reference: the
pair's pretraining losses, every fine-tuning score (staged unfreezing included, dropout on, also
in pretraining), test predictions and the kept classifier's weights must be its own, to
1e-5: the token-weighted loss of a global batch split over two processes is the loss of the
whole batch.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from prefect.settings import PREFECT_API_URL

from tests.integration.servers import free_port
from tests.pretraining.jax_children import jax_env

pytestmark = pytest.mark.integration
BIN = Path(sys.executable).parent
DIGEST = re.compile(r"process (\d) of 2: trained weights sha256 (\w+)")
SELECTED = re.compile(r"process \d of 2: (\w+) selected weights sha256 (\w+)")


@pytest.fixture
def corpus(tmp_path) -> Path:
    rng = random.Random(5)
    vocab = [f"word{i}" for i in range(200)]
    rows = [{"id": f"d{i}", "text": " ".join(rng.choice(vocab) for _ in range(40)),
             "label": f"c{i % 2}"} for i in range(120)]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _command(corpus: Path, workdir: Path, *extra: str) -> list[str]:
    return [str(BIN / "selfsup"), "run", "--corpus", str(corpus), "--preset", "tiny",
            "--workdir", str(workdir), "--no-tracking", *DROPOUT, *extra]


def _finish(procs: list[subprocess.Popen]) -> list[str]:
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=420)[0])
    finally:
        for proc in procs:
            proc.kill()
    for i, (proc, log) in enumerate(zip(procs, logs)):
        assert proc.returncode == 0, f"process {i}:\n{log[-4000:]}"
    return logs


def _env() -> dict[str, str]:
    # One CPU device per process; the session's test Prefect API, not a temporary server each.
    return {**jax_env(), "PREFECT_API_URL": str(PREFECT_API_URL.value())}


def _start_pair(corpus: Path, workdir: Path, *extra: str) -> list[subprocess.Popen]:
    env = {**_env(), "KERAS_DISTRIBUTION_JOB_ADDRESSES": f"127.0.0.1:{free_port()}",
           "KERAS_DISTRIBUTION_NUM_PROCESSES": "2"}
    return [subprocess.Popen(_command(corpus, workdir, *extra),
                             env={**env, "KERAS_DISTRIBUTION_PROCESS_ID": str(i)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in (0, 1)]


# Dropout in pretraining too (the tiny preset has none there): each process must draw, for its
# slice of a batch, what the one-process run draws for it.
DROPOUT = ("--set", "model.dropout=0.1")
# The second run: one label fraction, staged unfreezing beside full fine-tuning; the
# sentence-embedding baseline is process 0's alone (tests/transfer cover it).
CLASSIFIERS = ("--set", "finetune.modes=[probe, full, staged]", "--set", "finetune.fractions=[1.0]",
               "--set", "baseline.sentence_embeddings=off")


def _losses(workdir: Path) -> list[float]:
    history = json.loads((workdir / "pretrain" / "history.json").read_text())
    return [e["train/mlm_loss"] for e in history if "train/mlm_loss" in e]


def _kept_weights(workdir: Path) -> list[np.ndarray]:
    from selfsup_model.nn.saving import load_keras_model

    return load_keras_model(workdir / "finetune" / "classifier.keras").get_weights()
def _scores(workdir: Path) -> dict[str, dict]:
    """Every classifier's validation scores over its grid, what it selected and kept (staged
    unfreezing's stages), without the times it measured."""
    out = {}
    for stage in ("finetune", "baseline"):
        for r in json.loads((workdir / stage / "results.json").read_text())["results"]:
            out[f"{r['method']}@{r['fraction']}"] = {
                k: v for k, v in r.items() if not k.endswith("time_s")}
    return out


def test_two_processes_share_one_run_and_train_like_one(corpus, tmp_path):
    if os.environ.get("SELFSUP_REQUIRE_JAX") != "1":
        pytest.importorskip("jax")
    workdir, alone = tmp_path / "wd", tmp_path / "alone"
    # The one-process reference runs beside the pair (the pair waits on each other, not on it).
    reference = subprocess.Popen(_command(corpus, alone, "--to", "baseline", *CLASSIFIERS),
                                 env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True)
    try:
        _pair_and_reference(corpus, workdir, alone, reference)
    finally:
        reference.kill()


def _pair_and_reference(corpus: Path, workdir: Path, alone: Path,
                        reference: subprocess.Popen) -> None:
    first = _finish(_start_pair(corpus, workdir, "--to", "pretrain"))
    digests = [DIGEST.findall(log) for log in first]
    assert [d[0][0] for d in digests] == ["0", "1"]
    assert digests[0][0][1] == digests[1][0][1]  # the replicas ended alike
    assert "joined process 0 in pretrain\n" in first[1]
    assert "pretraining: data-parallel over 2 devices" in first[0]
    assert (workdir / "pretrain" / "manifest.json").is_file()
    assert (workdir / "pretrain" / "encoder.keras").is_file()
    # A multi-process pretraining writes no mid-run checkpoints (a one-process run keeps its last).
    assert not list((workdir / "pretrain" / "checkpoints").glob("ckpt-*.keras"))

    again = _finish(_start_pair(corpus, workdir, "--to", "baseline", *CLASSIFIERS))
    assert not DIGEST.findall(again[0] + again[1])  # pretraining was up to date
    assert "joined process 0 in finetune, baseline\n" in again[1]
    assert "fine-tuning: data-parallel over 2 devices" in again[0]
    selected = [dict(SELECTED.findall(log)) for log in again]
    assert set(selected[0]) == {"pretrained_full", "pretrained_staged", "random_init",
                                "bag_of_embeddings"}
    assert selected[0] == selected[1]  # both processes selected the same weights
    assert (workdir / "baseline" / "manifest.json").is_file()

    # The pair trained what one process trains.
    reference_log = _finish([reference])[0]
    assert "data-parallel" not in reference_log
    assert list((alone / "pretrain" / "checkpoints").glob("ckpt-*.keras"))
    assert len(_losses(alone)) == len(_losses(workdir)) > 1
    assert _losses(workdir) == pytest.approx(_losses(alone), abs=1e-5)
    ours, theirs = _scores(workdir), _scores(alone)
    assert sorted(ours) == sorted(theirs)
    assert len(theirs["pretrained_staged@1.0"]["stages"]) == 3  # head, top block, all
    for key, row in theirs.items():
        assert ours[key]["val_macro_f1"] == pytest.approx(row["val_macro_f1"], abs=1e-5), key
        for got, want in zip(ours[key].get("grid", []), row.get("grid", []), strict=True):
            assert got["val_macro_f1"] == pytest.approx(want["val_macro_f1"], abs=1e-5), key
            got["val_macro_f1"] = want["val_macro_f1"]
        ours[key]["val_macro_f1"] = row["val_macro_f1"]
        assert ours[key] == row, key  # the same selections, stages and update counts
    for stage in ("finetune", "baseline"):
        predictions = [pd.read_parquet(wd / stage / "predictions.parquet")
                       for wd in (workdir, alone)]
        pd.testing.assert_frame_equal(*predictions)  # the same test predictions
    kept = [_kept_weights(wd) for wd in (workdir, alone)]
    assert len(kept[0]) == len(kept[1]) > 10
    for got, want in zip(*kept):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
