"""Faults: SIGKILL between corpus versions, tampered artifacts, two runs on one workdir, an
unreachable MLflow store, SIGTERM, a second signal, a full disk (kills at random moments of every
stage and after a pretraining checkpoint: test_chaos.py)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prefect.settings import PREFECT_API_URL

from flows.cli import main
from flows.lock import workdir_lock

ROOT = Path(__file__).resolve().parents[2]


class Run:
    """A `selfsup run` subprocess in its own session, with output in files.

    Files, not pipes: when the CLI is SIGKILLed, the temporary Prefect server it started would hold
    a pipe open forever. `finish()` reaps the whole process group.
    """

    def __init__(self, workdir: Path, *extra: str, env: dict | None = None, tmp: Path):
        cmd = [sys.executable, "-m", "flows.cli", "run", "--preset", "tiny", "--workdir",
               str(workdir), *extra]
        # Share the session's test Prefect API instead of starting a temporary server per process.
        env = {"PREFECT_API_URL": str(PREFECT_API_URL.value()), **(env or {})}
        self.out_path, self.err_path = (tmp / f"out-{time.monotonic_ns()}",
                                        tmp / f"err-{time.monotonic_ns()}")
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, cwd=ROOT,
                                         stdout=out, stderr=err, start_new_session=True)
        self.pid = self.proc.pid

    def poll(self):
        return self.proc.poll()

    def kill(self) -> None:
        os.killpg(self.pid, signal.SIGKILL)

    def finish(self, timeout: float = 600) -> Run:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            try:
                os.killpg(self.pid, signal.SIGKILL)  # leftovers such as a temporary Prefect server
            except ProcessLookupError:
                pass
        self.returncode = self.proc.returncode
        self.stdout, self.stderr = self.out_path.read_text(), self.err_path.read_text()
        return self


def _cli(workdir: Path, *extra: str, env: dict | None = None, wait: bool = True, tmp: Path):
    run = Run(workdir, *extra, env=env, tmp=tmp)
    return run.finish() if wait else run


def _copy_run(reference: Path, dest: Path) -> Path:
    shutil.copytree(reference, dest, ignore=shutil.ignore_patterns("mlflow.db", "mlartifacts"))
    return dest


@pytest.mark.parametrize("artifact, consumer", [
    ("split/assignments.parquet", "tokenizer"),
    ("pretrain/encoder.keras", "finetune"),
])
def test_tampered_artifact_is_refused_by_its_consumer_and_rebuilt_by_its_stage(
        tmp_path, tiny_run, capsys, artifact, consumer):
    wd = _copy_run(tiny_run[0], tmp_path / "wd")
    path = wd / artifact
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    code = main(["run", "--preset", "tiny", "--workdir", str(wd), "--only", consumer,
                 "--no-tracking"])
    assert code == 2
    err = capsys.readouterr().err
    assert "no longer matches the hash" in err and f"--force {artifact.split('/')[0]}" in err
    stage = artifact.split("/")[0]
    assert main(["run", "--preset", "tiny", "--workdir", str(wd), "--only", stage,
                 "--no-tracking"]) == 0
    assert ("output " + artifact.split("/")[1] + " is missing or was modified"
            in capsys.readouterr().out)


def test_a_second_run_on_a_busy_workdir_is_refused(tmp_path, capsys):
    wd = tmp_path / "wd"
    with workdir_lock(wd):
        assert main(["run", "--preset", "tiny", "--workdir", str(wd), "--no-tracking"]) == 2
    err = capsys.readouterr().err
    assert f"workdir {wd} is in use by another selfsup run (pid {os.getpid()})" in err


def test_two_processes_on_one_workdir(tmp_path):
    wd = tmp_path / "wd"
    first = _cli(wd, "--to", "split", "--no-tracking", wait=False, tmp=tmp_path)
    lock = wd / ".selfsup.lock"
    deadline = time.monotonic() + 120
    while (not (lock.exists() and lock.read_text().strip() == str(first.pid))
           and time.monotonic() < deadline):
        time.sleep(0.1)
    second = _cli(wd, "--to", "split", "--no-tracking", tmp=tmp_path)
    out = first.finish().stderr
    if first.returncode == 0 and second.returncode == 2:
        assert "is in use by another selfsup run" in second.stderr
    else:  # the first finished before the second started: both must have succeeded cleanly
        assert (first.returncode, second.returncode) == (0, 0), out[-2000:] + second.stderr[-2000:]
    assert json.loads((wd / "split" / "manifest.json").read_text())["stage"] == "split"
    # A stage that reruns removes what a killed attempt left half-written: atomic_path's
    # temporary files and save_keras_atomic's scratch models (a SIGKILL runs no cleanup), and
    # nothing else.
    stale = [wd / "split" / ".assignments.parquet.k3j9x_2a.tmp",
             wd / "split" / "sub" / ".audit.json.Abc12345.tmp",
             wd / "split" / ".classifier.tmp15872.keras"]
    kept = [wd / "split" / ".hidden.tmp", wd / "split" / "notes.tmp",
            wd / "split" / ".classifier.keras", wd / "split" / ".x.tmpabc.keras"]
    for path in stale + kept:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"half")
    assert main(["run", "--preset", "tiny", "--workdir", str(wd), "--to", "split",
                 "--force", "split", "--no-tracking"]) == 0
    assert not any(p.exists() for p in stale) and all(p.exists() for p in kept)


def test_unreachable_mlflow_store_fails_clearly_before_any_stage(tmp_path):
    wd = tmp_path / "wd"
    env = {"MLFLOW_TRACKING_URI": "http://127.0.0.1:9", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
           "MLFLOW_HTTP_REQUEST_TIMEOUT": "3"}
    result = _cli(wd, "--to", "ingest", env=env, tmp=tmp_path)
    assert result.returncode == 2
    assert "MLflow tracking store http://127.0.0.1:9 is unavailable" in result.stderr
    assert "--no-tracking" in result.stderr
    assert not list(wd.glob("*/manifest.json"))


def test_a_version_killed_at_any_moment_leaves_the_last_one_complete(tmp_path):
    """SIGKILL between the new version's snapshot and the switch to it, the last moment before
    the new version counts (a stop mid-split: tests/flows/test_versions.py): version 1 stays
    the workdir's last complete version, intact; a rerun makes version 2, in which no document
    of version 1 moved."""
    from flows.pipeline import run_pipeline
    from flows.versions import read_lineage
    from selfsup_model.artifacts import read_manifest, verify_outputs
    from selfsup_model.presets import build_config

    corpus, wd = tmp_path / "corpus.jsonl", tmp_path / "wd"
    rows = [{"id": f"d{i}", "text": " ".join(f"t{i}w{j}" for j in range(12)), "label": f"c{i % 2}"}
            for i in range(40)]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    stages = ["ingest", "dedup", "split"]
    run_pipeline(build_config("tiny"), str(corpus), workdir=str(wd), stages=stages,
                 tracking=False)
    state = read_lineage(wd)
    v1 = wd / "versions" / state["lineage"] / "v0001"
    before = _splits(wd)
    rows += [{"id": f"n{i}", "text": " ".join(f"new{i}w{j}" for j in range(12)), "label": "c0"}
             for i in range(5)]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    args = ("--corpus", str(corpus), "--to", "split", "--no-tracking")
    for where in ("version-switch",):
        killed = _cli(wd, *args, env={"SELFSUP_FAULT_KILL": where}, tmp=tmp_path)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
        assert read_lineage(wd) == state
        for stage in stages:
            assert not verify_outputs(v1 / stage, read_manifest(v1 / stage)), (where, stage)
        assert _splits(v1).equals(before)
    again = _cli(wd, *args, tmp=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert [v["version"] for v in read_lineage(wd)["versions"]] == [1, 2]
    after = _splits(wd)
    assert len(after) == 45 and after[before.index].equals(before)


def _splits(workdir: Path):
    import pandas as pd

    return pd.read_parquet(workdir / "split" / "assignments.parquet").set_index("id")["split"]


def test_sigterm_stops_the_run_at_a_safe_point_and_leaves_nothing_running(tmp_path):
    """`selfsup run` without PREFECT_API_URL starts a temporary Prefect server, and with
    `--executor dask` a local Dask cluster that lives as long as the run; SIGTERM during
    pretraining (what a cancelled deployment run, `timeout` or Kubernetes sends) must stop the
    run with status 143, end its MLflow runs as KILLED, leave no manifest for the stage in
    flight, release the workdir lock and leave no process of the run (the server and the Dask
    workers included)."""
    import psutil
    from mlflow.tracking import MlflowClient

    from flows.lock import workdir_lock

    corpus, wd, db = tmp_path / "corpus.jsonl", tmp_path / "wd", tmp_path / "mlflow.db"
    rows = [{"id": f"d{i}", "text": " ".join(f"t{i % 9}w{j} d{i}x{j}" for j in range(12)),
             "label": f"c{i % 2}"} for i in range(60)]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(MLFLOW_TRACKING_URI=f"sqlite:///{db}", PREFECT_HOME=str(tmp_path / "prefect"))
    err_path = tmp_path / "err"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "run", "--preset", "tiny", "--corpus",
             str(corpus), "--workdir", str(wd), "--set", "pretrain.steps=100000",
             "--executor", "dask", "--workers", "2"],
            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (wd / "pretrain" / "checkpoints").exists() and proc.poll() is None:
            assert time.monotonic() < deadline, err_path.read_text()[-2000:]  # into the
            time.sleep(0.5)  # training loop
        assert proc.poll() is None, err_path.read_text()[-3000:]
        port = int(err_path.read_text().split("Starting temporary server on http://127.0.0.1:")[1]
                   .split()[0].strip("/"))
        children = psutil.Process(proc.pid).children(recursive=True)
        commands = " ".join(" ".join(c.cmdline()) for c in children)
        assert "prefect.server" in commands, "the temporary Prefect server is the run's child"
        assert len(children) >= 3, commands  # the server, and the cluster's worker processes
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM, err_path.read_text()[-3000:]
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [p.cmdline() for p in alive]
        assert time.monotonic() - started < 30
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    stderr = err_path.read_text()
    assert "stopped by SIGTERM" in stderr
    with pytest.raises(ProcessLookupError):  # nothing left in the run's session
        os.killpg(proc.pid, 0)
    with socket.socket() as sock:  # nothing listens on the server's port (TIME_WAIT aside)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen()
    assert not (wd / "pretrain" / "manifest.json").exists()
    assert (wd / "masks" / "manifest.json").exists()
    with workdir_lock(wd):  # released
        pass
    client = MlflowClient(f"sqlite:///{db}")
    runs = client.search_runs([client.get_experiment_by_name("selfsup").experiment_id])
    status = {r.info.run_name.split(":")[0]: r.info.status for r in runs}
    assert status["pipeline"] == "KILLED" and status["pretrain"] == "KILLED"
    assert status["masks"] == "FINISHED"


def test_a_full_disk_fails_the_stage_in_one_line_and_a_rerun_with_space_completes(
        tmp_path, monkeypatch):
    """The device fills while split writes its assignments (fsync is where a delayed
    allocation reports it): one line naming the file, no manifest, no half-written file."""
    import errno

    import selfsup_model.artifacts
    from flows.pipeline import run_pipeline
    from selfsup_model.errors import DiskFullError
    from selfsup_model.presets import build_config

    corpus, wd = tmp_path / "corpus.jsonl", tmp_path / "wd"
    rows = [{"id": f"d{i}", "text": " ".join(f"t{i}w{j}" for j in range(12)), "label": f"c{i % 2}"}
            for i in range(30)]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    real_fsync = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[-1].startswith(
                ".assignments.parquet."):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(selfsup_model.artifacts.os, "fsync", fsync)
    stages = ["ingest", "dedup", "split"]
    with pytest.raises(DiskFullError) as failed:
        run_pipeline(build_config("tiny"), str(corpus), workdir=str(wd), stages=stages,
                     tracking=False)
    message = str(failed.value)
    assert "\n" not in message and str(wd / "split" / "assignments.parquet") in message
    assert "bytes are free there" in message
    assert not (wd / "split" / "manifest.json").exists()
    assert not list((wd / "split").glob(".*.tmp")) and not (wd / "split" /
                                                            "assignments.parquet").exists()
    monkeypatch.setattr(selfsup_model.artifacts.os, "fsync", real_fsync)
    again = run_pipeline(build_config("tiny"), str(corpus), workdir=str(wd), stages=stages,
                         tracking=False)
    assert [r.status for r in again] == ["skipped", "skipped", "ran"]


_SLOW_TO_STOP = """
import subprocess, sys, time
from flows.shutdown import stop_signals
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(child.pid, flush=True)
with stop_signals():
    try:
        time.sleep(600)
    finally:
        print("cleaning up", flush=True)
        time.sleep(600)  # a clean-up that takes its time
