"""A shared tracking server as a team runs it: PostgreSQL behind a real `mlflow server` with an
artifact destination, both on 127.0.0.1, started here in a temporary folder and torn down after.

The first stages of a tiny pipeline log to it through MLFLOW_TRACKING_URI: runs, metrics and
artifacts land in the server, and the experiment's artifacts are the server's, not pinned into
the first client's workdir. Then two pipelines in two processes, released at the same moment,
race to create one experiment and both finish.

Needs PostgreSQL's server binaries (initdb, postgres: on PATH or Debian's
/usr/lib/postgresql/<version>/bin) and psycopg2. Without them the test is skipped, unless
SELFSUP_REQUIRE_POSTGRES=1 (set by CI), where a missing server is a failure. initdb refuses to
run as root, so as root the cluster runs as the unprivileged user `nobody`.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from prefect.settings import PREFECT_API_URL

from flows.pipeline import run_pipeline
from selfsup_model.presets import build_config
from tests.integration.servers import free_port, start_mlflow_server, stop_group, wait_ready

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
STAGES = ["ingest", "dedup", "split"]
PG_USER = "selfsup"


def _postgres_bin() -> Path | None:
    """The folder holding initdb and postgres: PATH first (resolved, so initdb finds its
    postgres), then Debian's /usr/lib/postgresql/<version>/bin, newest version first."""
    found = shutil.which("initdb")
    folders = [Path(found).resolve().parent] if found else []
    folders += sorted(Path("/usr/lib/postgresql").glob("*/bin"),
                      key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
                      reverse=True)
    return next((d for d in folders if (d / "initdb").is_file() and (d / "postgres").is_file()),
                None)


def _require_postgres() -> Path:
    """PostgreSQL's bin folder, or a skip (a failure where CI asks) saying what is missing."""
    missing = []
    folder = _postgres_bin()
    if folder is None:
        missing.append("PostgreSQL server binaries (apt-get install postgresql)")
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        missing.append("psycopg2 (pip install -e '.[dev]')")
    if os.geteuid() == 0 and not _has_user("nobody"):
        missing.append("an unprivileged user `nobody` to run PostgreSQL as (we are root)")
    if not missing:
        return folder
    if os.environ.get("SELFSUP_REQUIRE_POSTGRES") == "1":
        pytest.fail("missing: " + "; ".join(missing))
    pytest.skip("missing: " + "; ".join(missing))


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


