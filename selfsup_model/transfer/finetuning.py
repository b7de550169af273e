"""Training a classifier under the fair protocol, the same for every neural method.

Every run, whatever its method, gets:
- a budget in optimizer updates: `epochs` passes over its training subset, but
  never fewer than `min_updates` nor more than `max_updates`, so a 5% subset is
  not starved of updates and a 100% subset is not given unbounded ones;
- one peak learning rate for all trainable weights (the caller searches a grid),
  reached by linear warmup over `warmup_fraction` of the updates, then linear
  decay to zero;
- validation macro-F1 `evals` times over the budget (`check_points`: shared out
  among the stages by length, at least once per stage and at each stage's end),
  early stopping after `patience` checks without improvement, and the best
  weights kept.

Modes: ``full`` (a pretrained backbone, everything trains), ``scratch`` (the same
architecture, freshly initialised: the random-init baseline) and ``staged``
(gradual unfreezing: the head alone on frozen features, then the top blocks,
then everything at a lower rate). A stage is kept only if it raised validation
macro-F1 over the stages before it; otherwise its weights are discarded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence

import keras
import numpy as np

from selfsup_model.config import FinetuneConfig
from selfsup_model.errors import UserError
from selfsup_model.nn.model import with_dropout
from selfsup_model.nn.optimizers import RestartableAdamW
from selfsup_model.pretraining.devices import (
    agreed,
    local_share,
    no_distribution,
    process_count,
    process_local,
    resolve_jit,
    xla_dropout_warning,
)
from selfsup_model.report.metrics import macro_f1
from selfsup_model.transfer.classify import (
    build_classifier,
    check_encoder_length,
    encoder_inputs,
    predict_probabilities,
)
from selfsup_model.transfer.features import feature_extractor, predict_in_batches

log = logging.getLogger("selfsup.finetuning")

MODES = ("full", "scratch", "staged")


def update_budget(n_train: int, cfg: FinetuneConfig) -> int:
    """Optimizer updates of a whole run (all stages together): `epochs` passes over `n_train`
    documents, clipped to [min_updates, max_updates]."""
    per_epoch = math.ceil(n_train / cfg.batch_size)
    return min(max(cfg.min_updates, cfg.epochs * per_epoch), cfg.max_updates)


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str  # "all", or for staged: "head", "top", "all"
    updates: int
    learning_rate: float
    layer_decay: float = 1.0  # the rate of a variable d layers below the top: decay ** d times


def plan_stages(mode: str, updates: int, learning_rate: float, cfg: FinetuneConfig,
                layer_decay: float = 1.0) -> list[Stage]:
    """One stage for full and scratch; head, top blocks, everything (at a lower rate) for staged,
    each a third of the same budget."""
    if mode != "staged":
        return [Stage("all", updates, learning_rate, layer_decay)]
    if updates < 3:
        raise UserError(f"staged fine-tuning needs at least 3 updates, one per stage, but the "
                        f"budget is {updates}; raise finetune.min_updates")
    third = max(1, updates // 3)
    return [Stage("head", third, learning_rate, layer_decay),
            Stage("top", third, learning_rate, layer_decay),
            Stage("all", max(1, updates - 2 * third), learning_rate * cfg.staged_final_lr_scale,
                  layer_decay)]


def check_points(stage_updates: Sequence[int], evals: int) -> list[list[int]]:
    """Per stage, the update counts within it (1-based, ascending) after which validation
    macro-F1 is checked.

    A run gets `evals` checks in all whatever its mode, so a staged run has as many chances to
    be selected on validation as a full one: they are shared out among the stages in proportion
    to their lengths (largest remainder, ties to the earlier stage), every stage gets at least
    one, at its end (it decides whether the stage is kept), and never more than its updates.
    Within a stage of u updates, n checks fall at ceil(j * u / n), j = 1..n.
    """
    if evals < 1 or not stage_updates or min(stage_updates) < 1:
        raise ValueError(f"need evals >= 1 and stages of >= 1 update (got {evals}, "
                         f"{list(stage_updates)})")
    total_updates, total = sum(stage_updates), max(evals, len(stage_updates))
    quota = [total * u / total_updates for u in stage_updates]
    counts = [max(1, math.floor(q)) for q in quota]
    by_remainder = sorted(range(len(quota)), key=lambda k: (-(quota[k] - math.floor(quota[k])), k))
    for k in by_remainder[: max(0, total - sum(counts))]:
        counts[k] += 1
    while sum(counts) > total:  # the one-per-stage floor overshot: take from the largest share
        k = max(range(len(counts)), key=lambda i: (counts[i], -i))
        counts[k] -= 1
    return [[math.ceil(j * u / n) for j in range(1, n + 1)]
            for u, n in zip(stage_updates, (min(c, u) for c, u in zip(counts, stage_updates)))]


@dataclasses.dataclass(frozen=True)
class ClassifierResult:
    model: keras.Model  # at its best validation check
    mode: str
    learning_rate: float
    layer_decay: float
    val_macro_f1: float  # of the returned model
    updates_run: int  # optimizer updates actually applied (early stopping may cut the budget)
    best_update: int  # the update count at the kept weights
    train_time_s: float
    history: list[dict]  # per validation check: stage, update, val_macro_f1
    stages: list[dict]  # per stage: name, updates, learning_rate, best val macro-F1, kept
    val_predictions: np.ndarray  # (n_val,) class ids, one per validation document
    val_probabilities: np.ndarray  # (n_val, classes) float32: what val_predictions arg-maxes
    predictions: dict[str, np.ndarray]  # eval-set name -> (n,) class ids
    # (windows (m, L), owner (m,) or None) -> class probabilities (documents, classes), one row
    # per document (per window row when owner is None), from the kept weights through the
    # method's compiled trainer: for sets only the selected runs need (the caller's test set).
    probabilities: Callable[..., np.ndarray]

    def predict(self, ids: np.ndarray, owner: np.ndarray | None = None) -> np.ndarray:
        """Class ids (the arg-max of `probabilities`), one per document (or row)."""
        return np.argmax(self.probabilities(ids, owner), axis=-1).astype(np.int64)


def train_classifier(backbone_factory: Callable[[], keras.Model],
                     train: tuple[np.ndarray, np.ndarray], val: tuple[np.ndarray, np.ndarray],
                     num_classes: int, mode: str, cfg: FinetuneConfig, seed: int,
                     learning_rate: float,
                     eval_sets: Mapping[str, np.ndarray] | None = None,
                     trainers: StageTrainers | None = None,
                     budget_documents: int | None = None,
                     val_owner: np.ndarray | None = None,
                     layer_decay: float = 1.0) -> ClassifierResult:
    """Train one classifier in `mode` at one peak learning rate; select on validation only.

    `backbone_factory()` returns a fresh backbone per call (full fine-tuning
    changes the weights it is given; ``scratch`` re-initialises a clone).
    `train`/`val` are (framed windows (N, L) int32, class ids (N,)); `eval_sets`
    are windows only, predicted once with the selected weights. `trainers`, shared by
    every run of one method, reuses its compiled train and predict steps; a run's
    result does not depend on which runs came before it. `budget_documents`: the documents
    the update budget counts, when `train` holds several windows per document (default: one
    per row). `val_owner` (one per validation row, non-decreasing): the validation document
    of each row, when a document has several; its labels are then one per document, and a
    document's prediction is the class of highest mean probability over its rows.
    `layer_decay`: a variable d layers below the top learns at layer_decay ** d times the rate
    (`optimizers.layer_depths`; 1.0: every layer alike).
    """
    if mode not in MODES:
        raise UserError(f"unknown fine-tuning mode {mode!r}; choose one of {', '.join(MODES)}")
    train_ids, train_y = _check_split("train", train, num_classes)
    val_ids, val_y = _check_split("val", val, num_classes, val_owner)
    keras.utils.set_random_seed(seed)
    # The run's own model: its initial weights (and dropout seeds), then the selected ones;
    # with several training processes each holds a whole copy on its own device.
    with process_local():
        # scratch: the same architecture (causal too) with freshly initialised weights.
        # Every layer that draws is seeded by `seed` explicitly, not through Python's global
        # `random`, which other threads of the process draw from too.
        backbone = with_dropout(backbone_factory(), cfg.encoder_dropout,
                                keep_weights=mode != "scratch", seed=seed)
        model = build_classifier(backbone, num_classes, cfg.pooling, cfg.dropout, seed=seed)
    for name, ids in (("train", train_ids), ("val", val_ids), *(eval_sets or {}).items()):
        check_encoder_length(name, ids, backbone)
    train_ids, val_ids = encoder_inputs(backbone, train_ids), encoder_inputs(backbone, val_ids)
    budget = update_budget(len(train_y) if budget_documents is None else budget_documents, cfg)
    run = ClassifierRun(model, backbone, (train_ids, train_y), (val_ids, val_y), cfg,
                        np.random.default_rng(seed), trainers=trainers, val_owner=val_owner)
    start = time.perf_counter()
    stages = plan_stages(mode, budget, learning_rate, cfg, layer_decay)
    for stage, checks in zip(stages, check_points([s.updates for s in stages], cfg.evals)):
        run.train_stage(stage, checks)
    run.restore_best()

    def probabilities(ids: np.ndarray, owner: np.ndarray | None = None) -> np.ndarray:
        check_encoder_length("eval", ids, backbone)
        return run.probabilities(encoder_inputs(backbone, ids), owner)

    return ClassifierResult(
        model=model, mode=mode, learning_rate=learning_rate, layer_decay=layer_decay,
        val_macro_f1=macro_f1(val_y, run.best_val_pred), updates_run=run.updates,
        best_update=run.best_update, train_time_s=time.perf_counter() - start,
        history=run.history, stages=run.stages, val_predictions=run.best_val_pred,
        val_probabilities=run.best_val_proba,
        predictions={name: np.argmax(run.probabilities(encoder_inputs(backbone, ids)), -1)
                     for name, ids in (eval_sets or {}).items()},
        probabilities=probabilities)


class StageTrainers:
    """Compiled classifiers of one method, one per kind of stage, shared by all its runs.

    Compiling a classifier's train step costs seconds on CPU (tracing, then XLA),
    as much as a short run's own updates, and every run of a method (each learning
    rate, seed and label fraction) has the same architecture. So each kind of stage
    compiles once: ``all`` (everything trains), ``top`` (the top blocks train) and
    ``head`` (the head alone, on pooled features). A run copies its weights, and its
    dropout seeds, in at the start of a stage and out at the end, and the optimizer
    restarts from zero, so what a run learns does not depend on the runs before it.
    Frozen features for the head stage are computed once per set of windows.

    With several training processes the trainers' weights span every process's devices,
    which no one process can run inference on: each process predicts through its own copy
    of a trainer (`predict`), synced from it, and computes features on the run's own copy.
    """

    def __init__(self) -> None:
        self._models: dict[str, keras.Model] = {}
        self._local: dict[str, keras.Model] = {}
        self._features: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}

    def trainer(self, kind: str, model: keras.Model, cfg: FinetuneConfig) -> keras.Model:
        """The compiled model for `kind` (built like `model` on first use)."""
        if kind not in self._models:
            trainer = _head_model(model) if kind == "head" else keras.models.clone_model(model)
            if kind != "head":
                _set_trainable(_backbone_of(trainer), kind, cfg.staged_top_blocks)
            optimizer = RestartableAdamW(weight_decay=cfg.weight_decay, global_clipnorm=1.0)
            jit = resolve_jit(cfg.jit)
            if slow := xla_dropout_warning(jit, trainer):
                log.warning(slow)
            trainer.compile(optimizer=optimizer,
                            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                            jit_compile=jit)
            optimizer.build(trainer.trainable_variables)
            self._models[kind] = trainer
        return self._models[kind]

    def probabilities(self, kind: str, trainer: keras.Model, ids: np.ndarray,
                      cfg: FinetuneConfig, owner: np.ndarray | None = None) -> np.ndarray:
        """Class probabilities of `ids` (per document with `owner`, see
        `predict_probabilities`) from the current weights of `kind`'s trainer."""
        if process_count() == 1:
            return predict_probabilities(trainer, ids, cfg.eval_batch_size, owner)
        if kind not in self._local:
            with no_distribution():  # built alike, uncompiled: inference only
                self._local[kind] = keras.Model.from_config(trainer.get_config())
        local = self._local[kind]
        local.set_weights(trainer.get_weights())  # each process reads its own replica
        with no_distribution():
            return predict_probabilities(local, ids, cfg.eval_batch_size, owner)

    def features(self, model: keras.Model, ids: np.ndarray, cfg: FinetuneConfig) -> np.ndarray:
        """Pooled features of the frozen encoder of `model` (the run's own) for `ids`, cached
        by content: the head stage always starts from the same encoder weights."""
        key = (hashlib.blake2b(np.ascontiguousarray(ids).tobytes(), digest_size=16).hexdigest(),
               ids.shape)
        if key not in self._features:
            with process_local():
                extractor = feature_extractor(_backbone_of(model), cfg.pooling)
                self._features[key] = predict_in_batches(extractor, ids, cfg.eval_batch_size)
        return self._features[key]