"""


_LOADING = """
import os, signal, sys, time
from tasks.stopping import stops_deferred
signal.signal(signal.SIGTERM, lambda s, f: sys.exit("handled after the load"))
try:
    with stops_deferred():  # as while a stage's module loads TensorFlow
        print("loading", flush=True)
        for _ in range(int(sys.argv[1])):
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)  # the load goes on: the signal waits
        print("loaded", flush=True)
finally:
    print("after the block", flush=True)
"""


@pytest.mark.parametrize("signals", [1, 2])
def test_a_stop_during_a_load_waits_for_it_and_a_second_stops_at_once(tmp_path, signals):
    """A stop raised in the middle of TensorFlow's import can leave the process unable to stop;
    one that arrives while a stage's module loads is delivered to the run's handler once it
    has loaded. A second one meanwhile ends the process at once."""
    proc = subprocess.run([sys.executable, "-c", _LOADING, str(signals)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    if signals == 1:
        assert proc.stdout.splitlines() == ["loading", "loaded", "after the block"]
        assert proc.returncode == 1 and "handled after the load" in proc.stderr
    else:
        assert proc.stdout.splitlines() == ["loading"]
        assert proc.returncode == -signal.SIGTERM
    assert "SIGTERM: stopping as soon as the stage's code has loaded" in proc.stderr


_DISGUISED = """
import os, signal, sys, time
from prefect.exceptions import TerminationSignal
from tasks.stopping import stop_behind, stop_signals_noted, stopped

