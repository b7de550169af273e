"""tokenizer: fitted on the training split only (or, continuing another run's pretraining, \
that run's) -> tokenizer.json."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from selfsup_model.artifacts import atomic_write_bytes
from selfsup_model.continued import resolve_init_source
from selfsup_model.splitting import documents_in_split
from selfsup_model.tokenization import (
    fit_tokenizer,
    load_tokenizer,
    save_tokenizer,
    tokenizer_stats,
)
from tasks.stage import RunContext, StageOutput


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    docs = pd.read_parquet(inputs["ingest/documents.parquet"], columns=["id", "text"])
    assign = pd.read_parquet(inputs["split/assignments.parquet"], columns=["id", "split"])
    init_from = ctx.config.pretrain.init_from
    if init_from:  # continued pretraining keeps the checkpoint's tokenizer and special ids
        source = resolve_init_source(init_from)
        atomic_write_bytes(out / "tokenizer.json", source.tokenizer.read_bytes())
        tok = load_tokenizer(out / "tokenizer.json")
    else:
        tok = fit_tokenizer(documents_in_split(docs, assign, "train")["text"].tolist(),
                            ctx.config.tokenizer)
        save_tokenizer(tok, out / "tokenizer.json")
    val = tokenizer_stats(tok, documents_in_split(docs, assign, "val")["text"].tolist())
    counts = {"vocab_size": val["vocab_size"], "val_tokens": val["tokens"],
              "val_words": val["words"], "reused_from": str(source.workdir) if init_from else ""}
    metrics = {"val_unk_rate": val["unk_rate"], "val_tokens_per_word": val["tokens_per_word"]}
    return StageOutput(["tokenizer.json"], counts, metrics, log_artifacts=["tokenizer.json"])

