"""The two callbacks of a pretraining run: metric reporting and checkpointing.

`MetricsReporter` turns the running sums of the model's `TokenWeightedLoss`
metric into a token-weighted loss over the steps since the previous report
(differences of sums, divided once), counts the input positions and the real
(non-[PAD]) tokens each step fed (from an injected `step_tokens(step)`, so
bucketed batches count the positions they really have), runs validation, and
hands everything to an injected `log_metrics(metrics, step)`. Its state
(history, the partly filled report window, counters) travels inside each
checkpoint. A small journal of the steps handed to each log destination (an
MLflow run id) stops a resumed run from reporting a step twice to the same
place; a resumed run that logs somewhere new (each attempt of a stage gets its
own MLflow run) first replays the history up to its checkpoint there, so the run
that finishes holds the whole curve.

`CheckpointSaver` writes the whole training model (weights + optimiser state)
at the end of every "epoch" (= `checkpoint_every` steps) as
`ckpt-<step>.keras` via a temp name + `os.replace`, then `latest.json`
(atomically) naming it, then deletes older checkpoints: a kill at any moment
leaves a `latest.json` that names a complete file.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras

from selfsup_model.artifacts import atomic_write_json, save_keras_atomic

LATEST = "latest.json"
JOURNAL = "reported_steps.txt"
LogFn = Callable[[dict[str, float], int], None]
# step (0-based) -> (rows, length, real tokens) of its input_ids: `PretrainBatches.step_tokens`
StepTokensFn = Callable[[int], tuple[int, int, int]]


def _seed_states(model: keras.Model) -> list:
    return [v for v in model.non_trainable_variables if "seed_generator_state" in v.path]


def rng_state(model: keras.Model) -> list[list[int]]:
    """Dropout seed-generator states, in the model's variable order.

    A `.keras` file does not keep them (they are re-drawn on load), so without
    this a resumed run would draw different dropout masks than an uninterrupted one. By
    order, not by variable path: Keras numbers seed generators process-wide, so the same
    model built after another one has other paths (and a checkpoint is only resumed by the
    configuration that wrote it, so the order is the same)."""
    return [[int(x) for x in keras.ops.convert_to_numpy(v).ravel()] for v in _seed_states(model)]


def restore_rng_state(model: keras.Model, state: list[list[int]] | dict[str, list[int]]) -> None:
    variables = _seed_states(model)
    if isinstance(state, dict):  # a checkpoint written before states were kept in order
        pairs = [(v, state[v.path]) for v in variables if v.path in state]
    elif len(state) != len(variables):
        raise ValueError(f"the checkpoint keeps {len(state)} dropout seed states but the model "
                         f"has {len(variables)}")
    else:
        pairs = list(zip(variables, state))
    for v, value in pairs:
        v.assign(keras.ops.reshape(keras.ops.convert_to_tensor(value, dtype=v.dtype), v.shape))


def read_checkpoint(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The latest checkpoint record, or None when absent, unreadable or its file is missing."""
    directory = Path(directory)
    try:
        record = json.loads((directory / LATEST).read_text("utf-8"))
        path = directory / record["checkpoint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {**record, "path": path} if path.is_file() else None


def read_journal(directory: str | os.PathLike, destination: str | None = None) -> set[int]:
    """Steps already handed to log_metrics for `destination` (an unterminated last line from a
    kill is ignored). A line is `<destination>\t<step>`; a bare step is destination None."""
    try:
        lines = (Path(directory) / JOURNAL).read_text("utf-8").split("\n")[:-1]
    except OSError:
        return set()
    steps = set()
    for line in lines:
        where, _, step = line.rpartition("\t")
        if where == (destination or "") and step.strip().isdigit():
            steps.add(int(step))
    return steps


class MetricsReporter(keras.callbacks.Callback):
    def __init__(self, *, objective: str, steps_per_epoch: int, total_steps: int,
                 step_tokens: StepTokensFn,
                 log_every: int, eval_every: int, evaluate: Callable[[], dict[str, float]],
                 learning_rate: Callable[[int], float], log_metrics: LogFn | None = None,
                 journal_dir: str | os.PathLike | None = None, state: dict[str, Any] | None = None,
                 log_destination: str | None = None):
        super().__init__()
        self.objective, self.steps_per_epoch, self.total_steps = (
            objective, steps_per_epoch, total_steps)
        self.step_tokens, self.log_every, self.eval_every = (
            step_tokens, log_every, eval_every)
        self.evaluate, self.learning_rate, self.log_metrics = evaluate, learning_rate, log_metrics
        self.journal = Path(journal_dir) / JOURNAL if journal_dir is not None else None
        self.destination = log_destination
        self.reported = (read_journal(journal_dir, log_destination) if journal_dir is not None
                         else set())
        state = state or {}
        self.history: list[dict[str, float]] = list(state.get("history", []))
        self.window = dict(state.get("window", {"loss_sum": 0.0, "weight_sum": 0.0}))
        self.totals = {"scored_tokens": 0.0, "empty_batches": 0.0, "timed_steps": 0,
                       "timed_seconds": 0.0, "timed_positions": 0, "timed_real_tokens": 0,
                       "positions": 0, "real_tokens": 0, **state.get("totals", {})}
        self.epoch, self.step = 0, 0
        self._seen, self._contrastive_seen, self._detection_seen = (0.0, 0.0, 0.0), 0.0, (0.0, 0.0)
        self._t_prev: float | None = None
        self._shapes_run: set[tuple[int, int]] = set()  # input shapes this process has run

    def state(self) -> dict[str, Any]:
        return {"history": self.history, "window": dict(self.window), "totals": dict(self.totals)}

    @property
    def tokens_per_s(self) -> float:
        """Input positions (padding included) per second of timed steps."""
        t = self.totals
        return t["timed_positions"] / t["timed_seconds"] if t["timed_seconds"] > 0 else 0.0

    @property
    def real_tokens_per_s(self) -> float:
        """Real (non-[PAD]) input tokens per second of timed steps."""
        t = self.totals
        return t["timed_real_tokens"] / t["timed_seconds"] if t["timed_seconds"] > 0 else 0.0

    def replay_history(self) -> None:
        """Report the history a resumed run starts with (the steps before its checkpoint) to
        this run's destination, which may be new (a new MLflow run per attempt); steps the
        destination already has are skipped."""
        for entry in self.history:
            self._report(entry["step"], {k: v for k, v in entry.items() if k != "step"})

    def on_epoch_begin(self, epoch, logs=None):
        # Keras resets metric state at every epoch start: the running sums restart at 0.
        self.epoch, self._seen, self._contrastive_seen = epoch, (0.0, 0.0, 0.0), 0.0
        self._detection_seen = (0.0, 0.0)
        self._t_prev = time.perf_counter()  # checkpoint time before this is not step time

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        self.step = self.epoch * self.steps_per_epoch + batch + 1
        rows, length, real = self.step_tokens(self.step - 1)
        self.totals["positions"] += rows * length
        self.totals["real_tokens"] += real
        # A process's first step of each input shape includes tracing/compilation: not timed.
        if (rows, length) in self._shapes_run:
            self.totals["timed_steps"] += 1
            self.totals["timed_seconds"] += now - self._t_prev
            self.totals["timed_positions"] += rows * length
            self.totals["timed_real_tokens"] += real
        self._shapes_run.add((rows, length))
        self._accumulate(logs or {})
        metrics: dict[str, float] = {}
        if self.step % self.log_every == 0 or self.step == self.total_steps:
            metrics.update(self._train_metrics())
        if self.step % self.eval_every == 0 or self.step == self.total_steps:
            metrics.update(self.run_validation())
        if metrics:
            self.emit(self.step, metrics)
        self._t_prev = time.perf_counter()

    def _accumulate(self, logs: dict[str, Any]) -> None:
        name = f"{self.objective}_loss"
        now = (float(logs[f"{name}_sum"]), float(logs["scored_tokens"]),
               float(logs["empty_batches"]))
        loss, weight, empty = (a - b for a, b in zip(now, self._seen, strict=True))
        self._seen = now
        self.window["loss_sum"] += loss
        self.window["weight_sum"] += weight
        if "contrastive_loss_sum" in logs:  # a running sum of per-step values, like the above
            total = float(logs["contrastive_loss_sum"])
            self.window["contrastive_sum"] = (self.window.get("contrastive_sum", 0.0)
                                              + total - self._contrastive_seen)
            self.window["contrastive_steps"] = self.window.get("contrastive_steps", 0) + 1
            self._contrastive_seen = total
        if "rtd_loss_sum" in logs:  # replaced-token detection: the discriminator's own sums
            now_rtd = (float(logs["rtd_loss_sum"]), float(logs["rtd_scored_tokens"]))
            rtd_loss, rtd_weight = (a - b for a, b in zip(now_rtd, self._detection_seen,
                                                          strict=True))
            self._detection_seen = now_rtd
            self.window["rtd_sum"] = self.window.get("rtd_sum", 0.0) + rtd_loss
            self.window["rtd_weight"] = self.window.get("rtd_weight", 0.0) + rtd_weight
            self.totals["rtd_scored_tokens"] = (self.totals.get("rtd_scored_tokens", 0.0)
                                                + rtd_weight)
        self.totals["scored_tokens"] += weight
        self.totals["empty_batches"] += empty

    def _train_metrics(self) -> dict[str, float]:
        w = self.window
        out = ({f"train/{self.objective}_loss": w["loss_sum"] / w["weight_sum"]}
               if w["weight_sum"] > 0 else {})
        if w.get("contrastive_steps"):
            out["train/contrastive_loss"] = w["contrastive_sum"] / w["contrastive_steps"]
        out["train/scored_tokens"] = w["weight_sum"]
        if w.get("rtd_weight"):
            out["train/rtd_loss"] = w["rtd_sum"] / w["rtd_weight"]
            out["train/rtd_scored_tokens"] = w["rtd_weight"]
        out["train/empty_batches"] = self.totals["empty_batches"]
        out["train/learning_rate"] = self.learning_rate(self.step)
        out["train/tokens_seen"] = self.totals["positions"]
        out["train/real_tokens_seen"] = self.totals["real_tokens"]
        if self.totals["timed_seconds"] > 0:
            out["train/tokens_per_s"] = self.tokens_per_s
            out["train/real_tokens_per_s"] = self.real_tokens_per_s
        self.window = {"loss_sum": 0.0, "weight_sum": 0.0}
        return out

    def run_validation(self) -> dict[str, float]:
        _ = self.model  # under JAX, reading .model syncs the trained state into the layers
        return self.evaluate()

    def emit(self, step: int, metrics: dict[str, float]) -> None:
        """Record in the history (one entry per step) and report once per step, ever."""
        metrics = {k: float(v) for k, v in metrics.items()}
        if self.history and self.history[-1]["step"] == step:
            self.history[-1].update(metrics)
        else:
            self.history.append({"step": step, **metrics})
        self._report(step, metrics)

    def _report(self, step: int, metrics: dict[str, float]) -> None:
        if self.log_metrics is None or step in self.reported:
            return
        self.log_metrics(metrics, step)
        self.reported.add(step)
        if self.journal is not None:
            with open(self.journal, "a", encoding="utf-8") as fh:
                fh.write(f"{self.destination or ''}\t{step}\n")


class CheckpointSaver(keras.callbacks.Callback):
    def __init__(self, directory: str | os.PathLike, *, steps_per_epoch: int, total_steps: int,
                 reporter: MetricsReporter, fingerprint: str):
        super().__init__()
        self.directory = Path(directory)
        self.steps_per_epoch, self.total_steps = steps_per_epoch, total_steps
        self.reporter, self.fingerprint = reporter, fingerprint

    def on_epoch_end(self, epoch, logs=None):
        step = min((epoch + 1) * self.steps_per_epoch, self.total_steps)
        name = f"ckpt-{step:08d}.keras"
        save_keras_atomic(self.model, self.directory / name)
        atomic_write_json(self.directory / LATEST, {
            "checkpoint": name, "step": step, "epoch": epoch, "fingerprint": self.fingerprint,
            "reporter": self.reporter.state(), "rng": rng_state(self.model),
            "saved_at": time.time(),
        })
        for old in self.directory.glob("ckpt-*.keras"):
            if old.name != name:
                old.unlink(missing_ok=True)
