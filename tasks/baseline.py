"""baseline: TF-IDF + logistic regression, the same encoder from random init, and the majority class."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE

from selfsup_model.artifacts import atomic_write_json
from selfsup_model.baselines import majority_class, tfidf_logreg
from selfsup_model.classify import stratified_subset
from selfsup_model.metrics import macro_f1
from selfsup_model.model import build_backbone
from selfsup_model.report import PREDICTION_COLUMNS
from selfsup_model.tokenization import load_tokenizer
from tasks.finetune import summary, train_at_fractions, write_skipped
from tasks.io import read_parquet, write_parquet
from tasks.labelled import ENCODED_INPUTS, LabelledData, load_labelled, prediction_rows, result_key
from tasks.stage import RunContext, StageOutput, StageResult, StageSpec, run_stage

SPEC = StageSpec(
    "baseline",
    inputs=("ingest/documents.parquet", "tokenizer/tokenizer.json", *ENCODED_INPUTS),
    # finetune: the same fractions, seed and training budget as the pretrained methods
    sections=("baseline", "finetune", "model"),
)


def text_baselines(data: LabelledData, texts: pd.Series, ctx: RunContext) -> tuple[list, list]:
    rows, summaries = [], []
    train, val, test = (data.splits[s] for s in ("train", "val", "test"))
    cfg = ctx.config
    for fraction in cfg.finetune.fractions:
        subset = stratified_subset(train.labels, fraction, cfg.finetune.seed)
        if cfg.baseline.majority:
            t0 = time.perf_counter()
            pred = majority_class(train.labels[subset], len(test.ids))
            rows += prediction_rows("majority", fraction, test, np.asarray(pred, dtype=str), data.classes)
            val_pred = majority_class(train.labels[subset], len(val.ids))
            summaries.append({"method": "majority", "fraction": float(fraction), "n_train": len(subset),
                              "val_macro_f1": macro_f1(val.labels, np.asarray(val_pred)),
                              "train_time_s": round(time.perf_counter() - t0, 3)})
        res = tfidf_logreg(texts.loc[train.ids[subset]].tolist(), train.labels[subset],
                           texts.loc[val.ids].tolist(), val.labels, {"test": texts.loc[test.ids].tolist()},
                           cfg.baseline)
        rows += prediction_rows("tfidf_logreg", fraction, test, np.asarray(res.predictions["test"], dtype=str),
                                data.classes)
        summaries.append({"method": "tfidf_logreg", "fraction": float(fraction), "n_train": len(subset),
                          "val_macro_f1": res.val_macro_f1, "train_time_s": round(res.fit_time_s, 3),
                          "params": res.params})
    return rows, summaries


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    data = load_labelled(inputs)
    if data is None:
        return write_skipped(out, "the corpus has fewer than two labels in the training split")
    texts = read_parquet(inputs["ingest/documents.parquet"], ["id", "text"]).set_index("id")["text"]
    rows, summaries = text_baselines(data, texts, ctx)
    if ctx.config.baseline.random_init:
        vocab = load_tokenizer(inputs["tokenizer/tokenizer.json"]).get_vocab_size()
        max_len = data.splits["train"].windows.shape[1]

        def random_init():
            return build_backbone(vocab, max_len, ctx.config.model)

        for method, fraction, n_train, result in train_at_fractions(
                data, ctx.config.finetune, {"random_init": ("scratch", random_init)}):
            rows += prediction_rows(method, fraction, data.splits["test"], result.predictions["test"], data.classes)
            summaries.append(summary(method, fraction, n_train, result))
    files = [write_parquet(pd.DataFrame(rows, columns=list(PREDICTION_COLUMNS)), out / "predictions.parquet"),
             atomic_write_json(out / "results.json", {"classes": data.classes, "results": summaries}).name]
    return StageOutput(files, {**data.counts, "runs": len(summaries)},
                       {result_key(s["method"], s["fraction"], "val_macro_f1"): s["val_macro_f1"] for s in summaries})


@task(name="baseline", cache_policy=NO_CACHE, persist_result=False)
def baseline_task(ctx: RunContext) -> StageResult:
    """Train the baselines on exactly the documents and label fractions the pretrained methods see."""
    return run_stage(SPEC, ctx, compute)
