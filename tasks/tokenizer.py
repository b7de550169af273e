"""tokenizer: fitted on the training split only (or, continuing another run's pretraining, \
that run's, after checking that run's lineage never pretrained on this run's val/test; or, for \
a grown corpus, the last corpus version's, measured on the new documents for drift, with the \
same leak check when pretraining continues that version's encoder) -> tokenizer.json."""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd

from selfsup_model.artifacts import atomic_write_bytes, atomic_write_json
from selfsup_model.corpus.splitting import documents_in_split
from selfsup_model.pretraining.continued import (
    InitSource,
    recorded_manifest,
    resolve_init_source,
)
from selfsup_model.text.tokenization import (
    fit_tokenizer,
    load_tokenizer,
    save_tokenizer,
    tokenizer_stats,
)
from tasks.stage import RunContext, StageOutput, progress_logger
from tasks.versions import extended_snapshot, snapshot_documents, snapshot_file, warm_start

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


def _audit_counts(audit: dict) -> dict:
    return {"source_documents_checked": audit["documents_checked"],
            "source_train_documents": audit["source_train_documents"],
            "source_leaking_documents": audit["leaking_documents"],
            "source_audit_passed": audit["passed"]}


# A kept tokenizer drifts when its unknown-token rate on a version's new documents exceeds
# the rate on the validation split it was fitted for by more than this (absolute), or its tokens
# per word by more than this share: new vocabulary it cannot spell well.
DRIFT_UNK_RATE = 0.01
DRIFT_TOKENS_PER_WORD = 0.10


def _lineage_tokenizer(ctx: RunContext, snapshot: Path, docs: pd.DataFrame,
                       out: Path) -> tuple[dict, dict]:
    """Keep the last corpus version's tokenizer (a new one would orphan its encoder); measure
    it on this version's new documents against what it measured when it was fitted."""
    from selfsup_model.corpus.versions import diff_versions

    source = snapshot_file(snapshot, "tokenizer", "tokenizer.json")
    atomic_write_bytes(out / "tokenizer.json", source.read_bytes())
    tok = load_tokenizer(out / "tokenizer.json")
    before = recorded_manifest(snapshot, "tokenizer", "the last corpus version").metrics
    new_docs = docs[diff_versions(snapshot_documents(snapshot, ["id", "text"]),
                                  docs).prev_rows < 0]
    stats = tokenizer_stats(tok, new_docs["text"].tolist())
    # What it measured on validation when it was fitted, carried from version to version.
    fitted = {k: before.get(f"fitted_{k}", before.get(k, 0.0))
              for k in ("val_unk_rate", "val_tokens_per_word")}
    unk_rise = stats["unk_rate"] - fitted["val_unk_rate"]
    tpw_rise = (stats["tokens_per_word"] / fitted["val_tokens_per_word"] - 1.0
                if fitted["val_tokens_per_word"] else 0.0)
    drift = bool(len(new_docs)) and (unk_rise > DRIFT_UNK_RATE or tpw_rise > DRIFT_TOKENS_PER_WORD)
    if drift:
        log.warning("tokenizer: kept from %s, but on this version's %d new documents its "
                    "unknown-token rate is %.2f%% (%+.2f points) and tokens per word %.2f "
                    "(%+.0f%%): past the drift thresholds (%g points, %.0f%%); a new lineage "
                    "(selfsup run --new-lineage) fits a new tokenizer", snapshot.name,
                    len(new_docs), 100 * stats["unk_rate"], 100 * unk_rise,
                    stats["tokens_per_word"], 100 * tpw_rise, 100 * DRIFT_UNK_RATE,
                    100 * DRIFT_TOKENS_PER_WORD)
    counts = {"reused_from": snapshot.relative_to(ctx.workdir).as_posix(),
              "new_documents": len(new_docs), "new_tokens": stats["tokens"],
              "drift": drift}
    metrics = {"new_unk_rate": stats["unk_rate"], "new_tokens_per_word": stats["tokens_per_word"],
               **{f"fitted_{k}": v for k, v in fitted.items()}}
    return counts, metrics


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    docs = pd.read_parquet(inputs["ingest/documents.parquet"], columns=["id", "text"])
    assign = pd.read_parquet(inputs["split/assignments.parquet"], columns=["id", "split"])
    init_from = ctx.config.pretrain.init_from
    files, counts, extra = ["tokenizer.json"], {}, {}
    snapshot = extended_snapshot(ctx, inputs["ingest/version.json"])
    if snapshot is not None and not (snapshot / "tokenizer" / "manifest.json").is_file():
        snapshot = None  # the last version stopped before the tokenizer: fit one now
    if init_from:  # continued pretraining keeps the checkpoint's tokenizer and special ids
        source = resolve_init_source(init_from)
        audit = _check_source(ctx, source, docs, assign, out)
        files.append("source_audit.json")
        counts = {"reused_from": str(source.workdir), **_audit_counts(audit)}
        atomic_write_bytes(out / "tokenizer.json", source.tokenizer.read_bytes())
        tok = load_tokenizer(out / "tokenizer.json")
    elif snapshot is not None:  # a grown corpus keeps its lineage's tokenizer
        counts, extra = _lineage_tokenizer(ctx, snapshot, docs, out)
        tok = load_tokenizer(out / "tokenizer.json")
        continued, _ = warm_start(ctx)
        if continued is not None:  # and pretraining will continue that version's encoder
            audit = _check_source(ctx, resolve_init_source(str(continued)), docs, assign, out)
            files.append("source_audit.json")
            counts |= _audit_counts(audit)
    else:
        tok = fit_tokenizer(documents_in_split(docs, assign, "train")["text"].tolist(),
                            ctx.config.tokenizer)
        save_tokenizer(tok, out / "tokenizer.json")
    val = tokenizer_stats(tok, documents_in_split(docs, assign, "val")["text"].tolist())
    counts = {"vocab_size": val["vocab_size"], "val_tokens": val["tokens"],
              "val_words": val["words"], "reused_from": "", **counts}
    metrics = {"val_unk_rate": val["unk_rate"], "val_tokens_per_word": val["tokens_per_word"],
               **extra}
    return StageOutput(files, counts, metrics, log_artifacts=files)
