"""The learning-rate schedule and optimiser that pretraining and fine-tuning share.

Both are registered Keras objects whose whole configuration round-trips
through `get_config`, so a checkpoint restores them exactly.
"""

from __future__ import annotations

import math

import keras
from keras import ops

from selfsup_model.saving import serializable

# Variables never weight-decayed, by name: LayerNorm scales and offsets, biases, embeddings.
NO_DECAY = ("bias", "gamma", "beta", "embeddings")
DECAYS = ("cosine", "linear")


@serializable
class WarmupDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup to `peak` over `warmup_steps`, then cosine or linear decay to 0 at
    `total_steps`.

    Keras passes the number of updates already applied, so update k (0-based)
    uses schedule(k): the first warmup update has a nonzero rate.
    """

    def __init__(self, peak: float, warmup_steps: int, total_steps: int, decay: str = "cosine"):
        if decay not in DECAYS:
            raise ValueError(f"decay must be one of {DECAYS}, got {decay!r}")
        self.peak, self.warmup_steps, self.total_steps, self.decay = (
            peak, warmup_steps, total_steps, decay)

    def __call__(self, step):
        step = ops.cast(step, "float32") + 1.0
        warm = self.peak * step / max(self.warmup_steps, 1)
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = ops.clip((step - self.warmup_steps) / span, 0.0, 1.0)
        if self.decay == "cosine":
            decayed = 0.5 * self.peak * (1.0 + ops.cos(math.pi * progress))
        else:
            decayed = self.peak * (1.0 - progress)
        return ops.where(step <= self.warmup_steps, warm, decayed)

    def get_config(self):
        return {"peak": self.peak, "warmup_steps": self.warmup_steps,
                "total_steps": self.total_steps, "decay": self.decay}


@serializable
class SelectiveAdamW(keras.optimizers.AdamW):
    """AdamW that never decays variables whose name contains one of `no_decay`.

    The exclusion is part of the config, so an optimiser restored from a
    checkpoint keeps it (Keras' own exclusion is a method call that is lost).
    """

    def __init__(self, *args, no_decay: tuple[str, ...] | list[str] = NO_DECAY, **kwargs):
        super().__init__(*args, **kwargs)
        self.no_decay = tuple(no_decay)
        self.exclude_from_weight_decay(var_names=list(self.no_decay))

    def get_config(self):
        return {**super().get_config(), "no_decay": list(self.no_decay)}
