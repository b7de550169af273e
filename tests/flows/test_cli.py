"""The CLI: user errors are one line on stderr with exit code 2; report --json is machine-readable."""

import json
import subprocess
import sys

import pytest

from flows.cli import main


def test_unknown_setting_exits_2_with_one_line(capsys):
    assert main(["run", "--set", "ingest.bogus=1", "--no-tracking"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["selfsup: error: invalid configuration: ingest.bogus: unknown key"]


def test_missing_corpus_exits_2(tmp_path, capsys):
    code = main(["run", "--corpus", str(tmp_path / "nope"), "--workdir", str(tmp_path / "wd"), "--no-tracking"])
    assert code == 2
    assert "does not exist" in capsys.readouterr().err


def test_unknown_stage_exits_2(tmp_path, capsys):
    assert main(["run", "--only", "nosuch", "--workdir", str(tmp_path), "--no-tracking"]) == 2
    assert "stages are: ingest" in capsys.readouterr().err


@pytest.mark.usefixtures("prefect_harness")
def test_run_flow_then_report_json(folder_corpus, tmp_path, mlflow_uri, capsys):
    wd = str(tmp_path / "wd")
    assert main(["run", "--corpus", str(folder_corpus), "--preset", "tiny", "--only", "ingest", "--workdir", wd]) == 0
    capsys.readouterr()
    assert main(["report", "--workdir", wd, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["stages"]["ingest"]["counts"]["kept"] == 4
    assert report["accounting"]["balanced"] is True


def test_console_script_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "flows.cli", "--help"], capture_output=True, text=True, check=True)
    for command in ("run", "stages", "report", "ui"):
        assert command in out.stdout


def test_stages_lists_status_in_order(tiny_run, capsys):
    wd, _, _ = tiny_run
    assert main(["stages", "--preset", "tiny", "--workdir", str(wd)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines][:3] == ["ingest", "dedup", "split"]
    assert all(line.split()[1] == "up-to-date" for line in lines), lines
    assert main(["stages", "--preset", "tiny", "--workdir", str(wd), "--set", "masks.seed=9"]) == 0
    status = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()}
    assert status["masks"] == "stale" and status["encode"] == "up-to-date"
