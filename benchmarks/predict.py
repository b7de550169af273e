"""Scoring throughput of a finished run's classifier (`selfsup predict`'s path), in documents/s,
through Keras and through ONNX Runtime (`--engine onnx`).

    .venv/bin/python benchmarks/predict.py --workdir data/runs/default
    .venv/bin/python benchmarks/predict.py --workdir W --docs 4000 --engines keras --json

Scores the run's own documents (repeated up to --docs) as new text: reading is
done once up front, then each batch size is timed end to end over the same
documents (normalisation, tokenisation, windows, the classifier, softmax, the
mean over each document's windows), best of --repeats, the engines in turn
within each repeat. The tokenisation share is timed on its own. The models are
loaded (and converted to ONNX) once, outside the timing. One-document latency:
the median of 50 documents, the engines in turn.
"""

from __future__ import annotations

import argparse
import json
import time

import pandas as pd

from selfsup_model.config import IngestConfig
from selfsup_model.corpus.ingest import RawRecord
from selfsup_model.serving.inference import load_run_classifier
from selfsup_model.serving.scoring import judge_inputs, score


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="data/runs/default")
    ap.add_argument("--docs", type=int, default=2000)
    ap.add_argument("--batch-sizes", default="1,32,256")
    ap.add_argument("--engines", default="keras,onnx",
                    help="keras, onnx (the export extra), or both, timed in turn")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    keras_bundle = load_run_classifier(args.workdir)
    engines = args.engines.split(",")
    bundles = {e: keras_bundle if e == "keras" else keras_bundle.onnx_engine() for e in engines}
    texts = pd.read_parquet(f"{args.workdir}/ingest/documents.parquet", columns=["text"])["text"]
    texts = (texts.tolist() * (args.docs // len(texts) + 1))[: args.docs]
    inputs = judge_inputs((RawRecord(str(i), str(i), t) for i, t in enumerate(texts)),
                          IngestConfig())
    t0 = time.perf_counter()
    keras_bundle.encode_texts(inputs.documents["text"].tolist())
    encode_s = time.perf_counter() - t0
    rows = []
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        for bundle in bundles.values():
            score(bundle, inputs, batch_size)  # warm-up: traces this shape (Keras)
        best = dict.fromkeys(engines, float("inf"))
        for _ in range(args.repeats):  # the engines in turn, so a slow spell hits both
            for engine, bundle in bundles.items():
                t0 = time.perf_counter()
                predictions, _ = score(bundle, inputs, batch_size)
                best[engine] = min(best[engine], time.perf_counter() - t0)
        row = {"batch_size": batch_size, "docs": len(predictions)}
        for engine in engines:
            row[f"{engine}_docs_per_s"] = round(len(predictions) / best[engine], 1)
        rows.append(row)
    latency = one_document_latency(bundles, inputs.documents["text"].head(50).tolist())
    if len(engines) == 2:
        first, second = engines
        for row in rows:
            row[f"{second}_vs_{first}"] = round(row[f"{second}_docs_per_s"]
                                                / row[f"{first}_docs_per_s"], 2)
    summary = {"workdir": args.workdir, "kept": keras_bundle.spec["kept"]["method"],
               "max_len": keras_bundle.encode.max_len, "encode_s": round(encode_s, 3),
               "rows": rows, "one_document_ms": latency}
    if args.json:
        print(json.dumps(summary))
        return
    print(f"{summary['kept']} from {args.workdir}; {len(inputs.documents)} documents; "
          f"text -> framed ids alone: {encode_s:.2f} s "
          f"({len(inputs.documents) / encode_s:,.0f} docs/s)")
    print(f"{'batch':>6} " + " ".join(f"{e + ' docs/s':>14}" for e in engines)
          + (f" {engines[1] + '/' + engines[0]:>12}" if len(engines) == 2 else ""))
    for row in rows:
        print(f"{row['batch_size']:>6} "
              + " ".join(f"{row[e + '_docs_per_s']:>14,.0f}" for e in engines)
              + (f" {row[engines[1] + '_vs_' + engines[0]]:>12.2f}" if len(engines) == 2
                 else ""))
    print("one document (median of 50): "
          + ", ".join(f"{e} {ms:.1f} ms" for e, ms in latency.items()))


def one_document_latency(bundles: dict, texts: list[str]) -> dict[str, float]:
    """Median ms to score one document (`predict_proba([text])`) per engine, in turn."""
    for bundle in bundles.values():
        bundle.predict_proba(texts[:1])  # warm-up: trace this shape
    times: dict[str, list[float]] = {engine: [] for engine in bundles}
    for text in texts:
        for engine, bundle in bundles.items():
            t0 = time.perf_counter()
            bundle.predict_proba([text])
            times[engine].append(time.perf_counter() - t0)
    return {e: round(sorted(t)[len(t) // 2] * 1000, 2) for e, t in times.items()}


if __name__ == "__main__":
    main()
