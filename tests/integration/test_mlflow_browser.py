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
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.tracking import ui_url

pytestmark = pytest.mark.browser
ROOT = Path(__file__).resolve().parents[2]
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


def _require_browser():
    if CHROMIUM and CHROMEDRIVER:
        return
    if os.environ.get("SELFSUP_REQUIRE_BROWSER") == "1":
        pytest.fail("chromium/chromedriver not installed "
                    "(apt-get install chromium chromium-driver)")
    pytest.skip("chromium/chromedriver not installed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_ui(tiny_run):
    """One MLflow UI for this module's tests (it takes tens of seconds to start)."""
    _require_browser()
    wd, uri, _ = tiny_run
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "ui", "--workdir", str(wd),
                             "--port", str(port)],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        first_line = proc.stdout.readline()
        assert url in first_line and "127.0.0.1" in first_line
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        else:
            raise TimeoutError("MLflow UI did not start")
        yield url, uri
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)


@pytest.fixture
def driver():
    """A headless Chromium session, closed after the test."""
    _require_browser()
    session = _browser()
    yield session
    session.quit()


def _browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run", "--window-size=1600,1200"):
        opts.add_argument(flag)
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)


def _wait_for_text(driver, texts, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = driver.find_element("tag name", "body").text
        if all(t in body for t in texts):
            return body
        time.sleep(1)
    raise AssertionError(f"page never showed {texts}; it showed:\n{body[:3000]}")


def _click_text(driver, text: str) -> None:
    driver.find_element("xpath", f"//*[normalize-space(text())='{text}']").click()


def test_parent_run_page_shows_metrics_and_report(mlflow_ui, driver, tmp_path):
    url, uri = mlflow_ui
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("selfsup")
    parent = next(r for r in client.search_runs([exp.experiment_id])
                  if "mlflow.parentRunId" not in r.data.tags)
    run_url = f"{url}/#/experiments/{exp.experiment_id}/runs/{parent.info.run_id}"
    driver.get(run_url)
    _wait_for_text(driver, ["masks.scored_tokens", "ingest.kept"])
    driver.save_screenshot(str(tmp_path / "mlflow-run.png"))
    if os.environ.get("SELFSUP_UPDATE_DOCS") == "1":
        driver.save_screenshot(str(ROOT / "docs" / "mlflow-run.png"))
    driver.get(f"{run_url}/artifacts")
    _wait_for_text(driver, ["report"])
    _click_text(driver, "report")
    _wait_for_text(driver, ["report.md", "macro_f1_vs_fraction.png"])
    _click_text(driver, "report.md")
    _wait_for_text(driver, ["selfsup comparison", "What the numbers say"])
    driver.save_screenshot(str(tmp_path / "mlflow-report.png"))
    assert (tmp_path / "mlflow-run.png").stat().st_size > 10_000


def _runs(uri: str):
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("selfsup")
    return client, exp, client.search_runs([exp.experiment_id])


def _stage_run(uri: str, stage: str):
    """(client, experiment, the run of `stage` with its inputs)."""
    client, exp, runs = _runs(uri)
    run = next(r for r in runs if r.data.tags.get("selfsup.stage") == stage)
    return client, exp, client.get_run(run.info.run_id)


def test_experiment_opens_on_the_runs_list(mlflow_ui, driver, tmp_path):
    """Not on the GenAI traces overview: the experiment is a model-training one."""
    url, uri = mlflow_ui
    _, exp, runs = _runs(uri)
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    driver.get(ui_url(url, exp.experiment_id))
    body = _wait_for_text(driver, [parent.info.run_name, "matching runs"])
    driver.save_screenshot(str(tmp_path / "mlflow-experiment.png"))
    assert f"/experiments/{exp.experiment_id}/runs" in driver.current_url
    assert "workflowType=machine_learning" in driver.current_url
    assert "No data available for the selected time range" not in body


def test_stage_run_page_lists_the_splits_it_read(mlflow_ui, driver, tmp_path):
    url, uri = mlflow_ui
    _, exp, finetune = _stage_run(uri, "finetune")
    datasets = {i.dataset.name: i.dataset for i in finetune.inputs.dataset_inputs}
    assert set(datasets) == {"train", "val", "test"}
    train = f"train ({datasets['train'].digest})"
    driver.get(ui_url(url, exp.experiment_id, finetune.info.run_id))
    body = _wait_for_text(driver, ["Datasets", train, "Training"])
    about = body[body.index("About this run"):]
    assert about.split("\nDatasets\n", 1)[1].startswith(train), about[:600]  # not "None"
    # the dataset drawer: every split, its context, digest, size and source file
    driver.find_elements("xpath", f"//*[contains(normalize-space(.), '{train}')]")[-1].click()
    rows = json.loads(datasets["train"].profile)["num_rows"]
    _wait_for_text(driver, ["3 datasets used", train, "Training",
                            f"val ({datasets['val'].digest})", "Validation",
                            f"test ({datasets['test'].digest})", "Test",
                            f"num rows: {rows}", "train_docs.parquet"])
    driver.save_screenshot(str(tmp_path / "mlflow-datasets.png"))


def test_the_kept_classifier_shows_as_a_logged_and_registered_model(mlflow_ui, driver, tmp_path):
    url, uri = mlflow_ui
    client, exp, finetune = _stage_run(uri, "finetune")
    (model,) = client.search_logged_models(experiment_ids=[exp.experiment_id])
    assert model.source_run_id == finetune.info.run_id and model.status == "READY"
    version = finetune.data.tags["selfsup.registered_model"].rsplit("/", 1)[1]
    # the finetune run's page: its logged model in "Logged models (1)", and the registered
    # version under "Registered models" in "About this run" (not "None")
    driver.get(ui_url(url, exp.experiment_id, finetune.info.run_id))
    body = _wait_for_text(driver, ["Logged models (1)",
                                   f"Registered models\nselfsup-classifier\nv{version}"])
    logged = body[body.index("Logged models (1)"):][:400]  # the table's header and row
    assert "classifier" in logged and "Ready" in logged, logged
    driver.save_screenshot(str(tmp_path / "mlflow-finetune-run.png"))
    # the experiment's Models tab: the logged model, ready, logged from the finetune run
    driver.get(f"{url}/#/experiments/{exp.experiment_id}/models?workflowType=machine_learning")
    _wait_for_text(driver, ["classifier", "Ready", "finetune", "selfsup-classifier"])
    driver.save_screenshot(str(tmp_path / "mlflow-models.png"))
    # the Model Registry page
    driver.get(f"{url}/#/models")
    _wait_for_text(driver, ["Registered Models", "selfsup-classifier", f"Version {version}"])
