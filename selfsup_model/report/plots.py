"""Every figure the pipeline writes: pretraining loss curves, F1-vs-labels curves, confusion
matrices.

Figures are drawn on an Agg canvas attached to a bare `Figure` (no pyplot, no
global backend, no display) and written atomically.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from selfsup_model.artifacts import atomic_path
from selfsup_model.report.metrics import confusion


def plot_loss_curve(history: list[dict[str, float]], objective: str, path) -> Path:
    """Train and validation loss against step, written atomically (no pyplot state)."""
    fig = Figure(figsize=(6, 4), dpi=100)
    ax = fig.add_subplot()
    for key, style in ((f"train/{objective}_loss", "-"), (f"val/{objective}_loss", "o-"),
                       ("val/unigram_baseline_loss", ":")):
        points = [(h["step"], h[key]) for h in history if key in h and np.isfinite(h[key])]
        if points:
            ax.plot(*zip(*points, strict=True), style, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("token-weighted cross-entropy (nats)")
    ax.legend()
    return _save(fig, path, dpi="figure", tight=False)


def plot_fraction_curves(results: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Test macro-F1 vs label fraction, one line per method, with bootstrap-interval error bars."""
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    methods = list(dict.fromkeys(str(r["method"]) for r in results))
    for method in methods:
        rows = sorted((r for r in results if str(r["method"]) == method),
                      key=lambda r: float(r["fraction"]))
        x = np.array([float(r["fraction"]) for r in rows])
        y = np.array([float(r["test_macro_f1"]) for r in rows])
        ci = np.array([r.get("test_macro_f1_ci") or (v, v) for r, v in zip(rows, y)],
                      dtype=float)  # (n, 2)
        yerr = np.stack([y - ci[:, 0], ci[:, 1] - y])  # (2, n): distances below and above
        ax.errorbar(x, y, yerr=np.clip(yerr, 0, None), marker="o", capsize=3, label=method)
    fractions = [float(r["fraction"]) for r in results]
    if max(fractions) / min(fractions) >= 10:
        ax.set_xscale("log")
    ax.set_xlabel("label fraction of the training split")
    ax.set_ylabel("test macro-F1 (95% bootstrap CI)")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_confusion(y_true, y_pred, labels: Sequence, title: str, path: str | Path) -> Path:
    matrix = confusion(y_true, y_pred, labels)  # (K, K) rows = true
    k = len(labels)
    fig = Figure(figsize=(max(4, 0.5 * k + 2), max(3.5, 0.5 * k + 1.5)))
    ax = fig.add_subplot()
    image = ax.imshow(matrix, cmap="Blues")
    fig.colorbar(image, ax=ax)
    ax.set_xticks(range(k), [str(label) for label in labels], rotation=45, ha="right")
    ax.set_yticks(range(k), [str(label) for label in labels])
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title, fontsize="small")
    if k <= 20:  # counts stay legible only for small label sets
        dark = matrix > matrix.max() / 2  # white digits on dark cells
        for i, j in np.ndindex(matrix.shape):
            ax.text(j, i, str(matrix[i, j]), ha="center", va="center", fontsize=7,
                    color="white" if dark[i, j] else "black")
    return _save(fig, path)


def plot_versions(records: Sequence[Mapping[str, Any]], methods: Sequence[str],
                  path: str | Path) -> Path:
    """Macro-F1 against corpus version (`report.versions` records), one panel per label
    fraction, a line per method on the frozen first test set (solid) and on each version's
    whole test set (dashed)."""
    fractions = sorted({f for rec in records for scores in rec["macro_f1"]["first_test"].values()
                        for f in scores}, key=float)
    fig = Figure(figsize=(4 * len(fractions), 3.6))
    for k, fraction in enumerate(fractions):
        ax = fig.add_subplot(1, len(fractions), k + 1)
        for method in methods:
            for test_set, style in (("first_test", "o-"), ("all_test", "x--")):
                points = [(rec["version"], rec["macro_f1"][test_set][method][fraction])
                          for rec in records
                          if fraction in rec["macro_f1"][test_set].get(method, {})]
                if points:
                    ax.plot(*zip(*points, strict=True), style,
                            label=f"{method} ({'frozen' if test_set == 'first_test' else 'all'})")
        ax.set_title(f"label fraction {fraction}")
        ax.set_xlabel("corpus version")
        ax.set_xticks([rec["version"] for rec in records])
        ax.grid(alpha=0.3)
        if k == 0:
            ax.set_ylabel("test macro-F1")
            ax.legend(fontsize="x-small")
    return _save(fig, path)


def _save(fig: Figure, path: str | Path, dpi: Any = 120, tight: bool = True) -> Path:
    FigureCanvasAgg(fig)  # attaches an Agg canvas: no pyplot, no global backend switch
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi, bbox_inches="tight" if tight else None)
    return Path(path)
