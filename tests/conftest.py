"""Shared fixtures: one Prefect test harness for the whole run, MLflow on a temporary SQLite
file."""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Stages called outside a flow (run_pipeline in unit tests) have no flow run to send logs to.
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

import functools
import importlib.util
import logging
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


class _CurrentStderr:
    """A stream that writes to whatever sys.stderr is at the moment of writing."""

    encoding = "utf-8"

    def write(self, text):
        return sys.stderr.write(text)

    def flush(self):
        sys.stderr.flush()

    def isatty(self):
        return False


def _prefect_console_follows_current_stderr():
    """Prefect's console handlers keep the stream they were built with; under pytest that can be one
    test's capture buffer, closed by the next test. Point existing and future ones at the current
    sys.stderr instead."""
    from prefect.logging.handlers import PrefectConsoleHandler

    stream = _CurrentStderr()
    if not getattr(PrefectConsoleHandler, "_follows_stderr", False):
        original_init = PrefectConsoleHandler.__init__

        def __init__(self, stream=None, *args, **kwargs):
            original_init(self, _CurrentStderr(), *args, **kwargs)

        PrefectConsoleHandler.__init__ = __init__
        PrefectConsoleHandler._follows_stderr = True
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    for logger in loggers:
        for handler in logger.handlers:
            if isinstance(handler, PrefectConsoleHandler):
                handler.stream = stream
                handler.console.file = stream


# `make test` runs two pytest-xdist workers, and a worker takes a whole scope at a time: a test
# module, or every module that reads the shared tiny run (so that run happens once), so a
# module's fixtures (a server, a trained model) are built once. The slowest scopes go first,
# longest first (their summed --durations=0 times on 2 cores: 500, 225, 205, 160, 95, 90, 75,
# 65 s), so the workers finish together instead of one waiting on a long scope drawn last
# (replaying those durations: 841 s for the slower worker, against 869 s in the order before).
_SLOWEST_FIRST = (
    "tiny_run",
    "tests/reliability/test_chaos.py",
    "tests/integration/test_prefect_deployment.py",
    "tests/integration/test_training_processes.py",
    "tests/integration/test_dask_sharding.py",
    "tests/integration/test_mlflow_postgres.py",
    "tests/transfer/test_finetuning.py",
    "tests/pretraining/test_data_parallel.py",
)
_READS_TINY_RUN = re.compile(r"^\s*def \w+\([^)]*\btiny_run\b", flags=re.MULTILINE)


@functools.cache
def _scope(module: str) -> str:
    """The scope of a test module (its path from the rootdir)."""
    text = (Path(__file__).resolve().parent.parent / module).read_text(encoding="utf-8")
    return "tiny_run" if _READS_TINY_RUN.search(text) else module


def pytest_collection_modifyitems(config, items):
    rank = {scope: i for i, scope in enumerate(_SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(_scope(item.nodeid.split("::")[0]), len(rank)))


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # pytest-xdist comes with the dev extra; without it the suite runs serially
    pass
else:
    class _PipelineScopes(LoadScopeScheduling):
        def __init__(self, config, log=None):
            config.option.loadscopereorder = False  # keep the slowest-first order
            super().__init__(config, log)

        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid.split("::")[0])

    def pytest_xdist_make_scheduler(config, log):
        return _PipelineScopes(config, log) if config.getvalue("dist") == "loadscope" else None


_SHARED_API = "SELFSUP_TEST_PREFECT_API"  # set by the xdist controller for its workers


def pytest_configure(config):
    """Under xdist the controller starts one test Prefect API for every worker, before they
    start, and does not wait for it: the workers collect while it comes up (one server start
    instead of one per worker, each 15-18 s of a core)."""
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", default=None):
        return
    home = Path(tempfile.mkdtemp(prefix="selfsup-test-prefect-"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # What prefect_test_harness runs (Prefect's temporary server), on a SQLite file of its own.
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_UI_ENABLED": "0",
           "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
           "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect.db'}"}
    app_dir = Path(importlib.util.find_spec("prefect").origin).parent.parent
    with open(home / "server.log", "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--app-dir", str(app_dir), "--factory",
             "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
             "--log-level", "error", "--lifespan", "on"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    config._selfsup_prefect_api = (server, home)
    os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"  # the workers inherit it
    os.environ[_SHARED_API] = str(home / "server.log")


def pytest_unconfigure(config):
    if (started := getattr(config, "_selfsup_prefect_api", None)) is not None:
        server, home = started
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        shutil.rmtree(home, ignore_errors=True)


def _wait_for_shared_api(timeout: float = 180.0) -> None:
    from tests.integration.servers import wait_healthy

    try:
        wait_healthy(os.environ["PREFECT_API_URL"], timeout)
    except TimeoutError as exc:
        log = Path(os.environ[_SHARED_API])
        raise RuntimeError(f"the shared test Prefect API: {exc}; its log ends: "
                           f"{log.read_text()[-2000:] if log.exists() else '(none)'}") from None


@pytest.fixture(scope="session", autouse=True)
def prefect_harness():
    """A throwaway Prefect API for every test: under xdist the one the controller started,
    otherwise Prefect's test harness (started once: it takes seconds).

    Without it, each test that touches a task or flow would start its own temporary server.
    """
    _prefect_console_follows_current_stderr()
    if os.environ.get(_SHARED_API):
        _wait_for_shared_api()
        yield
        return
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        _prefect_console_follows_current_stderr()
        yield
        # pytest has closed the captured streams by now; the server's goodbye line would
        # crash logging
        logging.getLogger("prefect").setLevel(logging.WARNING)


@pytest.fixture
def mlflow_uri(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


@pytest.fixture
def folder_corpus(tmp_path):
    """A folder-per-class corpus with one bad file of each kind ingest must reject."""
    root = tmp_path / "corpus"
    (root / "birds").mkdir(parents=True)
    (root / "fish").mkdir()
    texts = {
        "birds/a.txt": "Swallows cross the sky in long loops before the autumn storms arrive.",
        "birds/b.txt": "A heron waits in the reeds, perfectly still, until a frog moves nearby.",
        "fish/c.txt": "Salmon swim upstream against strong currents to reach their spawning beds.",
        "fish/d.txt": "Coral reefs shelter thousands of small fish from larger hunting predators.",
        "fish/copy.txt": "Salmon swim upstream against strong currents "
                         "to reach their spawning beds.",
    }
    for rel, text in texts.items():
        (root / rel).write_text(text, encoding="utf-8")
    (root / "birds" / "latin1.txt").write_bytes(
        "Caf\xe9 au lait with the morning birds singing".encode("latin-1"))
    (root / "fish" / "empty.txt").write_text("   \n\t ", encoding="utf-8")
    return root


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, prefect_harness):
    """The whole tiny pipeline on the embedded corpus, run once through the Prefect flow.

    Tracking goes to the workdir's default store (<workdir>/mlflow.db), as for a user.
    """
    from flows.pipeline import pipeline_flow

    wd = tmp_path_factory.mktemp("e2e") / "wd"
    mp = pytest.MonkeyPatch()
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    results = pipeline_flow(corpus="pydocs", workdir=str(wd), preset="tiny")
    mp.undo()
    yield wd, f"sqlite:///{wd.resolve() / 'mlflow.db'}", results
