"""Benchmark: a corpus that grows, version after version, in one workdir.

Corpus: `templated.templated_corpus` (package descriptions from Zipf-popular templates with
slot fillers, plus free text: large LSH buckets of templated near-copies), labelled by
template family. Version 1 is the first `--docs` documents; then five steps of +5% and one of
+20% (each relative to the version before). Every step also brings `--near-copies` near-copies
(one word appended) of random earlier documents of every split.

Per step, in one run: ingest + dedup + split of the grown corpus on the versioned workdir
(incremental) against the same three stages on a fresh workdir (a full rerun), as
`run_pipeline` runs them (stage compute seconds, from the stage results); documents of the
previous version whose split changed (must be 0); leaks found by an outside recomputation
(`split.outside_leaks`' exact shingle Jaccard by sparse products, sharing no code with the
pipeline's MinHash/LSH path) among the pairs with a new document, train against val/test both
ways (must be 0; earlier pairs were checked at their own step); quarantined documents; and the
per-label split proportions. At the end, the kept set of the incremental dedup against one
dedup of the final corpus in which earlier versions take precedence
(`find_duplicates(versions=...)`), and against a full rerun's (which does not keep the
first-seen promise, so it may differ).

    .venv/bin/python benchmarks/grow.py --docs 50000 --out /tmp/grow.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
from output import run_cli
from split import binary_shingle_matrix
from templated import templated_corpus

from selfsup_model.config import DedupConfig
from selfsup_model.corpus.dedup import find_duplicates

STAGES = ["ingest", "dedup", "split"]
STEPS = (0.05, 0.05, 0.05, 0.05, 0.05, 0.20)
_CHUNK = 256  # query rows per sparse product


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def corpus_rows(args: argparse.Namespace) -> tuple[list[dict], list[int]]:
    """Every document of the final version in arrival order, and each version's size."""
    sizes = [args.docs]
    for step in STEPS:
        sizes.append(round(sizes[-1] * (1 + step)) + args.near_copies)
    frame = templated_corpus(sizes[-1], seed=args.seed)
    rng = np.random.default_rng(args.seed + 1)
    rows = []
    for version, size in enumerate(sizes):
        fresh = size - len(rows) - (args.near_copies if version else 0)
        for k in range(fresh):
            i = len(rows)
            template = int(frame["template"].iat[i])
            rows.append({"id": f"v{version}-{k}", "text": frame["text"].iat[i],
                         "label": "free" if template < 0 else f"family{template % 5}"})
        if version:
            for k, i in enumerate(rng.choice(sizes[version - 1], args.near_copies,
                                             replace=False)):
                rows.append({"id": f"v{version}-near{k}",
                             "text": rows[i]["text"] + f" extra{version}x{k}",
                             "label": rows[i]["label"]})
    return rows, sizes


