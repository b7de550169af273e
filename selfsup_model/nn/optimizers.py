"""The learning-rate schedule and optimiser that pretraining and fine-tuning share.

Both are registered Keras objects whose whole configuration round-trips
through `get_config`, so a checkpoint restores them exactly.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import keras
from keras import ops

from selfsup_model.nn.saving import serializable

# Variables never weight-decayed, by name: LayerNorm scales and offsets, biases, embeddings.
NO_DECAY = ("bias", "gamma", "beta", "embeddings")
DECAYS = ("cosine", "linear")


def warmup_decay(step, peak, warmup_steps, total_steps, decay: str = "linear"):
    """The rate of update `step` (0-based) of `total_steps`: linear warmup over the first
    `warmup_steps` updates, the last of them at `peak` (update k < warmup_steps gets
    peak * (k + 1) / warmup_steps), then cosine or linear decay from `peak` at update
    `warmup_steps` towards 0 at update `total_steps`, one past the last: linearly, update k gets
    peak * (total_steps - k) / (total_steps - warmup_steps), so the last update still moves
    the weights. The numbers may be Python scalars or tensors (a compiled step that reads them
    from variables serves runs with other settings)."""
    step = ops.cast(step, "float32") + 1.0  # 1-based: updates done once this one is applied
    warmup = ops.cast(warmup_steps, "float32")
    warm = peak * step / ops.maximum(warmup, 1.0)
    span = ops.maximum(ops.cast(total_steps, "float32") - warmup, 1.0)
    progress = ops.clip((step - 1.0 - warmup) / span, 0.0, 1.0)
    if decay == "cosine":
        decayed = 0.5 * peak * (1.0 + ops.cos(math.pi * progress))
    else:
        decayed = peak * (1.0 - progress)
    return ops.where(step <= warmup, warm, decayed)


@serializable
class WarmupDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup to `peak` over `warmup_steps`, then cosine or linear decay towards 0,
    reached one update after the last of `total_steps` (`warmup_decay`).

    Keras passes the number of updates already applied, so update k (0-based)
    uses schedule(k): the first warmup update and the last update both have a nonzero rate.
    """

    def __init__(self, peak: float, warmup_steps: int, total_steps: int, decay: str = "cosine"):
        if decay not in DECAYS:
            raise ValueError(f"decay must be one of {DECAYS}, got {decay!r}")
        self.peak, self.warmup_steps, self.total_steps, self.decay = (
            peak, warmup_steps, total_steps, decay)

    def __call__(self, step):
        return warmup_decay(step, self.peak, self.warmup_steps, self.total_steps, self.decay)

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


_BOTTOM = re.compile(r"^(embeddings|embeddings_norm|bag_embedding)/")
_BLOCK = re.compile(r"(?:^|/)block_(\d+)/")


def layer_depths(paths: Sequence[str]) -> list[int]:
    """How many layers below the top each variable sits, by its path: the embeddings (layer 0)
    are n + 1 below for n encoder blocks, block i (layer i + 1) n - i, and everything above the
    blocks (final norm, pooling, the classifier head) 0. Layer-wise decay scales a variable's
    learning rate by decay ** depth."""
    blocks = [int(m.group(1)) for p in paths if (m := _BLOCK.search(p))]
    n = max(blocks) + 1 if blocks else 0
    depths = []
    for path in paths:
        if _BOTTOM.search(path):
            depths.append(n + 1)
        elif m := _BLOCK.search(path):
            depths.append(n - int(m.group(1)))
        else:
            depths.append(0)
    return depths


class RestartableAdamW(SelectiveAdamW):
    """SelectiveAdamW for many short runs through one compiled train step.

    The schedule (linear warmup to a peak, then linear decay to 0) reads its peak,
    warmup and length from optimizer variables, so `restart()` can zero the moments
    and the update count and set a new schedule without retracing the step (which
    costs seconds per run on CPU, more than a short fine-tuning run's own updates).
    So does the layer-wise decay: a variable `layer_depths` puts d layers below the top
    is updated at decay ** d times the scheduled rate (1: every layer at the same rate;
    weight decay keeps the scheduled rate).
    Fine-tuning only: it is never saved, so it is not registered for loading.
    """

    def __init__(self, **kwargs):
        super().__init__(learning_rate=0.0, **kwargs)

    def build(self, variables):
        super().build(variables)
        self._run = [self.add_variable((), initializer="zeros", name=name)
                     for name in ("run_peak", "run_warmup", "run_total", "run_layer_decay")]
        self._depths = layer_depths([v.path for v in variables])

    def _get_current_learning_rate(self):
        peak, warmup, total, _ = self._run
        return warmup_decay(self._iterations, peak, warmup, total, "linear")

    def update_step(self, gradient, variable, learning_rate):
        depth = self._depths[self._get_variable_index(variable)]
        if depth:
            scale = ops.power(ops.cast(self._run[3], "float32"), float(depth))
            learning_rate = learning_rate * ops.cast(scale, learning_rate.dtype)
        super().update_step(gradient, variable, learning_rate)

    def restart(self, peak: float, warmup_steps: int, total_steps: int,
                layer_decay: float = 1.0) -> None:
        """Forget every previous update and follow a new schedule from update 0."""
        if not self.built:
            raise RuntimeError("build the optimizer (with the trainable variables) first")
        if not 0.0 < layer_decay <= 1.0:
            raise ValueError(f"layer_decay must be in (0, 1], got {layer_decay}")
        for variable in self.variables:
            variable.assign(ops.zeros(variable.shape, variable.dtype))
        for variable, value in zip(self._run, (peak, warmup_steps, total_steps, layer_decay)):
            variable.assign(float(value))
