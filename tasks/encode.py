"""encode: every split -> int32 windows (.npy, memory-mappable), offsets and per-document labels."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE

from selfsup_model.encoding import encode_split, write_encoded
from selfsup_model.splitting import SPLITS
from selfsup_model.tokenization import load_tokenizer
from tasks.io import read_parquet, write_parquet
from tasks.stage import RunContext, StageOutput, StageResult, StageSpec, run_stage

SPEC = StageSpec(
    "encode",
    inputs=("ingest/documents.parquet", "split/assignments.parquet", "tokenizer/tokenizer.json"),
    sections=("encode",),
)


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    tok = load_tokenizer(inputs["tokenizer/tokenizer.json"])
    docs = read_parquet(inputs["ingest/documents.parquet"], ["id", "text", "label"]).set_index("id")
    assign = read_parquet(inputs["split/assignments.parquet"], ["id", "split"])
    files, counts, rejects = [], {}, []
    for split in SPLITS:
        ids = assign.loc[assign["split"] == split, "id"].to_numpy()
        part = docs.loc[ids]
        encoded = encode_split(tok, part["text"].tolist(), ctx.config.encode)
        files += write_encoded(encoded, out, split)
        # Row i of {split}_docs.parquet is the document whose windows start at doc_offsets[i].
        kept = pd.DataFrame({"id": ids[encoded.kept], "label": part["label"].to_numpy()[encoded.kept]})
        files.append(write_parquet(kept, out / f"{split}_docs.parquet"))
        rejects += [(doc_id, split, "no_tokens") for doc_id in ids[encoded.empty]]
        counts[split] = encoded.counts
    files.append(write_parquet(pd.DataFrame(rejects, columns=["id", "split", "reason"]), out / "rejects.parquet"))
    totals = {k: sum(c[k] for c in counts.values()) for k in ("sequences", "tokens", "truncated_docs", "empty_docs")}
    return StageOutput(files, {**totals, "splits": counts})


@task(name="encode", cache_policy=NO_CACHE, persist_result=False)
def encode_task(ctx: RunContext) -> StageResult:
    """Tokenise every split into framed, padded windows."""
    return run_stage(SPEC, ctx, compute)
