"""Sharded stages (ingest, dedup, encode) on Dask give the bytes the in-process run gives.

1. A 2-worker `LocalCluster` (what `--executor dask` starts) with 1 and 7 shards: the
   artifacts are byte-identical to the in-process run, and a change of executor or shard
   count does not make a stage stale.
2. An existing scheduler by address: a separately started `dask scheduler` and `dask worker`,
   with a real `prefect server` as the API of the CLI run and of the worker; the shard tasks
   show up as completed task runs on that server and were executed by that worker.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from flows.executors import Sharding
from flows.pipeline import run_pipeline
from selfsup_model.presets import build_config
from tests.integration.servers import free_port, stop_group, wait_ready

pytestmark = pytest.mark.integration
BIN = Path(sys.executable).parent
SHARDED = {"ingest": ("documents.parquet", "rejects.parquet"),
           "dedup": ("clusters.parquet", "near_pairs.parquet", "signatures.npy"),
           "encode": tuple(f"{split}_{name}" for split in ("train", "val", "test")
                           for name in ("windows.npy", "doc_offsets.npy", "kept.npy",
                                        "docs.parquet")) + ("rejects.parquet",)}
UP_TO_ENCODE = ["ingest", "dedup", "split", "tokenizer", "encode"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A labelled table of 240 documents: templated texts with near copies and copies that
    differ only in case."""
    rng = random.Random(3)
    vocab = [f"term{i}" for i in range(300)]
    bases = [[rng.choice(vocab) for _ in range(50)] for _ in range(40)]
    rows = []
    for i in range(240):
        label = i % 2
        words = list(bases[rng.randrange(20) + 20 * label])
        for _ in range(rng.choice([0, 1, 2, 4, 30])):
            words[rng.randrange(len(words))] = rng.choice(vocab)
        text = " ".join(words)  # ingest drops verbatim copies; dedup folds case
        if i % 9 == 1:
            text = rows[-1]["text"].upper()
        if i % 37 == 5:  # ingest rejects these
            text = " \t " if i % 2 else "short"
        rows.append({"id": f"doc{i}", "text": text, "label": f"class{label}"})
    path = tmp_path_factory.mktemp("dask-corpus") / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _sharded_bytes(wd: Path) -> dict[str, bytes]:
    return {f"{stage}/{name}": (wd / stage / name).read_bytes()
            for stage, names in SHARDED.items() for name in names}


@pytest.fixture(scope="module")
def in_process(corpus, tmp_path_factory) -> tuple[Path, dict[str, bytes]]:
    """One in-process run up to encode: its workdir, and the sharded stages' bytes that every
    executor must give."""
    wd = tmp_path_factory.mktemp("in-process") / "wd"
    first = run_pipeline(build_config("tiny"), str(corpus), workdir=str(wd), stages=UP_TO_ENCODE,
                         tracking=False)
    assert first[0].counts["rejected_empty"] > 0 and first[0].counts["rejected_too_short"] > 0
    assert first[1].counts["near_duplicates"] > 0 and first[1].counts["exact_duplicates"] > 0
    return wd, _sharded_bytes(wd)


def test_sharded_stages_on_a_local_dask_cluster_are_byte_identical(corpus, in_process):
    cfg, (wd, expected) = build_config("tiny"), in_process
    for shards in (1, 7):  # one shard on a worker; more shards than workers, uneven ones
        for stage, names in SHARDED.items():  # nothing left over from the last run
            (wd / stage / names[0]).unlink()
        result = run_pipeline(cfg, str(corpus), workdir=str(wd), stages=UP_TO_ENCODE,
                              force=list(SHARDED), tracking=False,
                              sharding=Sharding("dask", shards=shards, workers=2))
        assert {r.stage for r in result if r.status == "ran"} == set(SHARDED)
        assert _sharded_bytes(wd) == expected, f"{shards} shard(s) changed the bytes"
    # Executor and shard count are not parameters of any output: nothing is stale.
    again = run_pipeline(cfg, str(corpus), workdir=str(wd), stages=UP_TO_ENCODE,
                         tracking=False, sharding=Sharding("threads", shards=3, workers=2))
    assert {r.status for r in again} == {"skipped"}


def _task_runs(api: str, name_like: str) -> list[dict]:
    body = json.dumps({"task_runs": {"name": {"like_": name_like}}}).encode()
    req = urllib.request.Request(f"{api}/task_runs/filter", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.load(resp)


def _executed_on_worker(address: str) -> int:
    from distributed import Client

    with Client(address, timeout=30) as client:
        counts = client.run(lambda dask_worker: dask_worker.state.transition_counter)
    return sum(counts.values())


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def test_cli_through_an_existing_scheduler_with_a_real_prefect_server(corpus, in_process,
                                                                      tmp_path):
    api = f"http://127.0.0.1:{free_port()}/api"
    scheduler = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_API_URL": api,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_LOGGING_LEVEL": "WARNING"}
    env.pop("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", None)
    procs = []

    def start(name: str, cmd: list[str]) -> subprocess.Popen:
        log = tmp_path / f"{name}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        procs.append(proc)
        return proc

    try:
        server = start("prefect", [str(BIN / "prefect"), "server", "start", "--host",
                                   "127.0.0.1", "--port", api.rsplit(":", 1)[1].split("/")[0]])
        sched = start("scheduler", [str(BIN / "dask"), "scheduler", "--host", "127.0.0.1",
                                    "--port", scheduler.rsplit(":", 1)[1], "--no-dashboard"])
        worker = start("worker", [str(BIN / "dask"), "worker", scheduler, "--nworkers", "1",
                                  "--nthreads", "1", "--host", "127.0.0.1", "--no-dashboard"])
        wait_ready(lambda: _healthy(f"{api}/health"), server, tmp_path / "prefect.log",
                   "prefect server")
        wait_ready(lambda: "Starting established connection" in
                   (tmp_path / "worker.log").read_text(), worker, tmp_path / "worker.log",
                   "dask worker")
        assert sched.poll() is None

        def selfsup(wd: Path, *extra: str) -> None:
            done = subprocess.run([str(BIN / "selfsup"), "run", "--corpus", str(corpus),
                                   "--preset", "tiny", "--workdir", str(wd), "--no-tracking",
                                   *extra], env=env, capture_output=True, text=True,
                                  timeout=300, check=False)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

        remote = tmp_path / "remote"
        before = _executed_on_worker(scheduler)
        selfsup(remote, "--to", "encode", "--executor", "dask", "--dask-address", scheduler,
                "--shards", "3")
        assert _sharded_bytes(remote) == in_process[1]
        assert _executed_on_worker(scheduler) > before  # the shards ran on that worker
        for name in ("ingest-judge", "dedup-signatures", "encode-train"):
            runs = _task_runs(api, f"{name}%")
            assert len(runs) == 3 and {t["state_type"] for t in runs} == {"COMPLETED"}, name
    finally:
        for proc in reversed(procs):
            stop_group(proc)
