"""encode: every split -> int32 windows (.npy, memory-mappable), offsets and per-document labels."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from selfsup_model.artifacts import atomic_write_parquet
from selfsup_model.encoding import encode_split, write_encoded
from selfsup_model.splitting import SPLITS, documents_in_split
from selfsup_model.tokenization import load_tokenizer
from tasks.stage import RunContext, StageOutput


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    tok = load_tokenizer(inputs["tokenizer/tokenizer.json"])
    docs = pd.read_parquet(inputs["ingest/documents.parquet"], columns=["id", "text", "label"])
    assign = pd.read_parquet(inputs["split/assignments.parquet"], columns=["id", "split"])
    files, counts, rejects = [], {}, []
    for split in SPLITS:
        part = documents_in_split(docs, assign, split)
        ids = part["id"].to_numpy()
        encoded = encode_split(tok, part["text"].tolist(), ctx.config.encode)
        files += write_encoded(encoded, out, split)
        # Row i of {split}_docs.parquet is the document whose windows start at doc_offsets[i].
        kept = pd.DataFrame({"id": ids[encoded.kept],
                             "label": part["label"].to_numpy()[encoded.kept]})
        files.append(atomic_write_parquet(out / f"{split}_docs.parquet", kept).name)
        rejects += [(doc_id, split, "no_tokens") for doc_id in ids[encoded.empty]]
        counts[split] = encoded.counts
    rejected = pd.DataFrame(rejects, columns=["id", "split", "reason"])
    files.append(atomic_write_parquet(out / "rejects.parquet", rejected).name)
    totals = {k: sum(c[k] for c in counts.values())
              for k in ("sequences", "tokens", "truncated_docs", "empty_docs")}
    return StageOutput(files, {**totals, "splits": counts})

