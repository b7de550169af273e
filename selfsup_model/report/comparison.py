"""The comparison report: report.md, report.json and plots, all recomputable from predictions.

A result is one (method, fraction) row: test accuracy and macro-F1 with 95%
percentile bootstrap intervals over test documents, validation macro-F1,
training time, n_test. `recompute_results` derives the test columns from the
predictions table alone, so anyone can check the report's numbers.

The per-fraction statements name the method with the highest test macro-F1
and say whether its interval overlaps the runner-up's — nothing more. The
intervals reflect test-set sampling only, not training-seed variance.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from selfsup_model.artifacts import atomic_write_json, atomic_write_text
from selfsup_model.errors import UserError
from selfsup_model.report.effects import effect_sentence
from selfsup_model.report.metrics import accuracy, bootstrap_ci, macro_f1
from selfsup_model.report.plots import plot_confusion, plot_fraction_curves

PREDICTION_COLUMNS = ("id", "method", "fraction", "label", "prediction")
# Every training seed's test predictions, for the spread over seeds.
SEED_COLUMNS = ("id", "method", "fraction", "seed", "label", "prediction")
REQUIRED_RESULT_KEYS = ("method", "fraction", "test_accuracy", "test_macro_f1")
CURVE_PLOT = "macro_f1_vs_fraction.png"
CONFUSION_PLOT = "confusion_best.png"


def result_key(method: str, fraction: float, metric: str) -> str:
    """An MLflow-safe metric name for one method at one label fraction."""
    return f"{method}/fraction_{fraction:g}/{metric}"


def recompute_results(predictions: pd.DataFrame, n_bootstrap: int = 1000,
                      seed: int = 0) -> list[dict]:
    """Test metrics per (method, fraction) from a predictions table.

    Rows are sorted by id within each group, so with one seed every method is
    resampled on the same documents (paired intervals).
    """
    missing = [c for c in PREDICTION_COLUMNS if c not in predictions.columns]
    if missing:
        raise UserError(f"predictions table lacks columns {missing}; "
                        f"expected {list(PREDICTION_COLUMNS)}")
    out = []
    for (method, fraction), group in predictions.groupby(["method", "fraction"], sort=True):
        group = group.sort_values("id", kind="stable")
        y, p = group["label"].to_numpy(), group["prediction"].to_numpy()
        out.append({
            "method": str(method),
            "fraction": float(fraction),
            "n_test": len(group),
            "test_accuracy": accuracy(y, p),
            "test_accuracy_ci": list(bootstrap_ci(y, p, "accuracy", n_bootstrap, seed)),
            "test_macro_f1": macro_f1(y, p),
            "test_macro_f1_ci": list(bootstrap_ci(y, p, "macro_f1", n_bootstrap, seed)),
        })
    return out


def winner_statements(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """One plain sentence per label fraction about the test macro-F1 ranking."""
    lines = []
    for fraction in sorted({float(r["fraction"]) for r in results}):
        rows = sorted(
            (r for r in results if float(r["fraction"]) == fraction),
            key=lambda r: -float(r["test_macro_f1"]),
        )
        lines.append(_statement(fraction, rows))
    return lines


def grid_edges(results: Sequence[Mapping[str, Any]],
               grids: Mapping[str, Mapping[str, Sequence[float]]]) -> list[dict[str, Any]]:
    """The selections that landed on an end of their search grid, where a wider grid might have
    changed the method's result: one {method, fraction, setting, value, end} per such choice.

    `grids` maps a method name, or "*" for every method, to {setting: the values searched}. Only
    grids of three or more values can tell anything here: a grid of one value selected nothing,
    and every choice from two values is at an end (`narrow_grids` says that once instead).
    """
    edges = []
    for r, setting, values in _searched(results, grids):
        if len(values) >= 3:
            value = float(r["selected"][setting])
            end = ("largest" if value >= values[-1] else
                   "smallest" if value <= values[0] else None)
            if end is not None:
                edges.append({"method": r["method"], "fraction": float(r["fraction"]),
                              "setting": setting, "value": value, "end": end})
    return edges


def narrow_grids(results: Sequence[Mapping[str, Any]],
                 grids: Mapping[str, Mapping[str, Sequence[float]]]) -> list[dict[str, Any]]:
    """The settings selected from exactly two values: one {setting, values, methods} each (the
    methods sorted), since every such choice sits at an end of its grid and says nothing about
    values beyond it."""
    narrow: dict[tuple[str, tuple[float, ...]], set[str]] = {}
    for r, setting, values in _searched(results, grids):
        if len(values) == 2:
            narrow.setdefault((setting, tuple(values)), set()).add(str(r["method"]))
    return [{"setting": setting, "values": list(values), "methods": sorted(methods)}
            for (setting, values), methods in sorted(narrow.items())]


def _searched(results: Sequence[Mapping[str, Any]],
              grids: Mapping[str, Mapping[str, Sequence[float]]]):
    """(result, setting, the distinct values searched, ascending) for each setting a result
    selected, results in (fraction, method) order. A result's own `searched` values (a C search
    widened past its grid) stand in for its method's grid."""
    for r in sorted(results, key=lambda r: (float(r["fraction"]), str(r["method"]))):
        selected = r.get("selected")
        if not isinstance(selected, Mapping):
            continue
        searched = {**grids.get("*", {}), **grids.get(str(r["method"]), {}),
                    **(r.get("searched") or {})}
        for setting, values in searched.items():
            if setting in selected:
                yield r, setting, sorted({float(v) for v in values})