def copy_state(source: keras.Model, target: keras.Model) -> None:
    """Every variable of `source` (weights and dropout seed states) into `target`, built
    alike."""
    src, dst = source.variables, target.variables
    if [_layout(v) for v in src] != [_layout(v) for v in dst]:
        raise RuntimeError(f"models {source.name} and {target.name} are not built alike")
    for a, b in zip(src, dst):
        _assign_copy(b, a)


class ClassifierRun:
    """The state of one classifier run across its stages: data order, best weights, records.

    `model` holds the run's weights between stages; each stage trains the shared compiled
    trainer of its kind (`StageTrainers`) and hands the weights back.
    """

    def __init__(self, model, backbone, train, val, cfg: FinetuneConfig, rng: np.random.Generator,
                 trainers: StageTrainers | None = None, val_owner: np.ndarray | None = None):
        self.model, self.backbone, self.cfg, self.rng = model, backbone, cfg, rng
        self.trainers = trainers if trainers is not None else StageTrainers()
        (self.train_ids, self.train_y), (self.val_ids, self.val_y) = train, val
        self.val_owner = val_owner  # the document of each validation row (None: one row each)
        self.updates, self.best_update, self.best_f1 = 0, 0, -1.0
        self.best_weights: list[np.ndarray] | None = None
        self.best_val_pred = np.zeros(len(self.val_y), np.int64)
        self.best_val_proba = np.zeros((len(self.val_y), 0), np.float32)
        self.history: list[dict] = []
        self.stages: list[dict] = []

    def probabilities(self, ids: np.ndarray, owner: np.ndarray | None = None) -> np.ndarray:
        """Class probabilities from the run's current weights (through the compiled ``all``
        trainer, or this process's copy of it, `StageTrainers.probabilities`)."""
        trainer = self.trainers.trainer("all", self.model, self.cfg)
        copy_state(self.model, trainer)
        return self.trainers.probabilities("all", trainer, ids, self.cfg, owner)

    def restore_best(self) -> None:
        if self.best_weights is not None:
            self.model.set_weights(self.best_weights)

    def train_stage(self, stage: Stage, checks: Sequence[int]) -> None:
        """Train `stage`, checking validation after each update count in `checks` (within the
        stage, ascending, the last one the stage's end: `check_points`)."""
        if not checks or list(checks) != sorted(set(checks)) or checks[-1] != stage.updates:
            raise ValueError(f"checks {list(checks)} must rise to the stage's {stage.updates} "
                             "updates")
        trainer = self.trainers.trainer(stage.name, self.model, self.cfg)
        if stage.name == "head":
            x_train = self.trainers.features(self.model, self.train_ids, self.cfg)
            x_val = self.trainers.features(self.model, self.val_ids, self.cfg)
            _copy_head(self.model, trainer)
        else:
            x_train, x_val = self.train_ids, self.val_ids
            copy_state(self.model, trainer)
        warmup = round(self.cfg.warmup_fraction * stage.updates)
        trainer.optimizer.restart(stage.learning_rate, warmup, stage.updates, stage.layer_decay)
        # (updates, B) indices into the training subset; with several training processes each
        # feeds its share of every batch (`devices.local_share`).
        order = local_share(self._batches(stage.updates), axis=1)
        waited, stage_best, kept, done = 0, -1.0, False, 0
        for point in checks:
            rows, done = order[done:point], point
            idx = rows.reshape(-1)
            trainer.fit(x_train[idx], self.train_y[idx], batch_size=rows.shape[1], epochs=1,
                        shuffle=False, verbose=0)
            self.updates += len(rows)
            val_proba = self.trainers.probabilities(stage.name, trainer, x_val, self.cfg,
                                                    self.val_owner)
            val_pred = np.argmax(val_proba, axis=-1).astype(np.int64)
            f1 = macro_f1(self.val_y, val_pred)
            self.history.append({"stage": stage.name, "update": self.updates, "val_macro_f1": f1})
            stage_best = max(stage_best, f1)
            # strict: a tie keeps the earlier, cheaper weights. Every process takes process 0's
            # branch, so all train the same updates.
            if agreed(f1 > self.best_f1):
                self._hand_back(stage.name, trainer)
                self.best_f1, self.best_update = f1, self.updates
                self.best_val_pred, self.best_val_proba = val_pred, val_proba
                self.best_weights = self.model.get_weights()
                waited, kept = 0, True  # the stage raised validation macro-F1
            else:
                waited += 1
                if waited >= self.cfg.patience:
                    break
        if kept:  # continue from where the stage ended
            self._hand_back(stage.name, trainer)
        else:  # validation says this stage did not help: continue from the weights before it
            self.restore_best()
        self.stages.append({"stage": stage.name, "updates": stage.updates,
                            "learning_rate": stage.learning_rate,
                            "layer_decay": stage.layer_decay, "val_macro_f1": stage_best,
                            "kept": kept})
        log.info("stage %s: best val macro-F1 %.4f (%s)", stage.name, stage_best,
                 "kept" if kept else "discarded")

    def _hand_back(self, kind: str, trainer: keras.Model) -> None:
        """The stage trainer's weights into the run's model."""
        if kind == "head":
            _copy_head(trainer, self.model)
        else:
            self.model.set_weights(trainer.get_weights())

    def _batches(self, updates: int) -> np.ndarray:
        """Seeded passes over the training subset, cut into `updates` rows of batch indices."""
        size, n = self.cfg.batch_size, len(self.train_y)
        passes = math.ceil(updates * size / n)
        stream = np.concatenate([self.rng.permutation(n) for _ in range(passes)])
        return stream[: updates * size].reshape(updates, size)


