"""The CLI: user errors are one line on stderr with exit code 2; report --json is
machine-readable."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.cli import main
from flows.settings import read_settings
from tasks.registry import stages_shaped_by

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str, cwd: Path = ROOT) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items()
           if k != "TF_CPP_MIN_LOG_LEVEL"}  # the CLI's own default
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    return proc, time.perf_counter() - t0


def test_unknown_setting_exits_2_with_one_line(capsys):
    assert main(["run", "--set", "ingest.bogus=1", "--no-tracking"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["selfsup: error: invalid configuration: ingest.bogus: unknown key"]


def test_missing_corpus_exits_2(tmp_path, capsys):
    code = main(["run", "--corpus", str(tmp_path / "nope"), "--workdir", str(tmp_path / "wd"),
                 "--no-tracking"])
    assert code == 2
    assert "does not exist" in capsys.readouterr().err


def test_unknown_stage_exits_2(tmp_path, capsys):
    assert main(["run", "--only", "nosuch", "--workdir", str(tmp_path), "--no-tracking"]) == 2
    assert "stages are: ingest" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "message"), [
    (["--dask-address", "tcp://127.0.0.1:8786"], "needs executor 'dask'"),
    (["--executor", "dask", "--shards", "0"], "shards must be at least 1"),
    (["--executor", "threads", "--workers", "0"], "workers must be at least 1"),
    (["--executor", "dask", "--dask-address", "tcp://127.0.0.1:8786", "--workers", "2"],
     "has the workers it has"),
])
def test_bad_executor_settings_exit_2_before_anything_runs(tmp_path, capsys, args, message):
    assert main(["run", "--workdir", str(tmp_path / "wd"), "--no-tracking", *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "wd").exists()


@pytest.mark.usefixtures("prefect_harness")
def test_run_flow_then_report_json(folder_corpus, tmp_path, mlflow_uri, capsys):
    wd = str(tmp_path / "wd")
    assert main(["run", "--corpus", str(folder_corpus), "--preset", "tiny", "--only", "ingest",
                 "--workdir", wd]) == 0
    capsys.readouterr()
    assert main(["report", "--workdir", wd, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["stages"]["ingest"]["counts"]["kept"] == 4
    assert report["accounting"]["balanced"] is True


def test_console_script_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "flows.cli", "--help"], capture_output=True,
                         text=True, check=True)
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


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    (tmp_path / "empty").mkdir()
    (tmp_path / "notext.csv").write_text("body,label\nhello there,a\n", encoding="utf-8")
    return {
        "missing path": (["--corpus", str(tmp_path / "nope")], "does not exist"),
        "empty folder": (["--corpus", str(tmp_path / "empty")], "holds no .txt files"),
        "table without text": (["--corpus", str(tmp_path / "notext.csv")], "has no 'text' column"),
        "unknown setting": (["--set", "nope.key=1"], "nope: unknown key"),
    }


def test_bad_input_answers_at_once_in_one_line(tmp_path):
    for case, (args, message) in _bad_inputs(tmp_path).items():
        proc, seconds = _cli("run", *args, "--workdir", str(tmp_path / "wd"))
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, (case, proc.stderr)
        assert (len(lines) == 1 and lines[0].startswith("selfsup: error: ")
                and message in lines[0]), (case, lines)
        assert seconds < 3.0, f"{case}: {seconds:.1f}s"
        assert not (tmp_path / "wd").exists(), case  # refused before any work


def test_stages_and_report_answer_without_tensorflow_or_prefect(tiny_run):
    wd, _, _ = tiny_run
    probe = ("import sys; from flows.cli import main; main({args!r}); "
             "print('LOADED', sorted(m for m in ('tensorflow', 'keras', 'prefect', 'mlflow') "
             "if m in sys.modules))")
    for args in (["stages", "--workdir", str(wd)], ["report", "--workdir", str(wd)]):
        proc = subprocess.run([sys.executable, "-c", probe.format(args=args)], cwd=ROOT,
                              capture_output=True, text=True, timeout=60, check=True)
        assert "LOADED []" in proc.stdout, (args, proc.stdout[-500:])


def test_workdir_remembers_how_it_was_made(tiny_run, capsys):
    wd, _, _ = tiny_run
    settings = read_settings(wd)
    assert (settings.preset == "tiny" and settings.corpus == "pydocs"
            and settings.config.model.hidden == 16)
    # No --preset: the stored tiny settings, so nothing is stale (a demo preset would make all
    # stale).
    assert main(["stages", "--workdir", str(wd)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 10 and all(line.split()[1] == "up-to-date" for line in lines), lines
    # --set applies on top of the stored settings, not of the default preset.
    assert main(["stages", "--workdir", str(wd), "--set", "compare.seed=9"]) == 0
    status = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()}
    assert (status["compare"] == "stale" and status["masks"] == "up-to-date"
            and status["pretrain"] == "up-to-date")


def test_changed_settings_name_the_stages_that_rerun():
    downstream_of_tokenizer = ["tokenizer", "encode", "masks", "pretrain", "finetune", "baseline",
                               "compare"]
    assert stages_shaped_by(["config.tokenizer.vocab_size"]) == downstream_of_tokenizer
    # finetune reads the encoder, compare the pretrain manifest; baseline never reads pretraining.
    assert stages_shaped_by(["config.masks.seed"]) == ["masks", "pretrain", "finetune", "compare"]
    assert stages_shaped_by(["config.compare.bootstrap"]) == ["compare"]
    assert stages_shaped_by(["corpus"])[0] == "ingest" and len(stages_shaped_by(["corpus"])) == 10
    assert stages_shaped_by(["config.experiment"]) == []
