"""Benchmark: split time against dedup time on templated text, and an outside leakage check.

Corpus: `templated.templated_corpus` - package descriptions from a Zipf-popular
set of templates with slot fillers, plus free text: large LSH buckets of
templated near-copies, the shape that made unit building and the audit blow up.

Timed, in one run, exactly as the pipeline calls them: `find_duplicates` on
every document (tasks/dedup.py), then `assign_splits` on the kept documents
with their dedup signatures and cluster ids (tasks/split.py). The ratio
split seconds / dedup seconds is the figure of merit (target <= 2).

Outside recomputation: exact Jaccard of every (val/test, train) pair, sharing
no code with the pipeline's MinHash/LSH path. Shingles follow the same
definition (folded text, character 5-grams, a text shorter than one shingle is
one shingle) but are cut as Python strings and counted by scikit-learn's
CountVectorizer, so no hashing is involved; one sparse product per block of
val/test rows gives each one's intersection with every train document. No
candidate generation, so nothing can be missed. Leaks are cross-split pairs at
Jaccard >= relatedness_threshold; the expected count is 0. (--outside-queries
limits it to a seeded sample of val/test documents.)

    .venv/bin/python benchmarks/split.py --docs 60000 --out /tmp/split_bench.json
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import numpy as np
from output import run_cli
from scipy import sparse
from sklearn.feature_extraction.text import CountVectorizer
from templated import templated_corpus

from selfsup_model.config import DedupConfig, SplitConfig
from selfsup_model.corpus.dedup import find_duplicates
from selfsup_model.corpus.splitting import SplitCorpus, assign_splits

_QUERY_CHUNK = 128  # val/test rows per sparse product: bounds the (rows, n_train) block


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def char_shingles(size: int):
    """The pipeline's shingle definition on an already folded text, as Python strings."""

    def analyzer(text: str) -> list[str]:
        return [text[k : k + size] for k in range(max(len(text) - size + 1, 1))]

    return analyzer


def binary_shingle_matrix(texts: list[str], size: int) -> sparse.csr_matrix:
    """(n, V) 0/1 int32 matrix of character shingles of the folded texts."""
    folded = [" ".join(t.lower().split()) for t in texts]
    x = CountVectorizer(analyzer=char_shingles(size), binary=True, dtype=np.int32)
    return x.fit_transform(folded).tocsr()


def outside_leaks(
    texts: list[str], split: np.ndarray, threshold: float, size: int, queries: int, seed: int
) -> dict:
    """Exact Jaccard of every (val/test, train) pair, by sparse products of 0/1 shingle rows.

    No candidate generation at all: row q of Q @ T.T is q's exact intersection
    with every train document. `queries` > 0 checks that many val/test documents
    (a seeded sample), each against the whole train split."""
    start = time.perf_counter()
    x = binary_shingle_matrix(texts, size)
    sizes = np.diff(x.indptr)
    train, query = np.flatnonzero(split == "train"), np.flatnonzero(split != "train")
    if 0 < queries < len(query):
        query = np.sort(np.random.default_rng(seed).choice(query, queries, replace=False))
    x_train_t = x[train].T.tocsr()  # (V, n_train)
    leaks, worst = [], 0.0
    for lo in range(0, len(query), _QUERY_CHUNK):
        rows = query[lo : lo + _QUERY_CHUNK]
        inter = (x[rows] @ x_train_t).tocoo()  # shared shingles of every pair that shares any
        q, t = rows[inter.row], train[inter.col]
        jac = inter.data / (sizes[q] + sizes[t] - inter.data)
        worst = max(worst, float(jac.max(initial=0.0)))
        hit = np.flatnonzero(jac >= threshold)
        leaks += [(int(q[k]), int(t[k]), round(float(jac[k]), 4)) for k in hit]
        if lo // _QUERY_CHUNK % 10 == 0:
            log(f"outside check: {lo + len(rows)}/{len(query)} val/test documents")
    return {
        "outside_query_docs": len(query),
        "outside_pairs_checked": len(query) * len(train),
        "outside_leaks": len(leaks),
        "outside_leak_examples": leaks[:5],
        "outside_max_cross_split_jaccard": round(worst, 4),
        "outside_seconds": round(time.perf_counter() - start, 1),
    }


