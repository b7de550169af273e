"""Benchmark: dedup in-process against its shards on a 2-worker Dask cluster, same run.

Corpus: synthetic documents (words of a 30k-word Zipf vocabulary, 40-160 words
each) with injected copies: near copies of a random earlier document (each
word substituted or deleted at a rate drawn from [0, 0.3]) and exact copies
(case and spacing changed). Written once to a parquet file, as the ingest stage
would.

Methods, interleaved (local, dask, local, dask, ...), best of --repeats:
- local: `find_duplicates` with the in-process mapper, texts in memory (the
  default executor's path, as `tasks.dedup` runs it);
- dask: the same call through `flows.executors` with executor "dask": a
  `LocalCluster` of --workers single-threaded worker processes, one Prefect
  sub-flow mapping shard tasks through `DaskTaskRunner`, texts read by the shards
  from the parquet file. Cluster start-up is timed separately (it is paid once
  per pipeline run, not per stage).

Both results must be identical (frames, pairs, signatures, counts) or the
benchmark fails. Peak memory: the driver's peak RSS over the whole benchmark
process (all methods), each worker's peak RSS at the end.

    .venv/bin/python benchmarks/dedup_sharded.py --docs 200000 --out /tmp/dedup_sharded.json
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
from output import run_cli

from flows.executors import Sharding, open_fan_out, prefect_api_url
from selfsup_model.config import DedupConfig
from selfsup_model.corpus.dedup import find_duplicates
from selfsup_model.corpus.sharding import ParquetTexts


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def build_corpus(docs: int, seed: int, near_rate: float = 0.1,
                 exact_rate: float = 0.05) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    vocab = np.array([f"w{i}" for i in range(30_000)])
    cdf = np.cumsum(1.0 / np.arange(1, len(vocab) + 1))
    cdf /= cdf[-1]

    def draw(k: int) -> np.ndarray:  # k Zipf-distributed words
        return vocab[np.minimum(np.searchsorted(cdf, rng.random(k)), len(vocab) - 1)]

    words = []
    for i in range(docs):
        roll = rng.random()
        if i > 0 and roll < near_rate:
            src = words[rng.integers(i)]
            rate, roll_w = rng.uniform(0, 0.3), rng.random(len(src))
            substituted = np.where(roll_w < rate / 2, draw(len(src)), src)
            words.append(substituted[~((roll_w >= rate / 2) & (roll_w < rate))])  # deletions
        elif i > 0 and roll < near_rate + exact_rate:
            words.append(words[rng.integers(i)])
        else:
            words.append(draw(rng.integers(40, 161)))
    texts = [" ".join(w) for w in words]
    exact = rng.random(docs) < exact_rate  # a change of case and spacing only
    texts = [t.upper().replace(" ", "  ") if e else t for t, e in zip(texts, exact, strict=True)]
    return pd.DataFrame({"id": [f"d{i}" for i in range(docs)], "text": texts})


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(args: argparse.Namespace) -> dict:
    cfg = DedupConfig()
    t0 = time.perf_counter()
    docs = build_corpus(args.docs, args.seed)
    log(f"corpus: {len(docs)} docs in {time.perf_counter() - t0:.1f}s")
    tmp = Path(tempfile.mkdtemp(prefix="dedup-sharded-"))
    path = tmp / "documents.parquet"
    docs.to_parquet(path)
    ids, texts = docs["id"].tolist(), docs["text"].tolist()
    prefect_api_url()  # start the temporary Prefect server before any timing
    sharding = Sharding("dask", shards=args.shards, workers=args.workers)
    t0 = time.perf_counter()
    times: dict[str, list[float]] = {"local": [], "dask": []}
    with open_fan_out(sharding) as fan_out:
        startup = time.perf_counter() - t0
        log(f"local Dask cluster of {args.workers} workers up in {startup:.1f}s")
        results = {}
        for rep in range(args.repeats):
            t0 = time.perf_counter()
            results["local"] = find_duplicates(ids, texts, cfg)
            times["local"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            results["dask"] = fan_out.run("dedup", lambda mapper: find_duplicates(
                ids, ParquetTexts(str(path)), cfg, mapper=mapper, shards=fan_out.shards))
            times["dask"].append(time.perf_counter() - t0)
            log(f"repeat {rep}: local {times['local'][-1]:.1f}s, dask {times['dask'][-1]:.1f}s")
        worker_peaks = _worker_peaks(fan_out)
    a, b = results["local"], results["dask"]
    pd.testing.assert_frame_equal(a.clusters, b.clusters)
    pd.testing.assert_frame_equal(a.pairs, b.pairs)
    assert np.array_equal(a.signatures, b.signatures) and a.counts == b.counts
    best = {k: min(v) for k, v in times.items()}
    return {"docs": args.docs, "workers": args.workers, "shards": sharding.shard_count,
            "cluster_startup_s": round(startup, 2), "seconds": times,
            "best_s": best, "dask_speedup_vs_local": round(best["local"] / best["dask"], 3),
            "driver_peak_rss_mib": round(peak_rss_mib(), 1),
            "worker_peak_rss_mib": worker_peaks, "counts": a.counts, "identical": True}


def _worker_peaks(fan_out) -> list[float]:
    from distributed import Client

    with Client(fan_out.dask_address) as client:
        got = client.run(lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return [round(v, 1) for v in got.values()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=200_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--shards", type=int, default=None,
                        help="[default: one per worker]")
    parser.add_argument("--repeats", type=int, default=2)
    run_cli(parser, run)


if __name__ == "__main__":
    main()
