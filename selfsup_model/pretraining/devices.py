"""What the local accelerator offers, and the settings that follow from it ('auto' choices)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

# Keras (and TensorFlow with it) is imported by the functions that use it, so that a run that
# never trains (the corpus stages) can ask whether it is one of several processes without it.
if TYPE_CHECKING:
    import keras

log = logging.getLogger("selfsup.devices")


def gpu_available() -> bool:
    import keras

    return any(d.lower().startswith("gpu") for d in keras.distribution.list_devices())


def resolve_precision(setting: str) -> str:
    """Dtype policy name; 'auto' is mixed bfloat16 on a GPU and float32 on CPU."""
    if setting == "bf16" or (setting == "auto" and gpu_available()):
        return "mixed_bfloat16"
    return "float32"


def resolve_jit(setting: str) -> bool:
    """'auto': XLA on a GPU, and always under JAX (un-jitted JAX runs op by op). On a CPU under
    TensorFlow 'auto' is off, as Keras chooses; presets that measured XLA faster say 'on'."""
    import keras

    if setting != "auto":
        return setting == "on"
    return keras.backend.backend() == "jax" or gpu_available()


def xla_dropout_warning(jit: bool, model: keras.Model) -> str | None:
    """Why compiling `model` with XLA on a CPU is a bad idea, or None.

    TensorFlow's random ops under XLA on a CPU are very slow (one attention-sized dropout took
    ~400x as long as no dropout; benchmarks/README.md). `layers.FastDropout` draws by a counter
    hash there instead; a plain `keras.layers.Dropout` with a rate > 0 (a backbone saved before
    FastDropout existed) still uses TensorFlow's draws."""
    import keras

    if not jit or keras.backend.backend() != "tensorflow" or gpu_available():
        return None
    from selfsup_model.nn.layers import FastDropout

    slow = sorted({layer.name for layer in model._flatten_layers(include_self=False)
                   if isinstance(layer, keras.layers.Dropout)
                   and not isinstance(layer, FastDropout) and layer.rate > 0})
    if not slow:
        return None
    return (f"XLA on a CPU with keras dropout layers {', '.join(slow)}: TensorFlow's random "
            "draws under XLA make each step slower than without XLA; set their rate to 0 or "
            "turn jit off")


def join_processes() -> int:
    """Join the processes named by Keras' launch variables, once, and return their count.

    With ``KERAS_DISTRIBUTION_NUM_PROCESSES`` > 1 (and ``KERAS_DISTRIBUTION_JOB_ADDRESSES``,
    ``KERAS_DISTRIBUTION_PROCESS_ID``) under JAX, `keras.distribution.initialize` connects this
    process to the others (process 0 is the coordinator); it must run before the process's
    first JAX computation. Otherwise there is one process."""
    import os

    from selfsup_model.errors import UserError

    wanted = int(os.environ.get("KERAS_DISTRIBUTION_NUM_PROCESSES", "1") or 1)
    if wanted <= 1:
        return 1
    import keras

    if keras.backend.backend() != "jax":
        raise UserError("several training processes (KERAS_DISTRIBUTION_NUM_PROCESSES="
                        f"{wanted}) need KERAS_BACKEND=jax")
    import jax

    if not _JOINED:
        keras.distribution.initialize()
        _JOINED.append(True)
    return jax.process_count()


_JOINED: list[bool] = []


def broadcast_int(value: int) -> int:
    """Process 0's `value`, in every training process (a collective: all must call it)."""
    import numpy as np
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def agreed(value: bool) -> bool:
    """`value` where one process trains; with several, process 0's, so that every process
    takes the same branch (a collective then: all must call it)."""
    return bool(broadcast_int(int(value))) if process_count() > 1 else value


def local_share(batch, axis: int = 0):
    """This process's contiguous share of a global batch along `axis` (all of it in one
    process). Keras assembles the global batch from the processes' shares in process order,
    so the shares of processes 0..n-1 side by side are the batch itself."""
    count = process_count()
    if count == 1:
        return batch
    from selfsup_model.errors import UserError

    size = batch.shape[axis]
    if size % count:
        raise UserError(f"a batch of {size} rows does not divide over {count} training "
                        "processes; choose a batch size that does")
    rows, index = size // count, process_index()
    return batch[(slice(None),) * axis + (slice(index * rows, (index + 1) * rows),)]


def process_count() -> int:
    """How many training processes run this computation together (1 unless joined)."""
    if not _JOINED:  # `join_processes` is the only way in: no Keras needed to say so
        return 1
    import jax

    return jax.process_count()


def process_index() -> int:
    """This process's place among the training processes (0: the one that writes)."""
    if not _JOINED:
        return 0
    import jax

    return jax.process_index()


def data_parallel(batch_size: int, across_processes: bool = True):
    """Keras' `DataParallel` over every device of every training process when the backend is
    JAX and there is more than one device (GPUs, host devices forced with XLA_FLAGS, or
    several processes, `join_processes`); None otherwise, or when SELFSUP_DATA_PARALLEL=off
    (one process only).

    Each device computes its slice of every global batch on replicated weights; with several
    processes each feeds its own slice of the global batch (no automatic sharding). The
    token-weighted loss stays exact: it is one SPMD program over the global batch, so its
    sums run over every replica's tokens before the division. The TensorFlow backend stays on
    one device."""
    import os

    import keras

    from selfsup_model.errors import UserError

    processes = join_processes()
    if keras.backend.backend() != "jax" or (
            processes == 1 and os.environ.get("SELFSUP_DATA_PARALLEL") == "off"):
        return None
    if processes > 1 and not across_processes:
        return None  # work that process 0 does alone: on its default device
    devices = keras.distribution.list_devices()
    if len(devices) < 2:
        return None
    if batch_size % len(devices):
        raise UserError(f"batch size {batch_size} does not divide over {len(devices)} devices "
                        f"({', '.join(devices)}); choose a multiple of {len(devices)}, or set "
                        "SELFSUP_DATA_PARALLEL=off to train on one")
    return keras.distribution.DataParallel(devices=devices, auto_shard_dataset=processes == 1)


def process_local():
    """A context in which models built live on this process's own device when several
    processes train together: whole copies that each process can run and save alone. With one
    process, nothing changes."""
    return no_distribution() if process_count() > 1 else contextlib.nullcontext()


@contextlib.contextmanager
def no_distribution() -> Iterator[None]:
    """Variables made inside live on this process's default device only (host copies)."""
    import keras

    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        yield
    finally:
        keras.distribution.set_distribution(previous)


@contextlib.contextmanager
def data_parallel_scope(batch_size: int, what: str,
                        across_processes: bool = True) -> Iterator[None]:
    """Run the block under `data_parallel(batch_size, across_processes)` when it applies (models
    built inside hold replicated weights and every batch is split over the devices); else as
    is."""
    distribution = data_parallel(batch_size, across_processes)
    if distribution is None:
        yield
        return
    devices = distribution.device_mesh.devices.ravel()
    log.info("%s: data-parallel over %d devices: %s", what, len(devices),
             ", ".join(map(str, devices)))
    with distribution.scope():
        yield
