"""What the local accelerator offers, and the settings that follow from it ('auto' choices)."""

from __future__ import annotations

import keras


def gpu_available() -> bool:
    return any(d.lower().startswith("gpu") for d in keras.distribution.list_devices())


def resolve_precision(setting: str) -> str:
    """Dtype policy name; 'auto' is mixed bfloat16 on a GPU and float32 on CPU."""
    if setting == "bf16" or (setting == "auto" and gpu_available()):
        return "mixed_bfloat16"
    return "float32"


def resolve_jit(setting: str) -> bool:
    """'auto': XLA on a GPU, and always under JAX (un-jitted JAX runs op by op). On a CPU under
    TensorFlow 'auto' is off, as Keras chooses; presets that measured XLA faster say 'on'."""
    if setting != "auto":
        return setting == "on"
    return keras.backend.backend() == "jax" or gpu_available()
