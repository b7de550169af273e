"""What pretraining bought: paired differences on the same test documents, and the seed spread.

For each label fraction the best pretrained method is the one with the
highest *validation* macro-F1 (never test), and its test macro-F1 is compared
with random initialisation of the same architecture and with TF-IDF + logistic
regression, document by document: a paired bootstrap over the test documents
gives the interval of the difference. Intervals cover test sampling only; the
spread over training seeds, where a method was repeated, is reported beside
them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from selfsup_model.report.metrics import macro_f1, paired_bootstrap_diff

PRETRAINED_PREFIX = "pretrained_"
REFERENCES = {"random_init": "random initialisation",
              "tfidf_logreg": "TF-IDF + logistic regression"}


def seed_spread(seed_predictions: pd.DataFrame) -> dict[tuple[str, float], dict[str, float]]:
    """Test macro-F1 over training seeds per (method, fraction) that ran more than one seed."""
    out = {}
    for (method, fraction), group in seed_predictions.groupby(["method", "fraction"], sort=True):
        scores = np.array([macro_f1(g["label"].to_numpy(), g["prediction"].to_numpy())
                           for _, g in group.groupby("seed", sort=True)])
        if len(scores) > 1:
            out[(str(method), float(fraction))] = {
                "seeds": len(scores), "mean": float(scores.mean()), "sd": float(scores.std(ddof=1)),
                "min": float(scores.min()), "max": float(scores.max())}
    return out


# A validation tie goes to the cheaper pretrained method, in the report's "best pretrained method"
# and in the classifier handed over (`inference.choose_kept`) alike.
CHEAPER_FIRST = ("pretrained_probe", "pretrained_full", "pretrained_staged")


def tie_rank(method: str) -> int:
    """Sort key among methods of equal validation macro-F1: cheaper first (others last)."""
    method = str(method)
    return CHEAPER_FIRST.index(method) if method in CHEAPER_FIRST else len(CHEAPER_FIRST)


def best_pretrained(rows: Iterable[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The pretrained row (result or training summary) of highest validation macro-F1, a tie to
    the cheaper method; None when no pretrained row has a validation score."""
    candidates = [r for r in rows if str(r["method"]).startswith(PRETRAINED_PREFIX)
                  and r.get("val_macro_f1") is not None]
    if not candidates:
        return None
    return min(candidates, key=lambda r: (-float(r["val_macro_f1"]), tie_rank(r["method"])))


def pretraining_effects(results: Sequence[Mapping[str, Any]], predictions: pd.DataFrame,
                        n_bootstrap: int = 1000, seed: int = 0) -> list[dict[str, Any]]:
    """Per fraction: best pretrained (on validation) minus each reference, paired, on test."""
    effects = []
    present = {(str(r["method"]), float(r["fraction"])) for r in results}
    for fraction in sorted({float(r["fraction"]) for r in results}):
        best = best_pretrained(r for r in results if float(r["fraction"]) == fraction)
        if best is None:
            continue
        for reference in REFERENCES:
            if (reference, fraction) not in present:
                continue
            y, ours, theirs = _aligned(predictions, fraction, str(best["method"]), reference)
            diff, low, high = paired_bootstrap_diff(y, ours, theirs, "macro_f1", n_bootstrap, seed)
            effects.append({
                "fraction": fraction, "pretrained_method": str(best["method"]),
                "pretrained_val_macro_f1": float(best["val_macro_f1"]), "reference": reference,
                "test_macro_f1_difference": diff, "ci": [low, high],
                "verdict": "better" if low > 0 else "worse" if high < 0 else "indistinguishable"})
    return effects


def effect_sentence(effect: Mapping[str, Any]) -> str:
    """One plain sentence: did pretraining help, hurt, or was it indistinguishable?"""
    low, high = effect["ci"]
    numbers = (f"{effect['test_macro_f1_difference']:+.3f} test macro-F1, paired 95% interval "
               f"[{low:+.3f}, {high:+.3f}]")
    head = (f"At label fraction {effect['fraction']:g}, {effect['pretrained_method']} (the best "
            f"pretrained method on validation) minus {effect['reference']}: {numbers}")
    name = REFERENCES[effect["reference"]]
    if effect["reference"] == "random_init":
        verdict = {"better": "pretraining helped", "worse": "pretraining hurt",
                   "indistinguishable": "pretraining made no difference this test set can see"}
    else:
        verdict = {"better": f"the pretrained encoder is ahead of {name}",
                   "worse": f"the pretrained encoder is behind {name}",
                   "indistinguishable": f"this test set cannot separate it from {name}"}
    return f"{head}: {verdict[effect['verdict']]}."


def _aligned(predictions: pd.DataFrame, fraction: float, a: str, b: str):
    """(labels, predictions of a, predictions of b) on the same test documents, in id order."""
    at = predictions[predictions["fraction"] == fraction]
    left = at[at["method"] == a].set_index("id").sort_index()
    right = at[at["method"] == b].set_index("id").sort_index()
    if not left.index.equals(right.index):
        raise ValueError(f"{a} and {b} were not scored on the same test documents")
    return (left["label"].to_numpy(), left["prediction"].to_numpy(),
            right["prediction"].to_numpy())
