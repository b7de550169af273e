"""The registered classifier as users consume it: `mlflow.pyfunc.load_model("models:/...")` and
a real `mlflow models serve` on 127.0.0.1, each giving the labels `selfsup predict` gives."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlflow
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from flows.cli import main

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def registered(tiny_run, tmp_path_factory):
    """(workdir, store URI, model URI, a few test texts, what `selfsup predict` says of them)."""
    wd, uri, _ = tiny_run
    client = MlflowClient(uri)
    finetune = next(r for r in client.search_runs(
        [client.get_experiment_by_name("selfsup").experiment_id])
        if r.data.tags.get("selfsup.stage") == "finetune")
    model_uri = finetune.data.tags["selfsup.registered_model"]
    assert model_uri.startswith("models:/selfsup-classifier/")
    docs = pd.read_parquet(wd / "ingest" / "documents.parquet", columns=["id", "text"])
    assign = pd.read_parquet(wd / "split" / "assignments.parquet")
    docs = docs[docs["id"].isin(assign.loc[assign["split"] == "test", "id"])].head(12)
    out = tmp_path_factory.mktemp("predict") / "p.parquet"
    table = out.with_name("in.parquet")
    docs.to_parquet(table)
    assert main(["predict", str(table), "--workdir", str(wd), "--out", str(out)]) == 0
    return wd, uri, model_uri, docs, pd.read_parquet(out)


def test_the_registered_model_round_trips_through_pyfunc(registered):
    _, uri, model_uri, docs, expected = registered
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        model = mlflow.pyfunc.load_model(model_uri)
        got = model.predict(docs[["text"]].reset_index(drop=True))
        signature = model.metadata.signature
    finally:
        mlflow.set_tracking_uri(before)
    assert got["label"].tolist() == expected["label"].tolist()
    classes = [c[2:] for c in expected.columns if c.startswith("p_")]
    pd.testing.assert_frame_equal(got[["probability", *(f"p_{c}" for c in classes)]],
                                  expected[["probability", *(f"p_{c}" for c in classes)]],
                                  check_dtype=False, atol=1e-6)
    assert signature.inputs.input_names() == ["text"]
    assert signature.outputs.input_names() == ["label", "probability",
                                               *(f"p_{c}" for c in classes)]
    with pytest.raises(Exception, match="no text to classify"):
        model.predict(pd.DataFrame({"text": ["fine text", "   "]}))
    # A null text reaches predict as NaN after MLflow's schema check: missing, not "nan".
    with pytest.raises(Exception, match=r"rows \[1\] have no text"):
        model.predict(pd.DataFrame({"text": ["fine text", None]}))


def test_mlflow_models_serve_answers_like_selfsup_predict(registered, tmp_path):
    _, uri, model_uri, docs, expected = registered
    port = _free_port()
    # The scoring server is uvicorn from this environment (on PATH when the venv is active).
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri,
           "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "models", "serve", "-m", model_uri, "--env-manager",
         "local", "--host", "127.0.0.1", "--port", str(port)],
        env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{base}/ping", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the scoring server did not start"
            time.sleep(1)
        answer = _invoke(base, docs["text"].tolist())
        one = []  # latency of a one-document request, once the server is warm
        for text in docs["text"].head(5):
            t0 = time.perf_counter()
            _invoke(base, [text])
            one.append(time.perf_counter() - t0)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, 15)
        server.wait(timeout=30)
        log.close()
    labels = [row["label"] for row in answer["predictions"]]
    assert labels == expected["label"].tolist()
    print(f"serve latency, one document per request: median {sorted(one)[2] * 1000:.0f} ms")


def _invoke(base: str, texts: list[str]) -> dict:
    body = json.dumps({"dataframe_split": {"columns": ["text"],
                                           "data": [[t] for t in texts]}}).encode()
    request = urllib.request.Request(f"{base}/invocations", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read())
