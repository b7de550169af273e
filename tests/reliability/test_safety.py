"""Safety: safe model loading from hashed artifacts, no pickle, loopback-only servers, no Prefect
result pickles."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

import flows.cli
from flows.pipeline import export_flow, pipeline_flow, predict_flow, stage_flow
from tasks.registry import STAGE_NAMES, stage_tasks

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for pkg in ("flows", "tasks", "selfsup_model")
                 for p in (ROOT / pkg).rglob("*.py"))


def _calls(pattern: str) -> list[tuple[Path, str]]:
    found = []
    for path in SOURCES:
        text = path.read_text()
        found += [(path, m.group(0)) for m in re.finditer(pattern, text, flags=re.DOTALL)]
    return found


def test_every_keras_model_load_uses_safe_mode():
    # Keras' load_model, not _load_model, nor MLflow's pyfunc.load_model (it runs our
    # classifier_pyfunc.py, whose Keras load is one of those checked here)
    loads = _calls(r"(?<!\w)(?<!pyfunc\.)load_model\((?:[^()]|\([^()]*\))*\)")
    assert loads, "expected model loading somewhere"
    unsafe = [(p.name, call) for p, call in loads if "safe_mode=True" not in call]
    assert unsafe == []


def test_no_pickle_anywhere_in_results_or_artifacts():
    assert _calls(r"\bimport pickle\b|\bfrom pickle\b|cloudpickle|joblib\.dump|"
                  r"allow_pickle=True") == []
    assert _calls(r"\.to_pickle\(|read_pickle\(") == []


@pytest.mark.parametrize("name", STAGE_NAMES)
def test_tasks_persist_no_results(name):
    # Prefect would otherwise pickle task return values to its result store.
    assert stage_tasks()[name].persist_result is False


def test_flows_persist_no_results():
    assert all(flow.persist_result is False for flow in (pipeline_flow, stage_flow, predict_flow))


def test_ui_binds_to_loopback(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(flows.cli, "serve_mlflow", lambda cmd, env: seen.append((cmd, env)) or 0)
    monkeypatch.delenv("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", raising=False)
    flows.cli.main(["ui", "--workdir", str(tmp_path), "--port", "5999"])
    monkeypatch.setenv("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "true")
    flows.cli.main(["ui", "--workdir", str(tmp_path), "--port", "5999"])
    (cmd, env), (_, asked) = seen
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--workers") + 1] == "1"  # one process: half MLflow's start-up time
    # Without MLflow's job runner and its queue consumers, unless the user asks for them.
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    assert asked["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "true"
    assert env["PATH"] == os.environ["PATH"]  # the rest of the caller's environment


def test_ui_refuses_no_workers(capsys, tmp_path):
    assert flows.cli.main(["ui", "--workdir", str(tmp_path), "--workers", "0"]) == 2
    assert "--workers must be at least 1 (got 0)" in capsys.readouterr().err


def test_documented_servers_bind_to_loopback():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "prefect.yaml"]
    text = "".join(page.read_text() for page in pages)
    servers = re.findall(r"(?:prefect server start|mlflow (?:ui|server))[^\n`]*", text)
    assert servers and all("--host 127.0.0.1" in s for s in servers), servers
    assert "0.0.0.0" not in text


def test_prefect_yaml_entrypoints_resolve_and_parameters_validate():
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    flows_by_entry = {"flows/pipeline.py:pipeline_flow": pipeline_flow,
                      "flows/pipeline.py:stage_flow": stage_flow,
                      "flows/pipeline.py:predict_flow": predict_flow,
                      "flows/pipeline.py:export_flow": export_flow}
    for dep in spec["deployments"]:
        flow = flows_by_entry[dep["entrypoint"]]
        schema = flow.parameters.model_dump()
        assert set(dep["parameters"]) <= set(schema["properties"]), dep["name"]
        assert dep["concurrency_limit"] == {"limit": 1, "collision_strategy": "CANCEL_NEW"}
    weekly = next(d for d in spec["deployments"] if d["name"] == "weekly")
    assert weekly["schedules"][0]["timezone"] == "UTC"
