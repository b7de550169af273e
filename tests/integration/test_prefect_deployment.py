"""The real operating path: a local Prefect server, a process work pool, `prefect deploy --all`,
and a long-lived worker.

Triggers the scheduled pipeline deployment with the tiny preset, waits for Completed, then
triggers the single-stage rerun deployment and checks that exactly that stage ran again, then
scores a folder of new documents with the batch-scoring deployment. Then cancels a run of the
pipeline deployment during pretraining, as from the UI.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pandas as pd
import pytest

from selfsup_model.serving.hf_export import check_export
from tests.integration.servers import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
PREFECT = [sys.executable, "-m", "prefect"]
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": api,
           "SELFSUP_HOME": str(ROOT),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_LOGGING_LEVEL": "WARNING",
           "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}"}
    env.pop("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", None)
    server = subprocess.Popen([*PREFECT, "server", "start", "--host", "127.0.0.1",
                               "--port", str(port)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        wait_healthy(api)
        yield env, home
    finally:
        server.terminate()
        server.wait(timeout=30)


def _prefect(env, *args: str, timeout: float = 300) -> str:
    out = subprocess.run([*PREFECT, "--no-prompt", *args], check=False, env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"prefect {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def _api(env, path: str, body: dict | None = None):
    """The server's REST API (what the CLI and UI read); checks read through it, the steps a
    user takes (deploy, run, worker) go through the CLI."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{env['PREFECT_API_URL']}/{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.load(resp)


def _trigger(env, deployment: str, params: dict) -> str:
    """Trigger a deployment; the flow run's id."""
    args = ["deployment", "run", deployment]
    for key, value in params.items():
        args += ["--param", f"{key}={value}"]
    created = _prefect(env, *args)
    return next(line.split()[-1] for line in created.splitlines() if "UUID" in line)


