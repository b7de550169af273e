"""tokenizer: fitted on the training split only -> tokenizer.json."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from selfsup_model.tokenization import fit_tokenizer, save_tokenizer, tokenizer_stats
from tasks.io import read_parquet
from tasks.stage import RunContext, StageOutput, StageResult, StageSpec, run_stage

SPEC = StageSpec("tokenizer", inputs=("ingest/documents.parquet", "split/assignments.parquet"),
                 sections=("tokenizer",))


def split_texts(inputs: dict[str, Path], split: str) -> list[str]:
    """Texts of one split, in assignment order (deterministic)."""
    docs = read_parquet(inputs["ingest/documents.parquet"], ["id", "text"]).set_index("id")
    assign = read_parquet(inputs["split/assignments.parquet"], ["id", "split"])
    ids = assign.loc[assign["split"] == split, "id"]
    return docs.loc[ids, "text"].tolist()


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    tok = fit_tokenizer(split_texts(inputs, "train"), ctx.config.tokenizer)
    save_tokenizer(tok, out / "tokenizer.json")
    val = tokenizer_stats(tok, split_texts(inputs, "val"))
    counts = {"vocab_size": val["vocab_size"], "val_tokens": val["tokens"], "val_words": val["words"]}
    metrics = {"val_unk_rate": val["unk_rate"], "val_tokens_per_word": val["tokens_per_word"]}
    return StageOutput(["tokenizer.json"], counts, metrics, log_artifacts=["tokenizer.json"])


@task(name="tokenizer", cache_policy=NO_CACHE, persist_result=False)
def tokenizer_task(ctx: RunContext) -> StageResult:
    """Fit the tokenizer on training documents only."""
    return run_stage(SPEC, ctx, compute)
