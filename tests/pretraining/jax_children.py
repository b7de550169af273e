"""The environment of a child process that runs Keras on JAX on this machine's CPU."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# XLA's LLVM back end without optimisation: the test programs are tiny, so compiling them is most
# of a JAX test's time (62 s -> 37 s for the one-process run of the loopback test). Both sides of
# every comparison compile with the same flags.
FAST_COMPILE = "--xla_backend_optimization_level=0"


def jax_env(devices: int = 1) -> dict[str, str]:
    """os.environ for a JAX-on-CPU child with `devices` host devices and fast compiles."""
    flags = FAST_COMPILE + (f" --xla_force_host_platform_device_count={devices}"
                            if devices > 1 else "")
    return {**os.environ, "PYTHONPATH": str(ROOT), "KERAS_BACKEND": "jax",
            "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
