"""tokenizer: fitted on the training split only (or, continuing another run's pretraining, \
that run's, after checking that run's lineage never pretrained on this run's val/test) -> \
tokenizer.json."""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd

from selfsup_model.artifacts import atomic_write_bytes, atomic_write_json
from selfsup_model.corpus.splitting import documents_in_split
from selfsup_model.pretraining.continued import InitSource, resolve_init_source
from selfsup_model.text.tokenization import (
    fit_tokenizer,
    load_tokenizer,
    save_tokenizer,
    tokenizer_stats,
)
from tasks.stage import RunContext, StageOutput, progress_logger

log = logging.getLogger("selfsup.tokenizer")


def _check_source(ctx: RunContext, source: InitSource, docs: pd.DataFrame,
                  assign: pd.DataFrame, out: Path) -> dict:
    """The continued-pretraining leak check (`source_audit`), written to source_audit.json."""
    from selfsup_model.pretraining.source_audit import seen_documents, source_leak_audit

    seen = seen_documents(source.workdir)
    mine = docs.merge(assign, on="id", how="inner", validate="one_to_one")
    log.info("continued-pretraining leak check: %d val/test documents against %d training "
             "documents of %d run(s)", int((mine["split"] != "train").sum()), len(seen),
             len(seen.runs))
    audit = source_leak_audit(mine["id"].tolist(), mine["text"].tolist(), mine["split"].tolist(),
                              seen, ctx.config.split, ctx.config.dedup,
                              progress_logger(log, "leak check: candidate pairs"))
    if audit["message"]:
        log.warning("tokenizer: %s", audit["message"])
    atomic_write_json(out / "source_audit.json", audit)
    return audit


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    docs = pd.read_parquet(inputs["ingest/documents.parquet"], columns=["id", "text"])
    assign = pd.read_parquet(inputs["split/assignments.parquet"], columns=["id", "split"])
    init_from = ctx.config.pretrain.init_from
    files, counts = ["tokenizer.json"], {}
    if init_from:  # continued pretraining keeps the checkpoint's tokenizer and special ids
        source = resolve_init_source(init_from)
        audit = _check_source(ctx, source, docs, assign, out)
        files.append("source_audit.json")
        counts = {"reused_from": str(source.workdir),
                  "source_documents_checked": audit["documents_checked"],
                  "source_train_documents": audit["source_train_documents"],
                  "source_leaking_documents": audit["leaking_documents"],
                  "source_audit_passed": audit["passed"]}
        atomic_write_bytes(out / "tokenizer.json", source.tokenizer.read_bytes())
        tok = load_tokenizer(out / "tokenizer.json")
    else:
        tok = fit_tokenizer(documents_in_split(docs, assign, "train")["text"].tolist(),
                            ctx.config.tokenizer)
        save_tokenizer(tok, out / "tokenizer.json")
    val = tokenizer_stats(tok, documents_in_split(docs, assign, "val")["text"].tolist())
    counts = {"vocab_size": val["vocab_size"], "val_tokens": val["tokens"],
              "val_words": val["words"], "reused_from": "", **counts}
    metrics = {"val_unk_rate": val["unk_rate"], "val_tokens_per_word": val["tokens_per_word"]}
    return StageOutput(files, counts, metrics, log_artifacts=files)
