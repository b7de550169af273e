"""Benchmark: `find_duplicates` against the plain datasketch recipe, speed and accuracy.

Corpus: docstrings harvested from the default libraries (`pydocs.harvest`),
plus injected copies with known edits: near copies (each word of a source
substituted by a random corpus word or deleted, at a rate drawn uniformly from
[0, --max-edit], so some land below the threshold) and exact copies (only
whitespace changed). Pairs are scored between distinct folded texts
(`fold_for_shingling`: lowercase, whitespace collapsed); exact copies are
scored separately.

Ground truth: a pair is a true duplicate when its exact shingle Jaccard (the
same char 5-gram shingling) is >= --threshold. All pairs of 50k documents
cannot be checked, so truth is computed on a pool: every injected (copy,
source) pair, every pair our method reports, every pair the datasketch recipe
reports on its subsample, and every pair a high-recall probe reports (fresh
signatures with another seed, LSH with 25 bands x 5 rows, pairs whose fresh
signatures rule out the threshold by 6 standard errors dropped). Recall's
denominator is the number of pool pairs whose exact Jaccard is >= threshold.
The probe's S-curve candidates a 0.8-Jaccard pair with probability > 0.9999,
so a true pair missing from the pool would have to evade two independent
signature sets.

The plain recipe (one datasketch.MinHash per document, update() per distinct
shingle, MinHashLSH insert + query) is timed on a random subsample
(--plain-docs) because it is slow; its docs/s does not depend on corpus size.

    .venv/bin/python benchmarks/dedup.py --docs 50000 --out /tmp/dedup_bench.json
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
import tracemalloc

import numpy as np
import pandas as pd
from datasketch import MinHash, MinHashLSH
from output import run_cli

from selfsup_model.config import DEFAULT_PYDOCS_LIBRARIES, DedupConfig
from selfsup_model.corpus.dedup import find_duplicates
from selfsup_model.corpus.lsh import candidate_pairs
from selfsup_model.corpus.minhash import (
    fold_for_shingling,
    minhash_signatures,
    plausible_pairs,
    verify_pairs,
)
from selfsup_model.corpus.pydocs import harvest

# 25 bands x 5 rows: P(candidate | J = 0.8) = 1 - (1 - 0.8**5)**25 > 0.9999.
PROBE_BANDS_ROWS = (25, 5)


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def edit_words(text: str, rate: float, vocab: np.ndarray, rng: np.random.Generator) -> str:
    """Substitute or delete each word with probability `rate` (half each)."""
    out = []
    for word in text.split():
        roll = rng.random()
        if roll >= rate:
            out.append(word)
        elif roll < rate / 2:
            out.append(str(rng.choice(vocab)))
    return " ".join(out)


def build_corpus(args: argparse.Namespace) -> tuple[list[str], pd.DataFrame]:
    """Texts in shuffled order and the injections table (copy row, source row, kind, rate)."""
    rng = np.random.default_rng(args.seed)
    pool = harvest(args.libraries, workers=2)["text"].tolist()
    n_near, n_exact = int(args.docs * args.near_rate), int(args.docs * args.exact_rate)
    n_base = args.docs - n_near - n_exact
    if n_base > len(pool):
        raise SystemExit(f"harvest gave {len(pool)} docstrings; need {n_base}: lower --docs")
    base = [pool[i] for i in np.sort(rng.choice(len(pool), n_base, replace=False))]
    vocab = np.array(" ".join(base[:2000]).split())
    wordy = np.flatnonzero([len(t.split()) >= 20 for t in base])
    texts, rows = list(base), []
    for kind, count in (("near", n_near), ("exact", n_exact)):
        for src in rng.choice(wordy, count):
            rate = float(rng.uniform(0, args.max_edit)) if kind == "near" else 0.0
            copy = (
                edit_words(base[src], rate, vocab, rng)
                if kind == "near"
                else "  " + base[src] + "\n"
            )
            rows.append((len(texts), int(src), kind, rate))
            texts.append(copy)
    order = rng.permutation(len(texts))  # injected copies spread through the corpus
    where = np.empty_like(order)
    where[order] = np.arange(len(order))
    inj = pd.DataFrame(rows, columns=["copy", "source", "kind", "rate"])
    inj["copy"], inj["source"] = where[inj["copy"]], where[inj["source"]]
    return [texts[i] for i in order], inj


def plain_datasketch(texts: list[str], cfg: DedupConfig) -> tuple[set[tuple[int, int]], float]:
    """The textbook recipe; returns its unverified candidate pairs and the seconds it took."""
    start = time.perf_counter()
    lsh = MinHashLSH(threshold=cfg.threshold, num_perm=cfg.num_perm)
    sketches = []
    for key, text in enumerate(texts):
        norm = fold_for_shingling(text)
        size = cfg.shingle_size
        shingles = {norm[k : k + size] for k in range(max(len(norm) - size + 1, 1))}
        sketch = MinHash(num_perm=cfg.num_perm, seed=cfg.seed)
        for shingle in shingles:
            sketch.update(shingle.encode("utf-8"))
        lsh.insert(key, sketch)
        sketches.append(sketch)
    pairs = {(min(i, j), max(i, j)) for i, s in enumerate(sketches) for j in lsh.query(s) if j != i}
    return pairs, time.perf_counter() - start


def as_codes(pairs: np.ndarray, n: int) -> np.ndarray:
    """(m, 2) rows -> sorted unique int64 codes min * n + max (self-pairs dropped)."""
    lo, hi = pairs.min(axis=1), pairs.max(axis=1)
    return np.unique((lo * n + hi)[lo != hi])


def score(found: np.ndarray, truth: np.ndarray) -> tuple[float, float]:
    """(precision, recall) of code arrays."""
    hit = len(np.intersect1d(found, truth))
    return hit / max(len(found), 1), hit / max(len(truth), 1)


def run(args: argparse.Namespace) -> dict:
    cfg = DedupConfig(threshold=args.threshold, num_perm=args.num_perm)
    log("harvesting docstrings ...")
    texts, inj = build_corpus(args)
    ids = [f"doc{i}" for i in range(len(texts))]
    log(f"corpus: {len(texts)} docs, {len(inj)} injected; timing find_duplicates ...")
    start = time.perf_counter()
    res = find_duplicates(ids, texts, cfg)
    ours_s = time.perf_counter() - start
    tracemalloc.start()
    find_duplicates(ids, texts, cfg)
    traced_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()

    rng = np.random.default_rng(args.seed + 1)
    sub = np.sort(rng.choice(len(texts), min(args.plain_docs, len(texts)), replace=False))
    log(f"timing the plain datasketch recipe on {len(sub)} docs ...")
    plain_pairs, plain_s = plain_datasketch([texts[i] for i in sub], cfg)
    start = time.perf_counter()
    find_duplicates([ids[i] for i in sub], [texts[i] for i in sub], cfg)
    ours_sub_s = time.perf_counter() - start

    log("building the ground-truth pool ...")
    code, distinct = pd.factorize(pd.Series([fold_for_shingling(t) for t in texts], dtype=object))
    u = len(distinct)
    row = {doc: i for i, doc in enumerate(ids)}
    ours = as_codes(
        code[
            np.array(
                [
                    [row[a], row[b]]
                    for a, b in res.pairs[["left_id", "right_id"]].itertuples(index=False)
                ]
            ).reshape(-1, 2)
        ],
        u,
    )
    near = inj[inj["kind"] == "near"]
    injected = as_codes(code[near[["copy", "source"]].to_numpy()], u)
    plain = as_codes(code[sub[np.array(sorted(plain_pairs)).reshape(-1, 2)]], u)
    probe_sig = minhash_signatures(list(distinct), num_perm=cfg.num_perm, seed=cfg.seed + 1000)
    probe = candidate_pairs(probe_sig, 0.5, PROBE_BANDS_ROWS)
    probe = as_codes(probe[plausible_pairs(probe_sig, probe, cfg.threshold)], u)
    pool = np.unique(np.concatenate([ours, injected, plain, probe]))
    jac = verify_pairs(distinct, np.stack([pool // u, pool % u], axis=1))
    truth = pool[jac >= cfg.threshold]

    in_sub = np.zeros(u, dtype=bool)
    in_sub[code[sub]] = True
    truth_sub = truth[in_sub[truth // u] & in_sub[truth % u]]
    ours_p, ours_r = score(ours, truth)
    plain_p, plain_r = score(plain, truth_sub)
    inj_true = np.intersect1d(injected, truth)
    cluster = res.clusters["cluster_id"].to_numpy()
    exact = inj[inj["kind"] == "exact"]
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "docs": len(texts),
        "injected_near": len(near),
        "injected_exact": len(exact),
        "threshold": cfg.threshold,
        "num_perm": cfg.num_perm,
        "shingles": f"{cfg.shingle} {cfg.shingle_size}-grams",
        "ours_seconds": round(ours_s, 2),
        "ours_docs_per_s": round(len(texts) / ours_s, 1),
        "ours_subsample_docs_per_s": round(len(sub) / ours_sub_s, 1),
        "plain_subsample_docs": len(sub),
        "plain_seconds": round(plain_s, 2),
        "plain_docs_per_s": round(len(sub) / plain_s, 1),
        "speedup_full_vs_plain": round((len(texts) / ours_s) / (len(sub) / plain_s), 1),
        "speedup_same_subsample": round(plain_s / ours_sub_s, 1),
        "peak_traced_mib_find_duplicates": round(traced_peak / 2**20, 1),
        "peak_rss_mib_process": round(rss_mib, 1),
        "pool_pairs": len(pool),
        "true_pairs": len(truth),
        "ours_pairs": len(ours),
        "ours_precision": round(ours_p, 4),
        "ours_recall": round(ours_r, 4),
        "injected_true_pairs": len(inj_true),
        "injected_recall": round(len(np.intersect1d(ours, inj_true)) / max(len(inj_true), 1), 4),
        "exact_copies_caught": int((cluster[exact["copy"]] == cluster[exact["source"]]).sum()),
        "plain_pairs_subsample": len(plain),
        "plain_true_pairs_subsample": len(truth_sub),
        "plain_precision_unverified": round(plain_p, 4),
        "plain_recall": round(plain_r, 4),
        "counts": res.counts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=50_000, help="total documents incl. injected")
    parser.add_argument("--plain-docs", type=int, default=5_000, help="subsample for datasketch")
    parser.add_argument("--threshold", type=float, default=0.8)
    parser.add_argument("--num-perm", type=int, default=128)
    parser.add_argument(
        "--near-rate", type=float, default=0.05, help="share of docs that are near copies"
    )
    parser.add_argument(
        "--exact-rate", type=float, default=0.01, help="share of docs that are exact copies"
    )
    parser.add_argument(
        "--max-edit", type=float, default=0.12, help="max per-word edit rate of a near copy"
    )
    parser.add_argument("--libraries", nargs="+", default=list(DEFAULT_PYDOCS_LIBRARIES))
    run_cli(parser, run)


if __name__ == "__main__":
    main()