def run(args: argparse.Namespace) -> dict:
    dedup_cfg = DedupConfig()
    split_cfg = SplitConfig(audit_action="warn")
    log(f"generating {args.docs} templated documents ...")
    corpus = templated_corpus(args.docs, templates=args.templates, seed=args.seed)
    ids = [f"pkg{i}" for i in range(len(corpus))]
    texts = corpus["text"].tolist()
    log("timing find_duplicates ...")
    start, cpu = time.perf_counter(), time.process_time()
    res = find_duplicates(ids, texts, dedup_cfg)
    dedup_s, dedup_cpu = time.perf_counter() - start, time.process_time() - cpu
    log(f"dedup: {dedup_s:.2f} s wall, {dedup_cpu:.2f} s CPU")
    kept = res.clusters["is_kept"].to_numpy()
    kept_ids = [i for i, k in zip(ids, kept, strict=True) if k]
    kept_texts = [t for t, k in zip(texts, kept, strict=True) if k]
    nones = [None] * len(kept_ids)
    log(f"timing assign_splits on {len(kept_ids)} kept documents ...")
    profiler = cProfile.Profile() if args.profile else None
    start, cpu = time.perf_counter(), time.process_time()
    if profiler:
        profiler.enable()
    result = assign_splits(
        SplitCorpus(kept_ids, kept_texts, nones, nones, res.signatures[kept],
                    res.clusters["cluster_id"].to_numpy()[kept]),
        split_cfg,
        dedup_cfg,
        progress=lambda done, total: log(f"split progress {done}/{total}"),
    )
    split_s, split_cpu = time.perf_counter() - start, time.process_time() - cpu
    log(f"split: {split_s:.2f} s wall, {split_cpu:.2f} s CPU; ratio {split_s / dedup_s:.2f}")
    if profiler:
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(30)
    log("outside leakage recomputation ...")
    split = result.assignments["split"].to_numpy(dtype=object)
    outside = outside_leaks(
        kept_texts,
        split,
        split_cfg.relatedness_threshold,
        dedup_cfg.shingle_size,
        args.outside_queries,
        args.seed,
    )
    return {
        "docs": len(texts),
        "kept": len(kept_ids),
        "templates": args.templates,
        "dedup_seconds": round(dedup_s, 2),
        "split_seconds": round(split_s, 2),
        "split_over_dedup": round(split_s / dedup_s, 2),
        "dedup_cpu_seconds": round(dedup_cpu, 2),
        "split_cpu_seconds": round(split_cpu, 2),
        "split_over_dedup_cpu": round(split_cpu / dedup_cpu, 2),
        "relatedness_threshold": split_cfg.relatedness_threshold,
        "units": result.counts["units"],
        "largest_unit": result.counts["largest_unit"],
        "docs_per_split": result.counts["docs_per_split"],
        "split_counts": {
            k: v
            for k, v in result.counts.items()
            if k not in ("docs_per_split", "units_per_split", "labels_per_split")
        },
        "audit_candidate_pairs": result.audit["candidate_pairs"],
        "audit_leaks": result.audit["related_pairs"],
        **outside,
        "dedup_counts": res.counts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=60_000)
    parser.add_argument("--templates", type=int, default=1000)
    parser.add_argument("--profile", action="store_true", help="cProfile assign_splits")
    parser.add_argument(
        "--outside-queries",
        type=int,
        default=0,
        help="val/test documents the outside check compares with all of train (0: every one)",
    )
    run_cli(parser, run)


if __name__ == "__main__":
    main()