def _layout(variable) -> tuple:
    """A variable's place in a model, the same in a clone (seed states are numbered
    globally, so only their shape counts)."""
    path = "seed" if "seed_generator" in variable.path else variable.path
    return path, tuple(variable.shape)


def _backbone_of(classifier: keras.Model) -> keras.Model:
    (backbone,) = [layer for layer in classifier.layers if isinstance(layer, keras.Model)]
    return backbone


def _head_model(classifier: keras.Model) -> keras.Model:
    """pooled (B, H) -> logits: fresh copies of the classifier's dropout and dense head."""
    dropout, dense = classifier.get_layer("head_dropout"), classifier.get_layer("head_logits")
    pooled = keras.Input(shape=(dense.kernel.shape[0],), name="pooled")
    copy = [type(layer).from_config(layer.get_config()) for layer in (dropout, dense)]
    return keras.Model(pooled, copy[1](copy[0](pooled)), name="head_only")


def _copy_head(source: keras.Model, target: keras.Model) -> None:
    """The head's weights and its dropout's seed state."""
    for name in ("head_dropout", "head_logits"):
        for a, b in zip(source.get_layer(name).variables, target.get_layer(name).variables):
            _assign_copy(b, a)


def _assign_copy(target, source) -> None:
    """`target` takes a copy of `source`'s value, never its buffer: under JAX a compiled train
    step donates (frees) its variables' buffers, which would free the other model's too. With
    several training processes a trainer's value spans them all; each process copies its own
    replica."""
    value = source.value
    if process_count() > 1:
        value = keras.ops.convert_to_numpy(value)
    target.assign(keras.ops.copy(value))


