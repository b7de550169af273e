"""Scoring throughput of a finished run's classifier (`selfsup predict`'s path), in documents/s.

    .venv/bin/python benchmarks/predict.py --workdir data/runs/default
    .venv/bin/python benchmarks/predict.py --workdir W --docs 4000 --json

Scores the run's own documents (repeated up to --docs) as new text: reading is
done once up front, then each batch size is timed end to end over the same
documents (normalisation, tokenisation, windows, the classifier, softmax, the
mean over each document's windows), best of --repeats. The tokenisation share
is timed on its own. The model is loaded once, outside the timing.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import pandas as pd

from selfsup_model.config import IngestConfig
from selfsup_model.corpus.ingest import RawRecord
from selfsup_model.serving.inference import load_run_classifier, softmax
from selfsup_model.serving.scoring import judge_inputs, score


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="data/runs/default")
    ap.add_argument("--docs", type=int, default=2000)
    ap.add_argument("--batch-sizes", default="1,32,256")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    bundle = load_run_classifier(args.workdir)
    texts = pd.read_parquet(f"{args.workdir}/ingest/documents.parquet", columns=["text"])["text"]
    texts = (texts.tolist() * (args.docs // len(texts) + 1))[: args.docs]
    inputs = judge_inputs((RawRecord(str(i), str(i), t) for i, t in enumerate(texts)),
                          IngestConfig())
    t0 = time.perf_counter()
    bundle.encode_texts(inputs.documents["text"].tolist())
    encode_s = time.perf_counter() - t0
    rows = []
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        score(bundle, inputs, batch_size)  # warm-up: traces the predict function for this shape
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            predictions, _ = score(bundle, inputs, batch_size)
            best = min(best, time.perf_counter() - t0)
        rows.append({"batch_size": batch_size, "docs": len(predictions),
                     "seconds": round(best, 3), "docs_per_s": round(len(predictions) / best, 1)})
    latency = one_document_latency(bundle, inputs.documents["text"].head(50).tolist())
    base = rows[0]["docs_per_s"]
    for row in rows:
        row["vs_first"] = round(row["docs_per_s"] / base, 2)
    summary = {"workdir": args.workdir, "kept": bundle.spec["kept"]["method"],
               "max_len": bundle.encode.max_len, "encode_s": round(encode_s, 3), "rows": rows,
               "one_document_ms": latency}
    if args.json:
        print(json.dumps(summary))
        return
    print(f"{summary['kept']} from {args.workdir}; {len(inputs.documents)} documents; "
          f"text -> framed ids alone: {encode_s:.2f} s "
          f"({len(inputs.documents) / encode_s:,.0f} docs/s)")
    print(f"{'batch':>6} {'seconds':>8} {'docs/s':>9} {'vs first':>9}")
    for row in rows:
        print(f"{row['batch_size']:>6} {row['seconds']:>8.2f} {row['docs_per_s']:>9,.0f} "
              f"{row['vs_first']:>9.2f}")
    print(f"one document (median of 50): {latency['padded_to_power_of_two']:.1f} ms; padded to a "
          f"full batch of 256 as before: {latency['padded_to_256']:.1f} ms "
          f"({latency['padded_to_256'] / latency['padded_to_power_of_two']:.1f}x)")


def one_document_latency(bundle, texts: list[str]) -> dict[str, float]:
    """Median ms to score one document: as `predict_proba` does now (a short batch is padded to
    the next power of two) and as it did before (padded to the full batch of 256)."""
    def median_ms(fn) -> float:
        fn(texts[0])  # warm-up: trace this shape
        times = []
        for text in texts:
            t0 = time.perf_counter()
            fn(text)
            times.append(time.perf_counter() - t0)
        return round(sorted(times)[len(times) // 2] * 1000, 2)

    def padded_to_256(text: str) -> None:
        ids = bundle.encode_texts([text]).ids  # (windows, L)
        batch = np.zeros((256, ids.shape[1]), np.int32)
        batch[: len(ids)] = ids
        softmax(np.asarray(bundle.model.predict_on_batch(batch))[: len(ids)]).mean(axis=0)

    return {"padded_to_power_of_two": median_ms(lambda t: bundle.predict_proba([t])),
            "padded_to_256": median_ms(padded_to_256)}


if __name__ == "__main__":
    main()