def narrow_sentence(grid: Mapping[str, Any]) -> str:
    values = ", ".join(f"{v:g}" for v in grid["values"])
    return (f"{grid['setting']} was chosen from two values ({values}) for "
            f"{', '.join(grid['methods'])}: any choice from two values is at an end of its grid, "
            "so this run cannot tell whether a value beyond them would do better. Search three "
            "or more values to find out.")


def edge_sentence(edge: Mapping[str, Any]) -> str:
    return (f"{edge['method']} at label fraction {edge['fraction']:g}: {edge['setting']} "
            f"{edge['value']:g}, the {edge['end']} value tried. A wider grid might change its "
            "result.")


def render_markdown(results: Sequence[Mapping[str, Any]], context: Mapping[str, Any],
                    effects: Sequence[Mapping[str, Any]] = (),
                    edges: Sequence[Mapping[str, Any]] | None = None,
                    narrow: Sequence[Mapping[str, Any]] = (),
                    sections: Sequence[str] = ()) -> str:
    """The report: the results table, what pretraining bought, the statements, the grid edges,
    `sections` (markdown, e.g. the corpus versions'), then the context."""
    _check_results(results)
    head = ("| method | label fraction | test accuracy [95% CI] | test macro-F1 [95% CI] "
            "| over seeds | val macro-F1 | selected on val | train time (s) | n_test |")
    lines = ["# selfsup comparison", "", head, "|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in sorted(results, key=lambda r: (float(r["fraction"]), str(r["method"]))):
        lines.append(
            f"| {r['method']} | {float(r['fraction']):g} "
            f"| {_with_ci(r['test_accuracy'], r.get('test_accuracy_ci'))} "
            f"| {_with_ci(r['test_macro_f1'], r.get('test_macro_f1_ci'))} "
            f"| {_spread(r.get('test_macro_f1_seeds'))} "
            f"| {_num(r.get('val_macro_f1'))} | {_plain(r.get('selected', '—'))} "
            f"| {_num(r.get('train_time_s'), 1)} | {r.get('n_test', '—')} |"
        )
    if effects:
        lines += ["", "## What pretraining bought", ""]
        lines += [f"- {effect_sentence(e)}" for e in effects]
    lines += ["", "## What the numbers say", ""]
    lines += [f"- {s}" for s in winner_statements(results)]
    lines += [
        "",
        (
            "Intervals are 95% percentile bootstrap intervals over test documents; they reflect "
            "test-set sampling only. Where a method was trained with several seeds, \"over "
            "seeds\" gives the mean ± standard deviation of its test macro-F1 across them, and "
            "the row is the seed chosen on validation. Learning rates, seeds, C, stopping "
            "points and the ensemble's weight were selected on validation macro-F1 only. The "
            "ensemble row averages the best pretrained method's class probabilities with "
            "TF-IDF's: the best this run can do, never counted as what pretraining bought."
        ),
    ]
    if edges is not None:
        lines += ["", "## Selections at the edge of their grid", ""]
        lines += [f"- {narrow_sentence(g)}" for g in narrow]
        if edges:
            lines += [f"- {edge_sentence(e)}" for e in edges]
        elif narrow:
            lines += ["- Among grids of three or more values, none: every setting chosen on "
                      + "validation lies inside its grid."]
        else:
            lines += ["- None: every setting chosen on validation lies inside its grid."]
    for section in sections:
        lines += ["", section.rstrip("\n")]
    lines += ["", "## Context", ""]
    lines += [f"- **{key}**: {_plain(value)}" for key, value in context.items()]
    return "\n".join(lines) + "\n"


def write_report(
    out_dir: str | Path,
    results: Sequence[Mapping[str, Any]],
    context: Mapping[str, Any],
    predictions: pd.DataFrame | None = None,
    effects: Sequence[Mapping[str, Any]] = (),
    kept_classifier: Mapping[str, Any] | None = None,
    edges: Sequence[Mapping[str, Any]] | None = None,
    narrow: Sequence[Mapping[str, Any]] = (),
    sections: Sequence[str] = (),
) -> list[str]:
    """Write report.md, report.json and the plots into out_dir; return the file names written.

    `kept_classifier` (method, fraction, val_macro_f1, ...) names the classifier the run hands
    over; report.json carries it as is. `edges` (from `grid_edges`), when given, are listed in
    both, with `narrow` (from `narrow_grids`)."""
    _check_results(results)
    out_dir = Path(out_dir)
    atomic_write_text(out_dir / "report.md",
                      render_markdown(results, context, effects, edges, narrow, sections))
    payload = {"results": [_json_safe(dict(r)) for r in results],
               "pretraining_effect": [_json_safe(dict(e)) for e in effects],
               "context": _json_safe(dict(context))}
    if edges is not None:
        payload["grid_edges"] = [_json_safe(dict(e)) for e in edges]
        payload["narrow_grids"] = [_json_safe(dict(g)) for g in narrow]
    if kept_classifier is not None:
        payload["kept_classifier"] = _json_safe(dict(kept_classifier))
    atomic_write_json(out_dir / "report.json", payload)
    written = ["report.md", "report.json", CURVE_PLOT]
    plot_fraction_curves(results, out_dir / CURVE_PLOT)
    best = best_result(results)
    if predictions is not None:
        rows = predictions[(predictions["method"] == best["method"])
                           & (predictions["fraction"] == best["fraction"])]
        if len(rows):
            labels = sorted(set(rows["label"]) | set(rows["prediction"]))
            title = f"{best['method']} @ fraction {float(best['fraction']):g} (test)"
            plot_confusion(rows["label"].to_numpy(), rows["prediction"].to_numpy(), labels, title,
                           out_dir / CONFUSION_PLOT)
            written.append(CONFUSION_PLOT)
    return written


def best_result(results: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """Highest test macro-F1; ties go to the larger label fraction, then the earlier row."""
    return max(results, key=lambda r: (float(r["test_macro_f1"]), float(r["fraction"])))


# ---------------------------------------------------------------- internals


def _statement(fraction: float, rows: list[Mapping[str, Any]]) -> str:
    where = f"Label fraction {fraction:g}"
    if len(rows) == 1:
        return f"{where}: only {rows[0]['method']} was run; nothing to compare."
    first, second = rows[0], rows[1]
    if float(first["test_macro_f1"]) == float(second["test_macro_f1"]):
        return (f"{where}: {first['method']} and {second['method']} tie on test macro-F1 "
                f"({_num(first['test_macro_f1'])}).")
    head = (
        f"{where}: {first['method']} has the highest test macro-F1, "
        f"{_with_ci(first['test_macro_f1'], first.get('test_macro_f1_ci'))}; "
        f"runner-up {second['method']} "
        f"{_with_ci(second['test_macro_f1'], second.get('test_macro_f1_ci'))}."
    )
    a, b = first.get("test_macro_f1_ci"), second.get("test_macro_f1_ci")
    if not a or not b:
        return head + " No interval is available, so no claim about the size of the gap."
    if a[0] <= b[1] and b[0] <= a[1]:
        return head + " The intervals overlap: this test set does not clearly separate them."
    return head + " The intervals do not overlap."


def _check_results(results: Sequence[Mapping[str, Any]]) -> None:
    if not results:
        raise UserError("no results to report: run at least one method")
    for i, r in enumerate(results):
        missing = [k for k in REQUIRED_RESULT_KEYS if k not in r]
        if missing:
            raise UserError(f"results[{i}] lacks {missing}")


def _with_ci(value: Any, ci: Sequence[float] | None) -> str:
    if not ci:
        return _num(value)
    return f"{_num(value)} [{_num(ci[0])}, {_num(ci[1])}]"


def _spread(spread: Mapping[str, float] | None) -> str:
    if not spread:
        return "—"
    return f"{spread['mean']:.3f} ± {spread['sd']:.3f} ({spread['seeds']})"


def _num(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{float(value):.{digits}f}"


def _plain(value: Any) -> str:
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={_plain(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(_plain(v) for v in value)
    return str(value)


def _json_safe(value: Any) -> Any:
    """Tuples to lists, numpy scalars to Python, non-finite floats to None (JSON has no NaN)."""
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_json_safe(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