def _set_trainable(backbone: keras.Model, kind: str, top_blocks: int) -> None:
    backbone.trainable = True
    if kind == "top":
        blocks = [layer.name for layer in backbone.layers if layer.name.startswith("block_")]
        top = set(blocks[-top_blocks:]) | {"final_norm"}
        for layer in backbone.layers:
            layer.trainable = layer.name in top


def _check_split(name: str, split: tuple[np.ndarray, np.ndarray], num_classes: int,
                 owner: np.ndarray | None = None):
    ids, y = np.asarray(split[0]), np.asarray(split[1])
    if ids.ndim != 2 or len(ids) == 0:
        raise UserError(f"{name} ids must be a non-empty (n_docs, max_len) array "
                        f"(got shape {ids.shape})")
    if owner is not None:
        owner = np.asarray(owner)
        if (len(owner) != len(ids) or np.any(np.diff(owner) < 0)
                or not np.array_equal(np.unique(owner), np.arange(len(y)))):
            raise UserError(f"{name}: each of its {len(ids)} windows needs its document, in "
                            f"order, and each of its {len(y)} documents a window")
    elif len(y) != len(ids):
        raise UserError(f"{name} has {len(ids)} sequences but {len(y)} labels")
    if not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= num_classes:
        raise UserError(f"{name} labels must be class ids in [0, {num_classes})")
    if name == "train" and len(np.unique(y)) < 2:
        raise UserError("the training subset holds a single label; classification needs at least 2")
    return ids.astype(np.int32), y.astype(np.int64)
