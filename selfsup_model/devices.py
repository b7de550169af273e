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


def xla_dropout_warning(jit: bool, dropout: float, setting: str) -> str | None:
    """Why `setting` (a dropout rate > 0) under XLA on a CPU is a bad idea, or None.

    TensorFlow's XLA on a CPU draws random numbers very slowly: with dropout inside the encoder a
    fine-tuning update took 1.5x as long with XLA as without (benchmarks/README.md)."""
    if not jit or dropout <= 0 or keras.backend.backend() != "tensorflow" or gpu_available():
        return None
    return (f"XLA on a CPU with {setting}={dropout:g}: TensorFlow's random draws under XLA make "
            f"each step slower than without XLA; set {setting}=0 or turn jit off")
