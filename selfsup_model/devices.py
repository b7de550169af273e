"""What the local accelerator offers, and the settings that follow from it ('auto' choices)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import keras

log = logging.getLogger("selfsup.devices")


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


def data_parallel(batch_size: int):
    """Keras' `DataParallel` over this process's devices when the backend is JAX and it has
    more than one (GPUs, or host devices forced with XLA_FLAGS); None otherwise, or when
    SELFSUP_DATA_PARALLEL=off.

    Each device computes its slice of every global batch on replicated weights. The
    token-weighted loss stays exact: it is one SPMD program over the global batch, so its
    sums run over every replica's tokens before the division. The TensorFlow backend stays on
    one device."""
    import os

    from selfsup_model.errors import UserError

    if keras.backend.backend() != "jax" or os.environ.get("SELFSUP_DATA_PARALLEL") == "off":
        return None
    devices = keras.distribution.list_devices()
    if len(devices) < 2:
        return None
    if batch_size % len(devices):
        raise UserError(f"batch size {batch_size} does not divide over {len(devices)} devices "
                        f"({', '.join(devices)}); choose a multiple of {len(devices)}, or set "
                        "SELFSUP_DATA_PARALLEL=off to train on one")
    return keras.distribution.DataParallel(devices=devices)


@contextlib.contextmanager
def data_parallel_scope(batch_size: int, what: str) -> Iterator[None]:
    """Run the block under `data_parallel(batch_size)` when it applies (models built inside
    hold replicated weights and every batch is split over the devices); else as is."""
    distribution = data_parallel(batch_size)
    if distribution is None:
        yield
        return
    devices = distribution.device_mesh.devices.ravel()
    log.info("%s: data-parallel over %d devices: %s", what, len(devices),
             ", ".join(map(str, devices)))
    with distribution.scope():
        yield