def write_corpus(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(path)


def timed_run(config, corpus: Path, workdir: Path) -> dict:
    from flows.pipeline import run_pipeline

    start = time.perf_counter()
    results = run_pipeline(config, str(corpus), workdir=str(workdir), stages=STAGES,
                           tracking=False)
    return {"wall_s": round(time.perf_counter() - start, 2),
            "stages_s": round(sum(r.duration_s for r in results), 2),
            **{f"{r.stage}_s": round(r.duration_s, 2) for r in results}}


def outside_new_leaks(texts: list[str], split: np.ndarray, new: np.ndarray,
                      threshold: float, size: int) -> dict:
    """Exact Jaccard of every pair of a new document with a document on the other side
    (train against val/test), by sparse products of 0/1 shingle rows."""
    start = time.perf_counter()
    x = binary_shingle_matrix(texts, size)
    sizes = np.diff(x.indptr)
    is_train = split == "train"
    leaks, checked, worst = 0, 0, 0.0
    for rows_mask, cols_mask in ((new & ~is_train, is_train), (new & is_train, ~is_train)):
        rows, cols = np.flatnonzero(rows_mask), np.flatnonzero(cols_mask)
        x_cols_t = x[cols].T.tocsr()
        for lo in range(0, len(rows), _CHUNK):
            q = rows[lo : lo + _CHUNK]
            inter = (x[q] @ x_cols_t).tocoo()
            a, b = q[inter.row], cols[inter.col]
            jac = inter.data / (sizes[a] + sizes[b] - inter.data)
            worst = max(worst, float(jac.max(initial=0.0)))
            leaks += int((jac >= threshold).sum())
        checked += len(rows) * len(cols)
    return {"outside_pairs_checked": checked, "outside_leaks": leaks,
            "outside_max_cross_split_jaccard": round(worst, 4),
            "outside_seconds": round(time.perf_counter() - start, 1)}


def proportions(assign: pd.DataFrame, labels: dict[str, str]) -> dict[str, dict[str, float]]:
    frame = assign.assign(label=assign["id"].map(labels))
    return {label: {s: round(float(v), 4) for s, v in
                    part["split"].value_counts(normalize=True).sort_index().items()}
            for label, part in frame.groupby("label")}


def run(args: argparse.Namespace) -> dict:
    from selfsup_model.presets import build_config

    logging.basicConfig(level=logging.WARNING)
    config = build_config("tiny", overrides=["split.audit_action=warn"])
    rows, sizes = corpus_rows(args)
    labels = {r["id"]: r["label"] for r in rows}
    root = Path(args.workdir or tempfile.mkdtemp(prefix="selfsup-grow-"))
    root.mkdir(parents=True, exist_ok=True)
    corpus, versioned = root / "corpus.jsonl", root / "versioned"
    log(f"version 1: {sizes[0]} documents; steps {STEPS}; workdirs under {root}")
    write_corpus(corpus, rows[: sizes[0]])
    first = timed_run(config, corpus, versioned)
    steps = [{"version": 1, "documents": sizes[0], "incremental": first}]
    previous = pd.read_parquet(versioned / "split" / "assignments.parquet")
    for version, (step, size) in enumerate(zip(STEPS, sizes[1:], strict=True), start=2):
        write_corpus(corpus, rows[:size])
        log(f"version {version}: +{step:.0%} -> {size} documents")
        inc = timed_run(config, corpus, versioned)
        full = timed_run(config, corpus, root / f"full-v{version}")
        assign = pd.read_parquet(versioned / "split" / "assignments.parquet")
        both = previous.merge(assign, on="id", suffixes=("_before", "_after"))
        moved = int((both["split_before"] != both["split_after"]).sum())
        held = pd.read_parquet(versioned / "split" / "quarantine.parquet")
        docs = pd.read_parquet(versioned / "ingest" / "documents.parquet",
                               columns=["id", "text"]).set_index("id")
        texts = docs.loc[assign["id"], "text"].tolist()
        new = ~assign["id"].isin(previous["id"]).to_numpy()
        outside = outside_new_leaks(texts, assign["split"].to_numpy(), new,
                                    config.split.relatedness_threshold,
                                    config.dedup.shingle_size)
        steps.append({"version": version, "step": step, "documents": size,
                      "incremental": inc, "full_rerun": full,
                      "speedup_stages": round(full["stages_s"] / max(inc["stages_s"], 1e-9), 1),
                      "speedup_wall": round(full["wall_s"] / max(inc["wall_s"], 1e-9), 1),
                      "moved": moved, "quarantined": len(held), **outside,
                      "new_in_split": int(new.sum()),
                      "proportions": proportions(assign, labels)})
        log(json.dumps({k: v for k, v in steps[-1].items() if k != "proportions"}))
        previous = assign

    log("the kept set against one dedup of the final corpus with precedence ...")
    clusters = pd.read_parquet(versioned / "dedup" / "clusters.parquet")
    ids = clusters["id"].tolist()
    version_of = {r["id"]: next(v for v, s in enumerate(sizes) if i < s)
                  for i, r in enumerate(rows[: sizes[-1]])}
    docs = pd.read_parquet(versioned / "ingest" / "documents.parquet", columns=["id", "text"])
    once = find_duplicates(ids, docs["text"].tolist(), DedupConfig(**config.dedup.model_dump()),
                           versions=np.array([version_of[i] for i in ids]))
    full_final = pd.read_parquet(root / f"full-v{len(sizes)}" / "dedup" / "clusters.parquet")
    kept = set(clusters.loc[clusters["is_kept"], "id"])
    return {
        "docs": args.docs, "near_copies_per_step": args.near_copies, "steps": steps,
        "kept_equals_precedence_dedup": kept == set(np.asarray(ids)[once.clusters["is_kept"]]),
        "kept_vs_full_rerun": {"kept": len(kept),
                               "full_rerun_kept": int(full_final["is_kept"].sum()),
                               "only_incremental": len(kept - set(full_final.loc[
                                   full_final["is_kept"], "id"])),
                               "only_full_rerun": len(set(full_final.loc[
                                   full_final["is_kept"], "id"]) - kept)},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=50_000)
    parser.add_argument("--near-copies", type=int, default=60)
    parser.add_argument("--workdir", help="where to keep the workdirs [a temporary folder]")
    run_cli(parser, run)
