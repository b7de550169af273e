"""Helpers shared by the tests that start real local servers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from flows.cli import mlflow_server_environment


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float = 120.0) -> None:
    """Poll `<url>/health` until it answers 200; TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"the server at {url} did not become healthy in {timeout:.0f} s")


def stop_group(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Signal the process group (the server and its workers, a run and its worker processes),
    even after the leader exited; kill what is left after 30 s."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def wait_ready(ready, proc: subprocess.Popen, log: Path, what: str, timeout: float = 120) -> None:
    """Poll `ready()` until true; fail with the process's log if it exits or time runs out."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"{what} exited:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{what} did not start:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)


def start_mlflow_server(backend: str, artifacts: Path, home: Path, port: int,
                        timeout: float = 180) -> subprocess.Popen:
    """`mlflow server` on 127.0.0.1:`port` over the `backend` store, artifacts proxied into
    `artifacts`, in its own session (stop it with `stop_group`); returns once /health answers."""
    # Without MLflow's job runner, as `selfsup ui` and docs/operations.md start it.
    env = mlflow_server_environment(
        {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"})
    log = home / f"mlflow-server-{time.monotonic_ns()}.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend,
             "--artifacts-destination", str(artifacts), "--host", "127.0.0.1",
             "--port", str(port), "--workers", "1"],
            env=env, cwd=home, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    try:
        wait_ready(healthy, server, log, "mlflow server", timeout=timeout)
    except BaseException:
        stop_group(server)
        raise
    return server
