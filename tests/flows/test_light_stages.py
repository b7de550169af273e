"""A run with no Keras stage to run never loads Keras or TensorFlow: the corpus stages start in
seconds (the operator's `--to split`, a rerun of one early stage, a killed run's rerun), and so
does a rerun that finds every stage from pretraining on up to date."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from prefect.settings import PREFECT_API_URL

ROOT = Path(__file__).resolve().parents[2]
_CHILD = textwrap.dedent("""
    import importlib.abc, sys
    BANNED = {"keras", "tensorflow", "jax", "torch"}

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BANNED:
                raise ImportError(f"blocked: {name}")

    sys.meta_path.insert(0, Block())
    from flows.cli import main
    code = main(["run", "--preset", "tiny", "--corpus", sys.argv[1], "--workdir", sys.argv[2],
                 *sys.argv[3:], "--no-tracking"])
    print("exit", code, "loaded", sorted(m for m in sys.modules if m.split(".")[0] in BANNED))
""")


def _run_without_keras(corpus: str, workdir: Path, *extra: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    proc = subprocess.run([sys.executable, "-c", _CHILD, corpus, str(workdir), *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert "exit 0 loaded []" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stderr


def test_the_stages_before_pretraining_run_without_keras(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    rows = [{"id": f"d{i}", "text": " ".join(f"t{i % 9}w{j} d{i}x{j}" for j in range(12)),
             "label": f"c{i % 2}"} for i in range(40)]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    _run_without_keras(str(corpus), tmp_path / "wd", "--to", "masks")
    assert (tmp_path / "wd" / "masks" / "manifest.json").is_file()


def test_a_rerun_with_every_keras_stage_up_to_date_runs_without_keras(tmp_path, tiny_run):
    wd = tmp_path / "wd"
    shutil.copytree(tiny_run[0], wd, ignore=shutil.ignore_patterns("mlflow.db", "mlartifacts"))
    (wd / "masks" / "manifest.json").unlink()  # masks reruns, to the same bytes
    err = _run_without_keras("pydocs", wd)  # as after a run killed in masks
    assert "masks: running (no valid manifest)" in err
    assert all(f"{stage}: up to date, skipped" in err
               for stage in ("pretrain", "finetune", "baseline")), err[-3000:]
    # the report reads every stage's manifest (wall times), so it is remade, without Keras too
    assert "compare: running (inputs changed: masks/manifest.json)" in err


def test_only_tensorflows_native_lines_are_held_back(capfd):
    from tasks.native_logs import native_line, native_startup_logs_held

    native = [("WARNING: All log messages before absl::InitializeLog() is called are written to "
              "STDERR"),
              ("I0000 00:00:1796582739.060280   23991 cpu_feature_guard.cc:227] This TensorFlow "
              "binary is optimized to use available CPU instructions."),
              ("To enable the following instructions: AVX2 FMA, in other operations, rebuild "
              "TensorFlow with the appropriate compiler flags."),
              ("E0000 00:00:1700000000.000001    17 cuda_dnn.cc:8310] Unable to register cuDNN "
              "factory"),
              ("2024-01-01 12:00:00.000000: I tensorflow/core/util/port.cc:113] oneDNN custom "
              "operations are on.")]
    other = ["12:00:01 selfsup.stage pretrain: running (no valid manifest)",
             "UserWarning: To enable the following is not TensorFlow",
             "I0000 is not a log line"]
    assert [native_line(x) for x in native] == [True] * 5
    assert [native_line(x) for x in other] == [False] * 3
    with native_startup_logs_held():
        os.write(2, "\n".join([native[1], other[0], native[2], other[1]]).encode() + b"\n")
    assert capfd.readouterr().err == f"{other[0]}\n{other[1]}\n"  # the rest, in order
    try:
        with native_startup_logs_held():
            os.write(2, (native[3] + "\n").encode())
            raise ImportError("no backend")
    except ImportError:
        pass
    assert capfd.readouterr().err == native[3] + "\n"  # a failed import shows everything
