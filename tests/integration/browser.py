"""Headless Chromium against a local MLflow UI: shared by the browser test and by the command that
takes the docs' screenshots from a real run.

    .venv/bin/python -m tests.integration.browser --workdir data/runs/default --out docs

writes docs/mlflow-runs.png (the experiment's runs list) and docs/mlflow-finetune-run.png (the
finetune run: the splits it read as datasets, its logged and registered classifier).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from mlflow.tracking import MlflowClient

from flows.tracking import default_tracking_uri, ui_url
from tests.integration.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@dataclasses.dataclass
class ServedUI:
    url: str
    proc: subprocess.Popen  # `selfsup ui`
    lines: list[str]  # its stdout and stderr (MLflow's access log included), drained as written
    drain: threading.Thread

    def output(self) -> str:
        """Everything it wrote, once it has exited (the pipe closed)."""
        self.drain.join(timeout=30)
        return "".join(self.lines)


@contextlib.contextmanager
def serve_ui(workdir: Path) -> Iterator[ServedUI]:
    """`selfsup ui` over the workdir's store on a free loopback port; yields it once it answers,
    and stops it, as a user does (SIGTERM to selfsup), on exit if it still runs."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "ui", "--workdir", str(workdir),
                             "--port", str(port)],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        first_line = proc.stdout.readline()
        assert url in first_line and "127.0.0.1" in first_line, first_line
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        else:
            raise TimeoutError("MLflow UI did not start")
        # Read on as it writes: a full pipe would block MLflow's access log, and the server.
        lines = [first_line]
        drain = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        drain.start()
        yield ServedUI(url, proc, lines, drain)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def browser(width: int = 1600, height: int = 1200):
    """A headless Chromium session (the caller quits it)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run", f"--window-size={width},{height}"):
        opts.add_argument(flag)
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)


def wait_for_text(driver, texts, timeout=60, until=None) -> str:
    """The page's text once it shows every one of `texts` (and `until(text)` holds: a table
    whose header renders before its rows)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = driver.find_element("tag name", "body").text
        if all(t in body for t in texts) and (until is None or until(body)):
            return body
        time.sleep(1)
    raise AssertionError(f"page never showed {texts}; it showed:\n{body[:3000]}")


def runs(uri: str):
    """(client, the selfsup experiment, its runs)."""
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("selfsup")
    return client, exp, client.search_runs([exp.experiment_id])


def stage_run(uri: str, stage: str):
    """(client, experiment, the newest run of `stage`, with its inputs)."""
    client, exp, found = runs(uri)
    run = next(r for r in found if r.data.tags.get("selfsup.stage") == stage)
    return client, exp, client.get_run(run.info.run_id)


def _click_if_present(driver, css: str) -> None:
    for element in driver.find_elements("css selector", css):
        element.click()
        time.sleep(1)


def take_doc_screenshots(workdir: Path, out: Path) -> list[Path]:
    """The runs list (the parent run expanded into its stage runs) and the finetune run's page of
    the run in `workdir`, as PNGs in `out`."""
    uri = default_tracking_uri(workdir)
    _, exp, found = runs(uri)
    parent = next(r for r in found if "mlflow.parentRunId" not in r.data.tags)
    _, _, finetune = stage_run(uri, "finetune")
    written = []
    with serve_ui(workdir) as served:
        url = served.url
        driver = browser(1600, 1000)
        try:
            driver.get(ui_url(url, exp.experiment_id))
            wait_for_text(driver, [parent.info.run_name, "matching runs"])
            _click_if_present(driver, f"[data-component-id='{_ASSISTANT_CLOSE}']")
            _click_if_present(driver, f"[data-component-id$='{_EXPAND_RUN}']")
            wait_for_text(driver, ["finetune", "pretrain", "ingest"])
            time.sleep(2)  # let the table finish drawing
            written.append(out / "mlflow-runs.png")
            driver.save_screenshot(str(written[-1]))
            driver.set_window_size(1600, 1900)  # datasets, registered and logged model in view
            driver.get(ui_url(url, exp.experiment_id, finetune.info.run_id))
            wait_for_text(driver, ["Datasets", "Logged models (1)", "Registered models"])
            _click_if_present(driver, f"[data-component-id='{_ASSISTANT_CLOSE}']")
            time.sleep(2)
            written.append(out / "mlflow-finetune-run.png")
            driver.save_screenshot(str(written[-1]))
        finally:
            driver.quit()
    return written


# MLflow 3's UI: the assistant side panel, and the button that unfolds a parent run's children.
_ASSISTANT_CLOSE = "mlflow.assistant.chat_panel.close"
_EXPAND_RUN = "runnamecellrenderer.tsx_46"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True, help="a finished run's workdir")
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="where the PNGs go")
    args = parser.parse_args(argv)
    if not (CHROMIUM and CHROMEDRIVER):
        parser.error("needs chromium and chromedriver (apt-get install chromium chromium-driver)")
    for path in take_doc_screenshots(args.workdir, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
