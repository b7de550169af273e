"""Numbers that stay comparable while a corpus grows (`flows.versions`).

Each version of a corpus lineage is scored twice: on the lineage's first test set, frozen (the
first version's test documents still in the corpus: every version answers the same questions),
and on its own whole test set, cumulative (what a user of this version meets). A version's
record holds both; the report lays the records of every version so far side by side, as a
table and a plot, so a reviewer sees what the new data bought.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import pandas as pd

from selfsup_model.report.comparison import recompute_results

PLOT = "macro_f1_vs_version.png"
# The rows of the table across versions: the default fine-tuned encoder, its control and the
# classical baseline, where the run has them (a fixed list: no choice on the test set).
KEY_METHODS = ("pretrained_full", "random_init", "tfidf_logreg")
TEST_SETS = {"first_test": "the lineage's first test set",
             "all_test": "this version's whole test set"}


def version_record(version: int, lineage: str, predictions: pd.DataFrame,
                   first_test_ids: Collection[str] | None, n_bootstrap: int, seed: int,
                   about: Mapping[str, Any]) -> tuple[dict, list[dict]]:
    """(this version's record, its results on the frozen first test set).

    `first_test_ids` is None for a lineage's first version, whose test set is the first; the
    frozen results are then the cumulative ones. `about`: the version's sizes and pretraining
    numbers, carried into the table as they are."""
    cumulative = recompute_results(predictions, n_bootstrap, seed)
    if first_test_ids is None:
        frozen, n_first = cumulative, predictions["id"].nunique()
    else:
        held = predictions[predictions["id"].isin(first_test_ids)]
        frozen, n_first = recompute_results(held, n_bootstrap, seed), held["id"].nunique()
    record = {"version": version, "lineage": lineage, **about,
              "test_documents": {"first_test": int(n_first),
                                 "all_test": int(predictions["id"].nunique())},
              "macro_f1": {"first_test": _scores(frozen), "all_test": _scores(cumulative)}}
    return record, frozen


def _scores(results: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """{method: {fraction: test macro-F1}}."""
    out: dict[str, dict[str, float]] = {}
    for r in results:
        out.setdefault(str(r["method"]), {})[f"{float(r['fraction']):g}"] = float(
            r["test_macro_f1"])
    return out


def series(records: Sequence[Mapping[str, Any]]) -> dict[int, dict[str, float]]:
    """{version: {MLflow metric name: value}}: every key method's macro-F1 on both test sets,
    to be logged with the version as the step."""
    out: dict[int, dict[str, float]] = {}
    for rec in records:
        metrics = out.setdefault(int(rec["version"]), {})
        for test_set, scores in rec["macro_f1"].items():
            for method in KEY_METHODS:
                for fraction, value in scores.get(method, {}).items():
                    metrics[f"versions/{method}/fraction_{fraction}/{test_set}_macro_f1"] = value
    return out


def versions_markdown(records: Sequence[Mapping[str, Any]], frozen: Sequence[Mapping[str, Any]],
                      plotted: bool) -> str:
    """The report's section: this version's frozen-test rows, then the table across versions."""
    this = records[-1]
    n = this["test_documents"]
    lines = ["## Corpus versions", "",
             (f"Version {this['version']} of corpus lineage {this['lineage']}. Frozen: "
              f"{TEST_SETS['first_test']}, {n['first_test']} documents; cumulative: "
              f"{TEST_SETS['all_test']}, {n['all_test']} documents (the table above).")]
    if this["version"] > 1:
        lines += ["", "| method | label fraction | frozen test macro-F1 [95% CI] | n |",
                  "|---|---:|---:|---:|"]
        for r in sorted(frozen, key=lambda r: (float(r["fraction"]), str(r["method"]))):
            low, high = r["test_macro_f1_ci"]
            lines.append(f"| {r['method']} | {float(r['fraction']):g} | "
                         f"{r['test_macro_f1']:.3f} [{low:.3f}, {high:.3f}] | {r['n_test']} |")
    methods = [m for m in KEY_METHODS if any(m in rec["macro_f1"]["first_test"]
                                             for rec in records)]
    head = "| version | documents | train / val / test | pretraining | val loss | fraction | "
    head += " | ".join(f"{m} frozen / cumulative" for m in methods) + " |"
    lines += ["", ("Across versions (macro-F1 on the frozen first test set / on the version's "
                   "whole test set):"), "", head,
              "|" + "---:|" * 6 + "---:|" * len(methods)]
    for rec in records:
        fractions = sorted({f for test in rec["macro_f1"].values() for m in methods
                            for f in test.get(m, {})}, key=float)
        for fraction in fractions:
            cells = [" / ".join(_cell(rec["macro_f1"][t].get(m, {}).get(fraction))
                                for t in TEST_SETS) for m in methods]
            lines.append(f"| {rec['version']} | {rec.get('documents', '—')} | "
                         f"{rec.get('split_sizes', '—')} | {rec.get('pretraining', '—')} | "
                         f"{_cell(rec.get('val_loss'))} | {fraction} | {' | '.join(cells)} |")
    if plotted:
        lines += ["", f"![macro-F1 across versions]({PLOT})"]
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    return "—" if value is None else f"{float(value):.3f}"
