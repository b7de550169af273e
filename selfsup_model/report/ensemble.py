"""The ensemble row: the best pretrained classifier's class probabilities averaged with TF-IDF's.

A user who asks "what is the best this pipeline can do?" gets an answer here, as a method of
its own (`ENSEMBLE_METHOD`), never counted as "pretraining helped" (`effects` compares
`pretrained_*` methods only). Per label fraction:

- the member from pretraining is the pretrained method best on validation macro-F1 (ties to
  the cheaper, as in `effects`), the other is TF-IDF + logistic regression;
- for each weight w of the grid, a document's class is the arg-max of
  w * p_pretrained + (1 - w) * p_tfidf, from the probabilities each member's selected model gave
  on the validation documents every selection scores;
- the weight of highest validation macro-F1 is kept (ties: the weight nearest an even 0.5,
  then the smaller), then applied once to the test probabilities.

w = 0 and w = 1 are in the grid: where one member alone is best on validation the ensemble is
that member, and its row says so. Nothing here reads test labels before the weight is fixed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from selfsup_model.errors import ArtifactError
from selfsup_model.report.effects import best_pretrained
from selfsup_model.report.metrics import macro_f1

ENSEMBLE_METHOD = "ensemble_pretrained_tfidf"
# What finetune and baseline write beside their predictions (`protocol.write_method_results`)
PROBABILITIES_FILE = "probabilities.npz"
TFIDF_METHOD = "tfidf_logreg"


def probabilities_key(method: str, fraction: float, split: str) -> str:
    """The name of one method's class probabilities (split "val" or "test") in a
    classification stage's probabilities file."""
    return f"{method}/{float(fraction)!r}/{split}"


def choose_weight(y: np.ndarray, pretrained: np.ndarray, tfidf: np.ndarray,
                  weights: Sequence[float]) -> tuple[float, float, list[dict[str, float]]]:
    """(weight, its validation macro-F1, every weight's) for class ids `y` and two members'
    probabilities (n, classes); ties go to the weight nearest 0.5, then the smaller."""
    if not len(weights) or min(weights) < 0 or max(weights) > 1:
        raise ValueError(f"ensemble weights must lie in [0, 1] (got {list(weights)})")
    grid = []
    for w in sorted({float(w) for w in weights}):
        predicted = np.argmax(w * pretrained + (1.0 - w) * tfidf, axis=1)
        grid.append({"weight": w, "val_macro_f1": macro_f1(y, predicted)})
    # distances rounded: in floats 0.7 lies nearer 0.5 than 0.3 does
    best = min(grid, key=lambda g: (-g["val_macro_f1"], round(abs(g["weight"] - 0.5), 9),
                                    g["weight"]))
    return best["weight"], best["val_macro_f1"], grid


def ensemble_rows(summaries: Sequence[Mapping[str, Any]], predictions: pd.DataFrame,
                  arrays: Mapping[str, np.ndarray], weights: Sequence[float],
                  ) -> tuple[pd.DataFrame, list[dict[str, Any]]]:
    """The ensemble's test prediction rows (`predictions`' columns) and one training summary per
    label fraction where both members have probabilities.

    `summaries`: the training summaries of every method (method, fraction, val_macro_f1);
    `predictions`: every method's test rows (the test labels come from TF-IDF's);
    `arrays`: the classification stages' probability files merged ("classes", "val_ids",
    "val_y", "test_ids" and `probabilities_key` entries).
    """
    rows, out = [], []
    for fraction in sorted({float(s["fraction"]) for s in summaries}):
        best = best_pretrained(s for s in summaries if float(s["fraction"]) == fraction
                               and probabilities_key(s["method"], fraction, "val") in arrays)
        tfidf = probabilities_key(TFIDF_METHOD, fraction, "val")
        if best is None or tfidf not in arrays:
            continue
        member = str(best["method"])
        weight, val_f1, grid = choose_weight(
            arrays["val_y"], arrays[probabilities_key(member, fraction, "val")], arrays[tfidf],
            weights)
        mixed = (weight * arrays[probabilities_key(member, fraction, "test")]
                 + (1.0 - weight) * arrays[probabilities_key(TFIDF_METHOD, fraction, "test")])
        labels = (predictions[(predictions["method"] == TFIDF_METHOD)
                              & (predictions["fraction"] == fraction)]
                  .set_index("id")["label"])
        test_ids = arrays["test_ids"]
        if len(labels) != len(test_ids) or not labels.index.isin(test_ids).all():
            raise ArtifactError("the probabilities file names other test documents than the "
                                "predictions table; rerun finetune and baseline")
        rows.append(pd.DataFrame({
            "id": test_ids, "method": ENSEMBLE_METHOD, "fraction": fraction,
            "label": labels.loc[test_ids].to_numpy(),
            "prediction": np.asarray(arrays["classes"])[np.argmax(mixed, axis=1)]}))
        out.append({"method": ENSEMBLE_METHOD, "fraction": fraction, "val_macro_f1": val_f1,
                    "selected": {"weight": weight, "pretrained_member": member},
                    "weight_grid": grid})
    columns = list(predictions.columns)
    return (pd.concat(rows, ignore_index=True)[columns] if rows
            else pd.DataFrame(columns=columns)), out


def merge_probabilities(files: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One mapping of the stages' probability files (stage -> arrays), after checking they
    describe the same classes and documents (a stage left from another split would not)."""
    merged: dict[str, np.ndarray] = {}
    shared = ("classes", "val_ids", "val_y", "test_ids")
    for stage, arrays in files.items():
        if "val_ids" not in arrays:  # a stage with nothing classified (no labels, no method)
            continue
        for key, value in arrays.items():
            if key in shared and key in merged and not np.array_equal(merged[key], value):
                raise ArtifactError(f"{stage}'s probabilities name other {key} than another "
                                    "classification stage's; rerun finetune and baseline")
            if key not in shared or key not in merged:
                merged[key] = value
    return merged