def _final_state(env, run_id: str, worker: Worker, timeout: float = 420) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = _api(env, f"flow_runs/{run_id}")
        if (state["state"]["type"] in {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
                or time.monotonic() > deadline):
            return state
        assert worker.proc.poll() is None, worker.log.read_text()[-3000:]
        time.sleep(0.5)


def _run_and_wait(env, worker: Worker, deployment: str, params: dict) -> dict:
    """Trigger a deployment, wait for the worker to execute it, return the final flow-run
    state."""
    return _final_state(env, _trigger(env, deployment, params), worker)


def _add_documents(folder: Path, numbers) -> None:
    """Documents of two labels, a folder each, with words of their own."""
    for i in numbers:
        label = ("birds", "fish")[i % 2]
        (folder / label).mkdir(parents=True, exist_ok=True)
        (folder / label / f"{i}.txt").write_text(
            " ".join(f"{label}{i % 7}w{j} doc{i}x{j}" for j in range(12)), encoding="utf-8")


@pytest.fixture(scope="module")
def deployed(prefect_server):
    """The project's deployments on the server, with the process work pool they run on."""
    env, _ = prefect_server
    _prefect(env, "work-pool", "create", "selfsup-process", "--type", "process")
    _prefect(env, "deploy", "--all")
    return env


@dataclasses.dataclass
class Worker:
    proc: subprocess.Popen
    log: Path


@pytest.fixture(scope="module")
def worker(deployed, tmp_path_factory):
    """A worker on the process pool, long-lived as an operator runs one (polling every second
    here, not every ten): each flow run is a child process of it."""
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen([*PREFECT, "worker", "start", "--pool", "selfsup-process"],
                                env={**deployed, "PREFECT_WORKER_QUERY_SECONDS": "1"}, cwd=ROOT,
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield Worker(proc, log)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def test_deploy_schedule_and_rerun_one_stage(deployed, worker, tmp_path):
    env = deployed
    listed = {d["name"] for d in _api(env, "deployments/filter", {})}
    assert {"weekly", "rerun-stage", "nightly-scoring", "publish-model"} <= listed
    scoring = _api(env, "deployments/name/selfsup-predict/nightly-scoring")
    assert [s["active"] for s in scoring["schedules"]] == [False]  # the nightly ships paused

    weekly = _api(env, "deployments/name/selfsup-pipeline/weekly")
    assert [s["schedule"]["cron"] for s in weekly["schedules"]] == ["0 3 * * 1"]
    assert weekly["parameters"]["corpus_format"] == "folder"

    workdir, corpus = tmp_path / "wd", tmp_path / "weekly"
    _add_documents(corpus, range(40))
    # The sentence-embedding baseline is the tiny run's slowest stage and has its own tests, as
    # have fine-tuning's fractions and modes.
    params = {"preset": "tiny", "workdir": str(workdir), "corpus": str(corpus),
              "overrides": json.dumps(["baseline.sentence_embeddings=off",
                                       "finetune.fractions=[1.0]", "finetune.modes=[full]"])}
    run = _run_and_wait(env, worker, "selfsup-pipeline/weekly", params)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    manifests = {p.parent.name: json.loads(p.read_text()) for p in workdir.glob("*/manifest.json")}
    assert set(manifests) >= {"ingest", "pretrain", "compare"}
    assert manifests["baseline"]["params"]["baseline"]["sentence_embeddings"] == "off"
    first = pd.read_parquet(workdir / "split" / "assignments.parquet").set_index("id")["split"]

    before = {name: m["finished_at"] for name, m in manifests.items()}
    rerun = _run_and_wait(env, worker, "selfsup-stage/rerun-stage",
                          {"stage": "masks", "preset": "tiny", "workdir": str(workdir),
                           "corpus": str(corpus), "corpus_format": "folder"})
    assert rerun["state"]["type"] == "COMPLETED", rerun["state"]
    after = {p.parent.name: json.loads(p.read_text())["finished_at"]
             for p in workdir.glob("*/manifest.json")}
    assert [name for name in after if after[name] != before[name]] == ["masks"]

    # A week later the folder has grown: the run makes version 2; nothing moves.
    _add_documents(corpus, range(40, 46))
    grown = _run_and_wait(env, worker, "selfsup-pipeline/weekly",
                          {**params, "to_stage": "split"})
    assert grown["state"]["type"] == "COMPLETED", grown["state"]
    lineage = json.loads((workdir / "versions" / "lineage.json").read_text())
    assert [v["counts"].get("new") for v in lineage["versions"]] == [None, 6]
    second = pd.read_parquet(workdir / "split" / "assignments.parquet").set_index("id")["split"]
    assert len(second) == len(first) + 6 and second[first.index].equals(first)

    inbox = tmp_path / "incoming"
    inbox.mkdir()
    (inbox / "a.txt").write_text("Parse an email message from a bytes object.", encoding="utf-8")
    (inbox / "b.txt").write_text("Run the unit tests and report each failure.", encoding="utf-8")
    (inbox / "empty.txt").write_text("", encoding="utf-8")
    out = tmp_path / "scored" / "latest.parquet"
    scored = _run_and_wait(env, worker, "selfsup-predict/nightly-scoring",
                           {"source": str(inbox), "out": str(out), "workdir": str(workdir)})
    assert scored["state"]["type"] == "COMPLETED", scored["state"]
    assert out.is_file() and (tmp_path / "scored" / "latest.rejects.csv").is_file()
    assert len(pd.read_parquet(out)) == 2
    artifacts = _api(env, "artifacts/filter",
                     {"artifacts": {"key": {"any_": ["selfsup-predictions"]}}})
    summary = " ".join(a["data"] for a in artifacts)
    assert "3 documents read" in summary and "| label | documents |" in summary

    # The week's encoder published where transformers reads it.
    published = _run_and_wait(env, worker, "selfsup-export/publish-model",
                              {"out": str(tmp_path / "published"), "workdir": str(workdir)})
    assert published["state"]["type"] == "COMPLETED", published["state"]
    provenance = check_export(tmp_path / "published")
    assert provenance["architecture"] == "BertForMaskedLM"
    assert provenance["from"]["workdir"] == str(workdir.resolve())


def test_cancelling_a_deployment_run_stops_it_and_leaves_nothing_running(deployed, worker,
                                                                         tmp_path):
    """Cancel from the UI (here its CLI twin, `prefect flow-run cancel`) while the run
    pretrains: the worker sends SIGTERM to the run's process group; the run ends Cancelled, its
    MLflow runs KILLED, pretraining leaves no manifest, the workdir lock is free, no process of
    the run is left (checked by pid), and the worker goes on."""
    import psutil
    from mlflow.tracking import MlflowClient

    from flows.lock import workdir_lock

    env = deployed
    workdir, corpus = tmp_path / "wd", tmp_path / "docs"
    _add_documents(corpus, range(40))
    params = {"preset": "tiny", "workdir": str(workdir), "corpus": str(corpus),
              "overrides": json.dumps(["baseline.sentence_embeddings=off",
                                       "pretrain.steps=100000"])}
    run_id = _trigger(env, "selfsup-pipeline/weekly", params)
    deadline = time.monotonic() + 240
    while not (workdir / "pretrain" / "checkpoints").exists():  # into the training loop
        assert worker.proc.poll() is None and time.monotonic() < deadline, (
            worker.log.read_text()[-3000:])
        time.sleep(0.5)
    flow_processes = psutil.Process(worker.proc.pid).children(recursive=True)
    assert flow_processes, "the flow run should be a child process of the worker"
    _prefect(env, "flow-run", "cancel", run_id)
    state = _final_state(env, run_id, worker, timeout=90)
    assert state["state"]["type"] == "CANCELLED", (state["state"],
                                                   worker.log.read_text()[-3000:])
    _, alive = psutil.wait_procs(flow_processes, timeout=15)
    assert not alive, [p.cmdline() for p in alive]
    assert worker.proc.poll() is None, worker.log.read_text()[-3000:]  # it serves the next run
    assert not (workdir / "pretrain" / "manifest.json").exists()
    assert (workdir / "masks" / "manifest.json").exists()
    with workdir_lock(workdir):  # released
        pass
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name("selfsup").experiment_id],
                              max_results=1000)
    parent = next(r for r in runs if r.data.tags.get("selfsup.workdir") == str(workdir.resolve()))
    status = {r.info.run_name.split(":")[0]: r.info.status for r in runs
              if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert parent.info.status == "KILLED" and status["pretrain"] == "KILLED"
    assert status["masks"] == "FINISHED"
