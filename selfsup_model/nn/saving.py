"""Saving and loading Keras artifacts: one registration decorator, one loader.

Every custom layer, model, metric, optimiser and schedule the pipeline saves is
registered under the package name "selfsup" with `serializable`. A `.keras`
file names those classes, so loading it needs them imported first;
`load_keras_model` does that, which makes it the one way to open any saved
artifact (`encoder.keras`, `pretrain_model.keras`, `classifier.keras`, a
checkpoint) in a fresh interpreter:

    from selfsup_model.nn.saving import load_keras_model
    model = load_keras_model("data/runs/default/pretrain/pretrain_model.keras")
"""

from __future__ import annotations

import importlib
import os

import keras

PACKAGE = "selfsup"
serializable = keras.saving.register_keras_serializable(package=PACKAGE)

# Modules whose import registers the classes saved artifacts refer to.
# Every saved class lives in nn/, so loading needs nothing from later in the pipeline.
_REGISTERING_MODULES = ("selfsup_model.nn.layers", "selfsup_model.nn.pooling",
                        "selfsup_model.nn.losses", "selfsup_model.nn.model",
                        "selfsup_model.nn.optimizers")


def load_keras_model(path: str | os.PathLike) -> keras.Model:
    """Load a `.keras` artifact written by selfsup, with `safe_mode=True` (no arbitrary code)."""
    for name in _REGISTERING_MODULES:
        importlib.import_module(name)
    return keras.saving.load_model(path, safe_mode=True)
