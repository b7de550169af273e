"""Review in a real browser: `selfsup ui` over a tiny run's store, in headless Chromium: the
experiment opens on its runs list, the parent run page shows metrics and the report, a stage run's
page lists the splits it read as datasets, and the kept classifier shows as a logged model of the
finetune run and as a registered model.

Needs Debian's chromium and chromium-driver (.ci/run installs them). Without them the test is
skipped, unless SELFSUP_REQUIRE_BROWSER=1 (set by CI), where a missing browser is a failure.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest
from mlflow.tracking import MlflowClient

from flows.tracking import ui_url
from tests.integration.browser import (
    CHROMEDRIVER,
    CHROMIUM,
    browser,
    serve_ui,
    stage_run,
    wait_for_text,
)
from tests.integration.browser import runs as _runs

pytestmark = pytest.mark.browser


def _require_browser():
    if CHROMIUM and CHROMEDRIVER:
        return
    if os.environ.get("SELFSUP_REQUIRE_BROWSER") == "1":
        pytest.fail("chromium/chromedriver not installed "
                    "(apt-get install chromium chromium-driver)")
    pytest.skip("chromium/chromedriver not installed")


@pytest.fixture(scope="module")
def mlflow_ui(tiny_run):
    """One MLflow UI for this module's tests (it takes tens of seconds to start)."""
    _require_browser()
    wd, uri, _ = tiny_run
    with serve_ui(wd) as served:
        yield served.url, uri, served


@pytest.fixture
def driver():
    """A headless Chromium session, closed after the test."""
    _require_browser()
    session = browser()
    yield session
    session.quit()


def _click_text(driver, text: str) -> None:
    driver.find_element("xpath", f"//*[normalize-space(text())='{text}']").click()


def test_parent_run_page_shows_metrics_and_report(mlflow_ui, driver, tmp_path):
    url, uri, _ = mlflow_ui
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("selfsup")
    parent = next(r for r in client.search_runs([exp.experiment_id])
                  if "mlflow.parentRunId" not in r.data.tags)
    run_url = f"{url}/#/experiments/{exp.experiment_id}/runs/{parent.info.run_id}"
    driver.get(run_url)
    wait_for_text(driver, ["masks.scored_tokens", "ingest.kept"])
    driver.save_screenshot(str(tmp_path / "mlflow-run.png"))
    driver.get(f"{run_url}/artifacts")
    wait_for_text(driver, ["report"])
    _click_text(driver, "report")
    wait_for_text(driver, ["report.md", "macro_f1_vs_fraction.png"])
    _click_text(driver, "report.md")
    wait_for_text(driver, ["selfsup comparison", "What the numbers say"])
    driver.save_screenshot(str(tmp_path / "mlflow-report.png"))
    assert (tmp_path / "mlflow-run.png").stat().st_size > 10_000


def test_experiment_opens_on_the_runs_list(mlflow_ui, driver, tmp_path):
    """Not on the GenAI traces overview: the experiment is a model-training one."""
    url, uri, _ = mlflow_ui
    _, exp, runs = _runs(uri)
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    driver.get(ui_url(url, exp.experiment_id))
    body = wait_for_text(driver, [parent.info.run_name, "matching runs"])
    driver.save_screenshot(str(tmp_path / "mlflow-experiment.png"))
    assert f"/experiments/{exp.experiment_id}/runs" in driver.current_url
    assert "workflowType=machine_learning" in driver.current_url
    assert "No data available for the selected time range" not in body


