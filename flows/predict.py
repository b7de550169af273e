"""Scoring new documents with a finished run's classifier: `selfsup predict` and the
`selfsup-predict` flow (`flows.pipeline.predict_flow`, a scheduled batch-scoring job) share
`run_predict`. No Prefect import here: the command line scores without a Prefect server."""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from flows.settings import read_settings
from selfsup_model.config import IngestConfig
from selfsup_model.errors import UserError
from selfsup_model.serving.scoring import check_output_path, read_inputs, score, write_predictions
from tasks.stage import progress_logger

log = logging.getLogger("selfsup.predict")


@dataclasses.dataclass(frozen=True)
class PredictOutcome:
    predictions: pd.DataFrame
    rejects: pd.DataFrame
    read: int
    kept_method: str
    out: Path | None


def columns_config(workdir: str, text_column: str | None, id_column: str | None
                   ) -> IngestConfig:
    """The run's own ingest settings (column names, max_chars), with any column overrides."""
    settings = read_settings(workdir)
    cfg = settings.config.ingest if settings is not None else IngestConfig()
    updates = {k: v for k, v in (("text_column", text_column), ("id_column", id_column)) if v}
    return cfg.model_copy(update=updates)


def run_predict(workdir: str, source: str, out: str | None = None, *,
                text_column: str | None = None, id_column: str | None = None,
                batch_size: int = 256, lines: Iterable[bytes] | None = None,
                engine: str = "keras") -> PredictOutcome:
    """Score `source` (folder, table, or "-" for `lines`) with the classifier of `workdir`,
    through Keras or (`engine="onnx"`) the same classifier converted to ONNX."""
    if batch_size < 1:  # a deployment's parameter reaches here without the CLI's check
        raise UserError(f"batch_size must be at least 1 (got {batch_size})")
    if engine not in ("keras", "onnx"):
        raise UserError(f"engine must be keras or onnx (got {engine!r})")
    out_path = check_output_path(out) if out else None  # fail before any work
    from selfsup_model.serving.inference import load_run_classifier  # Keras: only when scoring

    bundle = load_run_classifier(workdir)
    if engine == "onnx":
        bundle = bundle.onnx_engine()
    inputs = read_inputs(source, columns_config(workdir, text_column, id_column), lines)
    log.info("scoring %d documents (%d rejected on reading) with %s from %s",
             len(inputs.documents), len(inputs.rejects), bundle.spec["kept"]["method"], workdir)
    predictions, rejects = score(bundle, inputs, batch_size,
                                 progress_logger(log, "scored documents"))
    assert inputs.read == len(predictions) + len(rejects)
    if predictions.empty:
        reasons = ", ".join(f"{r}={n}" for r, n in sorted(Counter(rejects["reason"]).items()))
        raise UserError(f"nothing to score in {source!r}: {inputs.read} read, all rejected "
                        f"({reasons or 'no records'})")
    if out_path is not None:
        write_predictions(predictions, out_path)
    return PredictOutcome(predictions, rejects, inputs.read, bundle.spec["kept"]["method"],
                          out_path)


def label_counts_markdown(outcome: PredictOutcome, source: str, workdir: str) -> str:
    counts = outcome.predictions["label"].value_counts().sort_index()
    rows = "\n".join(f"| {label} | {n} | {n / len(outcome.predictions):.1%} |"
                     for label, n in counts.items())
    rejected = Counter(outcome.rejects["reason"])
    return (f"# selfsup predictions\n\n{outcome.read} documents read from `{source}`, "
            f"{len(outcome.predictions)} scored with `{outcome.kept_method}` from `{workdir}`, "
            f"{len(outcome.rejects)} rejected"
            + (f" ({', '.join(f'{r}: {n}' for r, n in sorted(rejected.items()))})"
               if rejected else "")
            + f".\n\n| label | documents | share |\n|---|---|---|\n{rows}\n"
            + (f"\nPredictions: `{outcome.out}`\n" if outcome.out else ""))
