"""Review in a real browser: `selfsup ui` over a tiny run's store, the parent run page in
headless Chromium.

Needs Debian's chromium and chromium-driver (.ci/run installs them). Without them the test is
skipped, unless SELFSUP_REQUIRE_BROWSER=1 (set by CI), where a missing browser is a failure.
"""

from __future__ import annotations

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


@pytest.fixture
def mlflow_ui(tiny_run):
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


def test_parent_run_page_shows_metrics_and_report(mlflow_ui, tmp_path):
    _require_browser()
    url, uri = mlflow_ui
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("selfsup")
    parent = next(r for r in client.search_runs([exp.experiment_id])
                  if "mlflow.parentRunId" not in r.data.tags)
    run_url = f"{url}/#/experiments/{exp.experiment_id}/runs/{parent.info.run_id}"
    driver = _browser()
    try:
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
    finally:
        driver.quit()
    assert (tmp_path / "mlflow-run.png").stat().st_size > 10_000
