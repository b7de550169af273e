"""`selfsup run` as two training processes on loopback (Keras' launch variables, JAX on CPU).

Both processes run the same command on one workdir. Process 0 is the run: it takes the lock,
runs every stage, and invites process 1 to the work they share: pretraining, then the neural
classifiers of finetune and baseline. Process 1 writes nothing and takes its share of every
batch; both end with the same trained and selected weights. A second run finds pretraining
up to date, so process 1 joins only the classifiers.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

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


def _run_pair(corpus: Path, workdir: Path, *extra: str) -> list[str]:
    # One CPU device per process; the session's test Prefect API, not a temporary server each.
    env = {**jax_env(), "PREFECT_API_URL": str(PREFECT_API_URL.value()),
           "KERAS_DISTRIBUTION_JOB_ADDRESSES": f"127.0.0.1:{free_port()}",
           "KERAS_DISTRIBUTION_NUM_PROCESSES": "2"}
    procs = [subprocess.Popen(
        [str(BIN / "selfsup"), "run", "--corpus", str(corpus), "--preset", "tiny",
         "--workdir", str(workdir), "--no-tracking", *extra],
        env={**env, "KERAS_DISTRIBUTION_PROCESS_ID": str(i)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
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


def test_two_processes_share_one_run(corpus, tmp_path):
    if os.environ.get("SELFSUP_REQUIRE_JAX") != "1":
        pytest.importorskip("jax")
    workdir = tmp_path / "wd"
    first = _run_pair(corpus, workdir, "--to", "pretrain")
    digests = [DIGEST.findall(log) for log in first]
    assert [d[0][0] for d in digests] == ["0", "1"]
    assert digests[0][0][1] == digests[1][0][1]  # the replicas ended alike
    assert "joined process 0 in pretrain\n" in first[1]
    assert "pretraining: data-parallel over 2 devices" in first[0]
    assert (workdir / "pretrain" / "manifest.json").is_file()
    assert (workdir / "pretrain" / "encoder.keras").is_file()

    # The library test covers staged mode and several fractions; here one of each suffices. The
    # sentence-embedding baseline is process 0's alone (tests/transfer cover it).
    again = _run_pair(corpus, workdir, "--to", "baseline", "--set", "finetune.modes=[probe, full]",
                      "--set", "finetune.fractions=[1.0]",
                      "--set", "baseline.sentence_embeddings=off")
    assert not DIGEST.findall(again[0] + again[1])  # pretraining was up to date
    assert "joined process 0 in finetune, baseline\n" in again[1]
    assert "fine-tuning: data-parallel over 2 devices" in again[0]
    selected = [dict(SELECTED.findall(log)) for log in again]
    assert set(selected[0]) == {"pretrained_full", "random_init", "bag_of_embeddings"}
    assert selected[0] == selected[1]  # both processes selected the same weights
    results = json.loads((workdir / "finetune" / "results.json").read_text())["results"]
    assert {r["method"] for r in results} >= {"pretrained_full", "pretrained_probe"}
    assert (workdir / "baseline" / "manifest.json").is_file()
