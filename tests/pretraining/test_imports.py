"""The training path needs keras, numpy, a backend and pydantic: a GPU box with JAX and no
TensorFlow (and none of our orchestration or data-prep packages) must still train."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.pretraining.jax_children import ROOT, jax_env

# Each import of these raises inside the child, before and after keras loads: keras is free to
# treat them as optional, our modules are not allowed to need them.
_CHILD = textwrap.dedent("""
    import importlib.abc, sys, tempfile
    BANNED = {"prefect", "mlflow", "yaml", "tokenizers", "pandas", "sklearn"}

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BANNED:
                raise ImportError(f"blocked: {name}")

    sys.meta_path.insert(0, Block())
    import numpy as np
    from selfsup_model.config import MaskingConfig, ModelConfig, PretrainConfig
    from selfsup_model.text.masking import make_static_masks
    from selfsup_model.pretraining.loop import pretrain

    rng = np.random.default_rng(0)
    windows = rng.integers(7, 40, size=(16, 8)).astype(np.int32)
    windows[:, 0], windows[:, -1] = 2, 3
    masks = MaskingConfig(max_predictions=2)
    val = make_static_masks(windows[:4], masks, 40, seed=0)
    cfg = PretrainConfig(batch_size=4, steps=2, warmup_steps=1, log_every=1, eval_every=2, \
checkpoint_every=2)
    model = ModelConfig(hidden=8, layers=1, heads=2, ff=16, dropout=0.0)
    result = pretrain(windows, val, 40, model, cfg, masks, tempfile.mkdtemp(), progress=False)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BANNED)
    print("steps", result.steps, "loaded", loaded)
""")

# The GPU machine has JAX and no TensorFlow: the JAX path, dropout's random draws included, must
# train with tensorflow unimportable (keras only probes for it, e.g. in set_random_seed).
_JAX_CHILD = (_CHILD.replace('BANNED = {', 'BANNED = {"tensorflow", ')
              .replace("dropout=0.0", "dropout=0.1")
              .replace('print("steps"', 'import keras; print(keras.backend.backend(), "steps"'))


def test_pretraining_runs_without_orchestration_or_data_prep_packages():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps 2 loaded []" in proc.stdout


def test_jax_pretraining_never_imports_tensorflow():
    if os.environ.get("SELFSUP_REQUIRE_JAX") != "1":  # CI installs the jax extra and sets it
        pytest.importorskip("jax")
    proc = subprocess.run([sys.executable, "-c", _JAX_CHILD], cwd=ROOT, env=jax_env(),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "jax steps 2 loaded []" in proc.stdout