@pytest.fixture(scope="module")
def postgres() -> Iterator[str]:
    """A throwaway PostgreSQL cluster on 127.0.0.1 with an empty `mlflow` database; its
    SQLAlchemy URI. Trust authentication: it listens on loopback only and lives for this module."""
    import psycopg2

    bin_dir = _require_postgres()
    # Not under pytest's tmp_path: as root that sits in a 0700 folder `nobody` cannot enter.
    base = Path(tempfile.mkdtemp(prefix="selfsup-pg-"))
    as_user = {}
    if os.geteuid() == 0:
        nobody = pwd.getpwnam("nobody")
        os.chown(base, nobody.pw_uid, nobody.pw_gid)
        as_user = {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}
    env = {"PATH": os.environ.get("PATH", ""), "LC_ALL": "C", "HOME": str(base)}
    log = base / "postgres.log"
    server = None
    try:
        made = subprocess.run([bin_dir / "initdb", "-D", base / "data", "-U", PG_USER,
                               "--auth=trust", "--encoding=UTF8", "--no-locale", "--no-sync"],
                              env=env, cwd=base, capture_output=True, text=True, timeout=120,
                              check=False, **as_user)
        assert made.returncode == 0, f"initdb failed:\n{made.stdout[-2000:]}{made.stderr[-2000:]}"
        port = free_port()
        with open(log, "w") as out:
            server = subprocess.Popen(
                [bin_dir / "postgres", "-D", base / "data", "-h", "127.0.0.1", "-p", str(port),
                 "-k", base, "-c", "fsync=off"],
                env=env, cwd=base, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                **as_user)

        def accepting() -> bool:
            try:
                psycopg2.connect(host="127.0.0.1", port=port, user=PG_USER,
                                 dbname="postgres").close()
            except psycopg2.OperationalError:
                return False
            return True

        wait_ready(accepting, server, log, "PostgreSQL")
        conn = psycopg2.connect(host="127.0.0.1", port=port, user=PG_USER, dbname="postgres")
        conn.autocommit = True  # CREATE DATABASE cannot run in a transaction
        with conn.cursor() as cur:
            cur.execute("CREATE DATABASE mlflow")
        conn.close()
        yield f"postgresql+psycopg2://{PG_USER}@127.0.0.1:{port}/mlflow"
    finally:
        if server is not None:
            stop_group(server, signal.SIGINT)  # PostgreSQL's fast shutdown
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def mlflow_server(postgres, tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """`mlflow server` over that database, artifacts proxied into a local folder; (URL, folder)."""
    home = tmp_path_factory.mktemp("mlflow-server")
    artifacts = home / "artifacts"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_mlflow_server(postgres, artifacts, home, port)
    try:
        yield url, artifacts
    finally:
        stop_group(server)


def test_a_pipeline_logs_runs_metrics_and_artifacts_to_the_server(mlflow_server, tmp_path,
                                                                  monkeypatch):
    url, artifacts = mlflow_server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    wd = tmp_path / "wd"
    config = build_config("tiny", overrides=["experiment=shared-server"])
    results = run_pipeline(config, "pydocs", workdir=str(wd), stages=STAGES, preset="tiny")
    assert [r.status for r in results] == ["ran"] * len(STAGES)

    client = MlflowClient(url)
    exp = client.get_experiment_by_name("shared-server")
    assert exp.artifact_location.startswith("mlflow-artifacts:"), exp.artifact_location
    assert str(wd.resolve()) not in exp.artifact_location
    runs = client.search_runs([exp.experiment_id])
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    children = {r.data.tags["selfsup.stage"]: r for r in runs
                if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert parent.info.status == "FINISHED" and set(children) == set(STAGES)
    assert parent.data.metrics["ingest.kept"] > 0
    assert all(run.data.metrics["duration_s"] >= 0 for run in children.values())

    split = children["split"].info.run_id
    listed = [a.path for a in client.list_artifacts(split, "manifests")]
    assert listed == ["manifests/manifest.json"]
    got = Path(client.download_artifacts(split, "manifests/manifest.json", str(tmp_path)))
    assert json.loads(got.read_text()) == json.loads((wd / "split" / "manifest.json").read_text())
    # the server stored it: under its artifact destination, nowhere in the workdir
    assert any(artifacts.rglob("manifest.json"))
    assert not (wd / "mlartifacts").exists()


_RACER = """
import sys, time
from pathlib import Path

import keras  # noqa: F401 - what `selfsup run` loads before its flow starts
import flows.pipeline  # noqa: F401
from flows.cli import main

ready, go, *argv = sys.argv[1:]
Path(ready).touch()
while not Path(go).exists():
    time.sleep(0.005)
sys.exit(main(argv))
"""


def test_two_runs_creating_the_experiment_at_once_both_finish(mlflow_server, tmp_path):
    """Both processes load everything first, then start together: both may miss the experiment
    by name and race to create it; the loser must use the winner's."""
    url, _ = mlflow_server
    env = {**os.environ, "MLFLOW_TRACKING_URI": url,
           "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    go = tmp_path / "go"
    racers = []
    for name in ("a", "b"):
        args = ["run", "--preset", "tiny", "--to", "split", "--workdir", str(tmp_path / name),
                "--set", "experiment=race"]
        with open(tmp_path / f"{name}.log", "w") as out:
            racers.append(subprocess.Popen(
                [sys.executable, "-c", _RACER, str(tmp_path / f"{name}.ready"), str(go), *args],
                env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True))
    try:
        deadline = time.monotonic() + 180
        while not all((tmp_path / f"{n}.ready").exists() for n in ("a", "b")):
            assert all(p.poll() is None for p in racers), _logs(tmp_path)
            assert time.monotonic() < deadline, _logs(tmp_path)
            time.sleep(0.1)
        go.touch()
        codes = [p.wait(timeout=300) for p in racers]
    finally:
        for proc in racers:
            stop_group(proc, signal.SIGKILL)
    assert codes == [0, 0], _logs(tmp_path)

    client = MlflowClient(url)
    exp = client.get_experiment_by_name("race")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert sorted(r.data.tags["selfsup.workdir"] for r in parents) == sorted(
        str((tmp_path / n).resolve()) for n in ("a", "b"))
    assert all(r.info.status == "FINISHED" for r in runs) and len(runs) == 2 * (1 + len(STAGES))
    print("the create race was hit" if "created by another run" in _logs(tmp_path)
          else "both runs found or created the experiment without colliding")


def _logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {name}:\n{(tmp_path / f'{name}.log').read_text()[-3000:]}"
                     for name in ("a", "b"))