def prefects(signum, frame):  # as Prefect's engine handles SIGTERM during a flow run
    raise TerminationSignal(signum)

signal.signal(signal.SIGTERM, prefects)
with stop_signals_noted():
    try:
        raise ValueError("a failure")
    except ValueError as exc:
        print("failure:", stopped(exc), stop_behind(exc))
    print("handler kept:", signal.getsignal(signal.SIGTERM) is prefects)
    try:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except TerminationSignal:  # as TensorFlow reported a stop raised in its call back
            raise ValueError("The two structures don't have the same nested structure") from None
    except ValueError as exc:
        stop = stop_behind(exc)
        print("disguised:", stopped(exc), type(stop).__name__, stop.signal == signal.SIGTERM)
print("wakeup fd restored:", signal.set_wakeup_fd(-1) == -1)
"""


def test_a_stop_that_comes_out_as_another_error_is_still_a_stop(tmp_path):
    """A stop raised inside a C extension's call back into Python can come out as that
    library's own error (TensorFlow once reported a SIGTERM at the start of `fit` as a
    ValueError, and the run failed with status 1). Once a stop signal reached the run, the error
    it raised is a stop (`stop_behind` gives the TerminationSignal that the stage and the
    pipeline raise from it); before any signal, an error is a failure. Prefect's SIGTERM handler
    stays in place (it must, to accept a cancellation from its runner)."""
    proc = subprocess.run([sys.executable, "-c", _DISGUISED], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["failure: False None", "handler kept: True",
                                        "disguised: True TerminationSignal True",
                                        "wakeup fd restored: True"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_stops_at_once_and_takes_the_children_along(tmp_path, signum):
    """The first signal starts a clean stop; while that is under way (here a clean-up that
    would take ten minutes), a second one ends the process at once, as the signal's default
    action does, and its child process with it."""
    import psutil

    out = tmp_path / "out"
    with open(out, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-c", _SLOW_TO_STOP], cwd=ROOT, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60

        def wait_for(text: str) -> str:
            while text not in out.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
                time.sleep(0.05)
            return out.read_text()

        child = psutil.Process(int(wait_for("\n").split()[0]))
        proc.send_signal(signum)
        wait_for("cleaning up")
        assert "stopping at a safe point (send another to stop at once)" in out.read_text()
        assert proc.poll() is None  # the clean stop is under way
        started = time.monotonic()
        proc.send_signal(signum)
        assert proc.wait(timeout=10) == -signum
        assert time.monotonic() - started < 5
        child.wait(timeout=5)  # gone with it (a zombie reaped by init does not count)
        assert not child.is_running()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