def test_stage_run_page_lists_the_splits_it_read(mlflow_ui, driver, tmp_path):
    url, uri, _ = mlflow_ui
    _, exp, finetune = stage_run(uri, "finetune")
    datasets = {i.dataset.name: i.dataset for i in finetune.inputs.dataset_inputs}
    assert set(datasets) == {"train", "val", "test"}
    train = f"train ({datasets['train'].digest})"
    driver.get(ui_url(url, exp.experiment_id, finetune.info.run_id))
    body = wait_for_text(driver, ["Datasets", train, "Training"])
    about = body[body.index("About this run"):]
    assert about.split("\nDatasets\n", 1)[1].startswith(train), about[:600]  # not "None"
    # the dataset drawer: every split, its context, digest, size and source file
    driver.find_elements("xpath", f"//*[contains(normalize-space(.), '{train}')]")[-1].click()
    rows = json.loads(datasets["train"].profile)["num_rows"]
    wait_for_text(driver, ["3 datasets used", train, "Training",
                            f"val ({datasets['val'].digest})", "Validation",
                            f"test ({datasets['test'].digest})", "Test",
                            f"num rows: {rows}", "train_docs.parquet"])
    driver.save_screenshot(str(tmp_path / "mlflow-datasets.png"))


def test_the_kept_classifier_shows_as_a_logged_and_registered_model(mlflow_ui, driver, tmp_path):
    url, uri, _ = mlflow_ui
    client, exp, finetune = stage_run(uri, "finetune")
    (model,) = client.search_logged_models(experiment_ids=[exp.experiment_id])
    assert model.source_run_id == finetune.info.run_id and model.status == "READY"
    version = finetune.data.tags["selfsup.registered_model"].rsplit("/", 1)[1]
    # the finetune run's page: its logged model in "Logged models (1)", and the registered
    # version under "Registered models" in "About this run" (not "None")
    driver.get(ui_url(url, exp.experiment_id, finetune.info.run_id))
    def logged(body: str) -> str:  # the table's header and row
        return body[body.index("Logged models (1)"):][:400]

    # The header renders before the row (a clean-clone run once read the page in between).
    body = wait_for_text(driver, ["Logged models (1)",
                                   f"Registered models\nselfsup-classifier\nv{version}"],
                         until=lambda text: "Ready" in logged(text))
    assert "classifier" in logged(body) and "Ready" in logged(body), logged(body)
    driver.save_screenshot(str(tmp_path / "mlflow-finetune-run.png"))
    # the experiment's Models tab: the logged model, ready, logged from the finetune run
    driver.get(f"{url}/#/experiments/{exp.experiment_id}/models?workflowType=machine_learning")
    wait_for_text(driver, ["classifier", "Ready", "finetune", "selfsup-classifier"])
    driver.save_screenshot(str(tmp_path / "mlflow-models.png"))
    # the Model Registry page
    driver.get(f"{url}/#/models")
    wait_for_text(driver, ["Registered Models", "selfsup-classifier", f"Version {version}"])


def test_stopping_the_ui_leaves_no_server_behind(mlflow_ui):
    """Last in this module: it stops the module's UI. SIGTERM to `selfsup ui` alone (what
    `kill`, systemd or a terminal's Ctrl-C send) ends it with status 143 within seconds and takes
    MLflow with it: the `mlflow ui` launcher, its uvicorn server and workers, all in a session
    of their own; none is left and the port is free. (Killing the launcher alone, as selfsup
    once did, left uvicorn answering on the port.)"""
    import psutil

    url, _, served = mlflow_ui
    server = psutil.Process(served.proc.pid).children(recursive=True)
    assert any("uvicorn" in " ".join(p.cmdline()) for p in server), [p.cmdline() for p in server]
    assert all(os.getsid(p.pid) != os.getsid(served.proc.pid) for p in server)  # own session
    started = time.monotonic()
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(timeout=30) == 128 + signal.SIGTERM
    _, alive = psutil.wait_procs(server, timeout=5)
    assert not alive, [p.cmdline() for p in alive]
    assert time.monotonic() - started < 15
    assert "selfsup: stopped by SIGTERM\n" in served.output()  # no word of stages
    # nor of a safe point, which only a pipeline run has
    assert "SIGTERM: stopping (send another to stop at once)" in served.output()
    assert "safe point" not in served.output()
    port = int(url.rsplit(":", 1)[1])
    with socket.socket() as sock:  # nothing listens there (TIME_WAIT aside)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen()
