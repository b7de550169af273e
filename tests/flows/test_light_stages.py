"""A run that stops before pretraining never loads Keras or TensorFlow: the corpus stages start
in seconds (the operator's `--to split`, a rerun of one early stage, a killed run's rerun)."""

from __future__ import annotations

import json
import os
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
                 "--to", "masks", "--no-tracking"])
    print("exit", code, "loaded", sorted(m for m in sys.modules if m.split(".")[0] in BANNED))
""")


def test_the_stages_before_pretraining_run_without_keras(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    rows = [{"id": f"d{i}", "text": " ".join(f"t{i % 9}w{j} d{i}x{j}" for j in range(12)),
             "label": f"c{i % 2}"} for i in range(40)]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(corpus), str(tmp_path / "wd")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert "exit 0 loaded []" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (tmp_path / "wd" / "masks" / "manifest.json").is_file()
