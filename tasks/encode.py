"""encode: every split -> int32 windows (.npy, memory-mappable), offsets and per-document labels.

Documents are encoded in shards (`encode_shard`, merged in order by `merge_encoded`), so the
run's executor decides where tokenisation runs; every executor writes the same bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from selfsup_model.artifacts import atomic_write_parquet
from selfsup_model.corpus.sharding import InMemoryTexts, Mapper, ParquetTexts, shard_bounds
from selfsup_model.corpus.splitting import SPLITS, documents_in_split
from selfsup_model.text.encoding import EncodedSplit, encode_shard, merge_encoded, write_encoded
from tasks.stage import RunContext, StageOutput


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    docs_path, fan_out = inputs["ingest/documents.parquet"], ctx.fan_out
    docs = pd.read_parquet(docs_path, columns=["id", "text", "label"] if fan_out.in_process
                           else ["id", "label"])
    # shard tasks read the texts themselves unless they run here: only the path travels
    source = (InMemoryTexts(docs["text"].tolist()) if fan_out.in_process
              else ParquetTexts(str(docs_path.resolve())))
    docs = docs.assign(row=np.arange(len(docs), dtype=np.int64))
    assign = pd.read_parquet(inputs["split/assignments.parquet"], columns=["id", "split"])
    parts = {split: documents_in_split(docs, assign, split) for split in SPLITS}
    cfg, tokenizer = ctx.config.encode, str(inputs["tokenizer/tokenizer.json"].resolve())

    def encode_all(mapper: Mapper) -> dict[str, EncodedSplit]:
        encoded = {}
        for split, part in parts.items():
            rows = part["row"].to_numpy()
            items = [{"source": source, "rows": rows[lo:hi], "tokenizer": tokenizer, "cfg": cfg}
                     for lo, hi in shard_bounds(len(rows), fan_out.shards)]
            encoded[split] = merge_encoded(mapper(f"encode-{split}", encode_shard, items),
                                           cfg.max_len)
        return encoded

    files, counts, rejects = [], {}, []
    for split, encoded in fan_out.run("encode", encode_all).items():
        part = parts[split]
        ids = part["id"].to_numpy()
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
