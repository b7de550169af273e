"""Transfer experiments: every classification method at every label fraction, on the same documents.

The fair-comparison rules live here, once, for the pretrained encoder and every
baseline alike: one labelled view of the encoded splits (the training split's
classes; with `finetune.read_windows=all` every classifier trains on every window
of its labelled documents, each window carrying its document's label, and
predicts a document as the class of highest mean probability over its windows),
one stratified subset per label fraction shared by all methods, selection on
validation only, and one row format for test predictions and one for training
summaries.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from selfsup_model.artifacts import atomic_write_json, atomic_write_parquet, sha256_arrays
from selfsup_model.config import BaselineConfig, FinetuneConfig
from selfsup_model.corpus.splitting import SPLITS
from selfsup_model.pretraining.devices import data_parallel_scope, process_count, process_index
from selfsup_model.report.comparison import PREDICTION_COLUMNS, SEED_COLUMNS, result_key
from selfsup_model.report.ensemble import PROBABILITIES_FILE, probabilities_key
from selfsup_model.report.metrics import macro_f1
from selfsup_model.text.masking import save_arrays
from selfsup_model.text.windows import document_windows, first_windows
from selfsup_model.transfer.baselines import logreg_on_features, majority_class, tfidf_logreg
from selfsup_model.transfer.classify import stratified_subset
from selfsup_model.transfer.features import frozen_features
from selfsup_model.transfer.finetuning import (
    ClassifierResult,
    StageTrainers,
    train_classifier,
    update_budget,
)

log = logging.getLogger("selfsup.transfer")


@dataclasses.dataclass(frozen=True)
class EncodedWindows:
    """Encode's windows of a split (possibly memory-mapped) and where each labelled document's
    are: labelled document j owns windows[offsets[rows[j]]:offsets[rows[j] + 1]]."""

    windows: np.ndarray  # (W, L') int32
    offsets: np.ndarray  # (docs + 1,) int64, over every document of the split
    rows: np.ndarray  # (n,) int64: the split's document index of each labelled document


@dataclasses.dataclass(frozen=True)
class LabelledSplit:
    ids: np.ndarray  # (n,) str
    labels: np.ndarray  # (n,) str
    windows: np.ndarray  # (n, L) int32: each document's first (truncated) window
    encoded: EncodedWindows | None = None  # None: the first window is all there is

    def windows_of(self, docs: np.ndarray, every_window: bool = True,
                   ) -> tuple[np.ndarray, np.ndarray]:
        """What a classifier reads of documents `docs` (indices into this split): (windows
        (m, L) int32, the position in `docs` of each row's document (m,), non-decreasing).
        Every window of each document, cut like the first; or only the first windows, when
        `every_window` is False or the split has no encoded windows."""
        docs = np.asarray(docs, dtype=np.int64)
        if not every_window or self.encoded is None:
            return self.windows[docs], np.arange(len(docs), dtype=np.int64)
        enc = self.encoded
        return document_windows(enc.windows, enc.offsets, enc.rows[docs], self.windows.shape[1])


@dataclasses.dataclass(frozen=True)
class LabelledData:
    classes: list[str]  # sorted labels of the training split
    splits: dict[str, LabelledSplit]
    counts: dict[str, int]
    window_len: int  # positions of encode's windows (classifiers may read fewer)

    def y(self, split: str) -> np.ndarray:
        """Class index per document (-1 for a label the training split never saw)."""
        index = {c: i for i, c in enumerate(self.classes)}
        return np.array([index.get(label, -1) for label in self.splits[split].labels],
                        dtype=np.int64)

    def scorable(self, split: str) -> np.ndarray:
        """The documents of `split` whose label the training split has: what every method's
        selection scores on validation. A label no classifier can predict would only add a
        class of F1 zero to the macro average, and not to every method's alike."""
        return np.flatnonzero(self.y(split) >= 0)


def load_labelled(encode_dir: Path, max_len: int | None = None) -> LabelledData | None:
    """Labelled documents per split from encode's `{split}_docs.parquet`, `_doc_offsets.npy` and
    `_windows.npy`, or None (with the reason logged) when there is nothing to classify."""
    splits, counts = {}, {}
    for split in SPLITS:
        docs = pd.read_parquet(encode_dir / f"{split}_docs.parquet")
        offsets = np.load(encode_dir / f"{split}_doc_offsets.npy", allow_pickle=False)
        windows = np.load(encode_dir / f"{split}_windows.npy", mmap_mode="r", allow_pickle=False)
        has_label = docs["label"].notna().to_numpy()
        splits[split] = LabelledSplit(docs["id"].to_numpy(str)[has_label],
                                      docs["label"].to_numpy(str)[has_label],
                                      first_windows(windows, offsets, has_label, max_len),
                                      EncodedWindows(windows, offsets, np.flatnonzero(has_label)))
        counts[f"{split}_labelled"] = int(has_label.sum())
        counts[f"{split}_unlabelled"] = int((~has_label).sum())
    classes = sorted(set(splits["train"].labels.tolist()))
    if len(classes) < 2:
        log.warning("classification skipped: the training split has %d label(s); need at least 2",
                    len(classes))
        return None
    data = LabelledData(classes, splits, counts, int(windows.shape[1]))
    for split in ("val", "test"):
        unseen = int((data.y(split) < 0).sum())
        counts[f"{split}_unseen_label_docs"] = unseen
        if unseen:
            log.warning("%d %s documents carry labels absent from training; they count as errors",
                        unseen, split)
    counts["classes"] = len(classes)
    return data


@dataclasses.dataclass
class MethodResults:
    """Test prediction rows (`report.PREDICTION_COLUMNS`), one training summary per method and
    fraction, the test predictions of every training seed (`SEED_COLUMNS`), and the class
    probabilities behind the reported predictions (`probabilities_key`; with "val_ids" and
    "test_ids", the documents their rows are, and "val_y", the validation class ids)."""

    rows: list[tuple] = dataclasses.field(default_factory=list)
    summaries: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    seed_rows: list[tuple] = dataclasses.field(default_factory=list)
    probabilities: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def add(self, method: str, fraction: float, data: LabelledData, test_predictions: np.ndarray,
            summary: dict[str, Any],
            probabilities: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """`probabilities`: (validation (scorable documents, classes), test (documents,
        classes)), columns in `data.classes` order, of the model behind `test_predictions`."""
        self.rows += prediction_rows(method, fraction, data.splits["test"], test_predictions,
                                     data.classes)
        self.summaries.append({"method": method, "fraction": float(fraction), **summary})
        if probabilities is not None:
            val, test = (np.asarray(p, np.float32) for p in probabilities)
            shapes = {"val": (len(data.scorable("val")), len(data.classes)),
                      "test": (len(data.splits["test"].ids), len(data.classes))}
            if val.shape != shapes["val"] or test.shape != shapes["test"]:
                raise ValueError(f"{method} at {fraction:g}: probabilities {val.shape} / "
                                 f"{test.shape}, expected {shapes['val']} / {shapes['test']}")
            self.probabilities.setdefault(
                "val_ids", data.splits["val"].ids[data.scorable("val")].astype(str))
            self.probabilities.setdefault("val_y", data.y("val")[data.scorable("val")])
            self.probabilities.setdefault("test_ids", data.splits["test"].ids.astype(str))
            self.probabilities[probabilities_key(method, fraction, "val")] = val
            self.probabilities[probabilities_key(method, fraction, "test")] = test

    def add_seed(self, method: str, fraction: float, seed: int, data: LabelledData,
                 test_predictions: np.ndarray) -> None:
        rows = prediction_rows(method, fraction, data.splits["test"], test_predictions,
                               data.classes)
        self.seed_rows += [(*row[:3], int(seed), *row[3:]) for row in rows]

    def extend(self, other: MethodResults) -> None:
        self.rows += other.rows
        self.summaries += other.summaries
        self.seed_rows += other.seed_rows
        self.probabilities.update(other.probabilities)


def class_columns(probabilities: np.ndarray, columns: Sequence[str],
                  classes: Sequence[str]) -> np.ndarray:
    """`probabilities` (rows, len(columns)) re-ordered into `classes` columns; a class the
    model never saw in training (a small label subset may miss one) gets probability 0."""
    probabilities = np.asarray(probabilities)
    out = np.zeros((len(probabilities), len(classes)), np.float32)
    index = {c: i for i, c in enumerate(classes)}
    unknown = [str(c) for c in columns if str(c) not in index]
    if unknown:
        raise ValueError(f"classes {unknown} are not among the training split's")
    out[:, [index[str(c)] for c in columns]] = probabilities
    return out


def prediction_rows(method: str, fraction: float, split: LabelledSplit, predicted: np.ndarray,
                    classes: Sequence[str]) -> list[tuple]:
    """(id, method, fraction, label, prediction) rows; `predicted` holds class indices or labels."""
    predicted = np.asarray(predicted)
    names = (np.asarray(classes)[predicted] if np.issubdtype(predicted.dtype, np.integer)
             else predicted)
    return [(i, method, float(fraction), lab, str(p))
            for i, lab, p in zip(split.ids, split.labels, names)]


def summary_metrics(summaries: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Validation macro-F1 and the selected settings of every (method, fraction), for MLflow:
    the numeric ones (a true/false setting as 1/0); a named choice, such as TF-IDF's features,
    is in results.json and the report."""
    out = {}
    for s in summaries:
        out[result_key(s["method"], s["fraction"], "val_macro_f1")] = s["val_macro_f1"]
        for name, value in {**s.get("params", {}), **s.get("selected", {})}.items():
            if isinstance(value, (bool, int, float)):
                out[result_key(s["method"], s["fraction"], f"selected_{name}")] = float(value)
    return out


def label_subsets(data: LabelledData, cfg: FinetuneConfig) -> Iterator[tuple[float, np.ndarray]]:
    """(fraction, training-document indices): the identical subsets every method trains on."""
    for fraction in cfg.fractions:
        yield fraction, stratified_subset(data.splits["train"].labels, fraction, cfg.subset_seed)


# ---------------------------------------------------------------- neural methods

BackboneFactory = Callable[[], Any]


@dataclasses.dataclass(frozen=True)
class NeuralMethod:
    """A backbone trained as a classifier; `mode` is full, staged or scratch (see `finetuning`)."""

    name: str
    mode: str
    factory: BackboneFactory


def train_neural_methods(data: LabelledData, methods: Sequence[NeuralMethod], cfg: FinetuneConfig,
                         ) -> tuple[MethodResults, dict[str, ClassifierResult]]:
    """Every method at every label fraction under one protocol (see `finetuning`): each learning
    rate of the grid with the first training seed, the rate chosen on validation; that rate again
    with every other seed; the seed best on validation reported.

    Returns the results and, per method, its selected classifier at the largest fraction.
    Under JAX with several devices every run is data-parallel (`devices.data_parallel_scope`).
    Several training processes each call this with the same arguments and train together,
    each feeding its share of every batch; every process predicts with its own copy of the
    weights and takes process 0's early-stopping decisions, so all end with the same results.
    """
    with data_parallel_scope(cfg.batch_size, "fine-tuning"):
        results, kept = _train_neural_methods(data, methods, cfg)
    if process_count() > 1:  # replicas that drifted apart would be a bug: make it visible
        for name, res in kept.items():
            log.info("process %d of %d: %s selected weights sha256 %s", process_index(),
                     process_count(), name, sha256_arrays(res.model.get_weights()))
    return results, kept


def _train_neural_methods(data: LabelledData, methods: Sequence[NeuralMethod],
                          cfg: FinetuneConfig) -> tuple[MethodResults, dict[str, ClassifierResult]]:
    train, y_train, y_val = data.splits["train"], data.y("train"), data.y("val")
    every = cfg.read_windows == "all"
    val_docs = data.scorable("val")
    val_windows, val_owner = data.splits["val"].windows_of(val_docs, every)
    val = (val_windows, y_val[val_docs])
    test = data.splits["test"]
    test_windows, test_owner = test.windows_of(np.arange(len(test.ids)), every)
    out, kept = MethodResults(), {}
    largest = max(cfg.fractions)
    trainers = {method.name: StageTrainers() for method in methods}  # compiled once per method
    for fraction, subset in label_subsets(data, cfg):
        windows, owner = train.windows_of(subset, every)
        y_windows = y_train[subset][owner]
        for method in methods:
            log.info("%s at label fraction %g: %d training documents, %d windows", method.name,
                     fraction, len(subset), len(windows))
            t0, grid, per_seed = time.perf_counter(), [], []
            # The grid on the first seed; its chosen rate repeated over the other seeds, so the
            # spread over seeds is that of one setting, at one run per extra seed.
            first, *repeats = cfg.seeds_at(fraction)
            schedule = ([(first, (lr, decay)) for decay in cfg.layer_decays
                         for lr in cfg.learning_rates] + [(s, None) for s in repeats])
            best = None
            for seed, point in schedule:  # None: the point the first seed's grid chose
                lr, decay = point or (best.learning_rate, best.layer_decay)
                res = train_classifier(method.factory, (windows, y_windows),
                                       val, len(data.classes), method.mode, cfg, seed, lr,
                                       trainers=trainers[method.name],
                                       budget_documents=len(subset), val_owner=val_owner,
                                       layer_decay=decay)
                grid.append({"seed": seed, "learning_rate": res.learning_rate,
                             "layer_decay": res.layer_decay,
                             "val_macro_f1": res.val_macro_f1, "updates_run": res.updates_run})
                if seed != first:
                    per_seed.append((seed, res))
                elif best is None or res.val_macro_f1 > best.val_macro_f1:
                    best = res
            per_seed.insert(0, (first, best))
            # Test predictions only for the rate validation chose: the others are never read.
            per_seed = [(seed, res, res.probabilities(test_windows, test_owner))
                        for seed, res in per_seed]
            for seed, _, proba in per_seed:
                out.add_seed(method.name, fraction, seed, data, np.argmax(proba, axis=-1))
            # the seed best on validation; the first on ties
            seed, chosen, proba = max(per_seed, key=lambda r: r[1].val_macro_f1)
            out.add(method.name, fraction, data, np.argmax(proba, axis=-1), {
                "n_train": len(subset), "n_train_windows": len(windows),
                "val_macro_f1": chosen.val_macro_f1,
                "selected": {"learning_rate": chosen.learning_rate,
                             **({"layer_decay": chosen.layer_decay}
                                if len(cfg.layer_decays) > 1 else {}), "seed": seed},
                "budget_updates": update_budget(len(subset), cfg),
                "updates_run": chosen.updates_run,
                "best_update": chosen.best_update, "grid": grid,
                "train_time_s": round(time.perf_counter() - t0, 3),
                **({"stages": chosen.stages} if method.mode == "staged" else {})},
                probabilities=(chosen.val_probabilities, proba))
            if fraction == largest:
                kept[method.name] = chosen
    return out, kept


@dataclasses.dataclass(frozen=True)
class ProbeFit:
    """The probe selected at the largest label fraction: its logistic regression and the
    standardisation it was fitted on (features are (x - mean) / scale)."""

    model: Any  # sklearn LogisticRegression
    mean: np.ndarray  # (d,)
    scale: np.ndarray  # (d,)
    val_macro_f1: float


def frozen_probe(name: str, data: LabelledData, backbone_factory: BackboneFactory,
                 cfg: FinetuneConfig) -> tuple[MethodResults, ProbeFit | None]:
    """Logistic regression on the frozen encoder's pooled features (computed once, inference
    mode, standardised on each training subset), C tuned on validation; also the fit at the
    largest fraction."""
    t0 = time.perf_counter()
    # the windows of every training document some fraction uses, each computed once
    used = np.unique(np.concatenate([subset for _, subset in label_subsets(data, cfg)]))
    read = {"train": used, **{s: np.arange(len(data.splits[s].ids)) for s in ("val", "test")}}
    inputs = {s: data.splits[s].windows_of(docs, cfg.read_windows == "all")
              for s, docs in read.items()}
    with data_parallel_scope(cfg.eval_batch_size, "frozen features", across_processes=False):
        backbone = backbone_factory()
        features = {split: frozen_features(backbone, inputs[split][0], cfg.pooling,
                                           cfg.eval_batch_size) for split in SPLITS}
    owners = {s: inputs[s][1] for s in SPLITS}
    owners["train"] = used[owners["train"]]  # training rows name their training document
    fits: list[ProbeFit] = []
    results = features_probe(name, data, features, cfg.probe_c, cfg, time.perf_counter() - t0,
                             standardize=True, fits=fits, owners=owners)
    return results, (fits[-1] if fits else None)


def scratch_baselines(vocab_size: int, max_len: int, random_init: BackboneFactory | None,
                      baseline: BaselineConfig) -> list[NeuralMethod]:
    """random_init (the encoder's own architecture, fresh weights) and a bag of embeddings."""
    from selfsup_model.transfer.bag_of_embeddings import bag_of_embeddings_factory

    methods = []
    if baseline.random_init and random_init is not None:
        methods.append(NeuralMethod("random_init", "scratch", random_init))
    if baseline.bag_of_embeddings:
        bag = bag_of_embeddings_factory(vocab_size, max_len, baseline.bag_dim,
                                        baseline.bag_rate_multiplier)
        methods.append(NeuralMethod("bag_of_embeddings", "scratch", bag))
    return methods


# ---------------------------------------------------------------- linear methods


def text_baselines(data: LabelledData, texts: pd.Series, baseline: BaselineConfig,
                   finetune: FinetuneConfig) -> MethodResults:
    """Majority class and TF-IDF + logistic regression at every label fraction (`texts` indexed
    by id)."""
    out = MethodResults()
    train, val, test = (data.splits[s] for s in SPLITS)
    val_docs = data.scorable("val")  # validation scores what every method's selection scores
    val_labels, val_texts = val.labels[val_docs], texts.loc[val.ids[val_docs]].tolist()
    for fraction, subset in label_subsets(data, finetune):
        if baseline.majority:
            t0 = time.perf_counter()
            pred = majority_class(train.labels[subset], len(test.ids))
            val_pred = majority_class(train.labels[subset], len(val_docs))
            out.add("majority", fraction, data, np.asarray(pred, dtype=str), {
                "n_train": len(subset), "val_macro_f1": macro_f1(val_labels, np.asarray(val_pred)),
                "train_time_s": round(time.perf_counter() - t0, 3)})
        res = tfidf_logreg(texts.loc[train.ids[subset]].tolist(), train.labels[subset],
                           val_texts, val_labels, {"test": texts.loc[test.ids].tolist()}, baseline)
        out.add("tfidf_logreg", fraction, data, np.asarray(res.predictions["test"], dtype=str), {
            "n_train": len(subset), "val_macro_f1": res.val_macro_f1,
            "train_time_s": round(res.fit_time_s, 3), "params": res.params,
            "searched": {"C": list(res.c_tried)}},
            probabilities=_logreg_probabilities(res, data.classes))
    return out


def features_probe(method: str, data: LabelledData, features: Mapping[str, np.ndarray],
                   c_grid: Sequence[float], finetune: FinetuneConfig,
                   feature_time_s: float = 0.0, standardize: bool = False,
                   fits: list[ProbeFit] | None = None,
                   owners: Mapping[str, np.ndarray] | None = None) -> MethodResults:
    """Logistic regression on fixed features (split -> (rows, d)), C tuned on validation.

    Without `owners` each split has one row per document. With them, `owners[split]` gives
    the document of each row (non-decreasing): a fraction trains on the rows of its subset's
    documents, each with its document's label, and a validation or test document is
    predicted as the class of highest mean probability over its rows.

    The features are computed once for all fractions; `feature_time_s`, their
    cost, is added to every fraction's training time and shown beside it. With
    `standardize`, each feature is centred and scaled by its mean and standard
    deviation over the training rows (never validation or test). `fits`, when given,
    receives the selected fit at the largest fraction (for handing the probe over).
    Validation scores only the documents whose label training has (`LabelledData.scorable`).
    """
    out = MethodResults()
    train, val = data.splits["train"], data.splits["val"]
    owners = owners or {}
    owner = np.asarray(owners.get("train", np.arange(len(train.ids))))
    val_docs = data.scorable("val")
    val_rows, val_owner = _rows_of(val_docs, owners.get("val"))
    largest = max(finetune.fractions)
    for fraction, subset in label_subsets(data, finetune):
        rows = np.isin(owner, subset)
        x = {"train": features["train"][rows], "val": features["val"][val_rows],
             "test": features["test"]}
        dim = x["train"].shape[1]
        mean, scale = np.zeros(dim, np.float32), np.ones(dim, np.float32)
        if standardize:
            mean, std = x["train"].mean(axis=0), x["train"].std(axis=0)
            scale = np.where(std > 0, std, 1.0).astype(np.float32)
            x = {split: (v - mean) / scale for split, v in x.items()}
        res = logreg_on_features(x["train"], train.labels[owner[rows]], x["val"],
                                 val.labels[val_docs], {"test": x["test"]}, c_grid, what=method,
                                 val_owner=val_owner,
                                 eval_owners={"test": owners["test"]} if "test" in owners else None)
        if fits is not None and fraction == largest:
            fits.append(ProbeFit(res.model, mean, scale, res.val_macro_f1))
        out.add(method, fraction, data, np.asarray(res.predictions["test"], dtype=str), {
            "n_train": len(subset), "n_train_windows": int(rows.sum()),
            "val_macro_f1": res.val_macro_f1, "params": res.params,
            "searched": {"C": list(res.c_tried)},
            "train_time_s": round(res.fit_time_s + feature_time_s, 3),
            "feature_time_s": round(feature_time_s, 3)},
            probabilities=_logreg_probabilities(res, data.classes))
    return out


def _logreg_probabilities(res, classes: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """A `LogregResult`'s validation and test probabilities in `classes` columns."""
    columns = res.model.classes_
    return (class_columns(res.val_probabilities, columns, classes),
            class_columns(res.probabilities["test"], columns, classes))


def _rows_of(docs: np.ndarray, owner: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """The rows of documents `docs` (ascending) and, with `owner` (each row's document), each
    kept row's position in `docs`; without it one row per document."""
    if owner is None:
        return docs, None
    owner = np.asarray(owner)
    keep = np.flatnonzero(np.isin(owner, docs))
    return keep, np.searchsorted(docs, owner[keep])


def write_method_results(out_dir: Path, results: MethodResults, classes: Sequence[str] = (),
                         skipped: str | None = None,
                         unavailable: Mapping[str, str] | None = None) -> list[str]:
    """`predictions.parquet` (test rows), `seed_predictions.parquet` (every training seed's test
    rows), `results.json` (summaries) and `probabilities.npz` (the class probabilities behind
    the reported rows, for the ensemble in compare) of a classification stage."""
    if skipped is not None:
        log.warning("%s skipped: %s", out_dir.name, skipped)
    body: dict[str, Any] = ({"skipped": skipped} if skipped is not None
                            else {"classes": list(classes)})
    body["results"] = results.summaries
    if unavailable is not None:
        body["unavailable"] = dict(unavailable)
    atomic_write_parquet(out_dir / "predictions.parquet",
                         pd.DataFrame(results.rows, columns=list(PREDICTION_COLUMNS)))
    atomic_write_parquet(out_dir / "seed_predictions.parquet",
                         pd.DataFrame(results.seed_rows, columns=list(SEED_COLUMNS)))
    atomic_write_json(out_dir / "results.json", body)
    save_arrays(out_dir / PROBABILITIES_FILE,
                {"classes": np.asarray(list(classes), dtype=str), **results.probabilities})
    return ["predictions.parquet", "seed_predictions.parquet", "results.json", PROBABILITIES_FILE]
