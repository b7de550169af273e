"""Which logistic-regression solver the TF-IDF baseline should use: time and validation macro-F1.

    .venv/bin/python benchmarks/tfidf.py --workdir data/runs/default
    .venv/bin/python benchmarks/tfidf.py --workdir data/runs/default --fractions 0.25,1 --c 1,10

Reads a finished run's documents, split and encode outputs, takes the same label subsets the
pipeline trains on, fits the TF-IDF vectoriser (word 1-2-grams, sublinear tf) on each subset,
then fits every candidate solver at every C, interleaved, and prints the fit time and the
validation macro-F1. lbfgs, newton-cg and saga minimise the same multinomial objective, so at
convergence they agree; one-vs-rest liblinear fits a different model and is shown for
reference. Test data is never read.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import pandas as pd
from sklearn.exceptions import ConvergenceWarning
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.multiclass import OneVsRestClassifier

from selfsup_model.presets import build_config
from selfsup_model.report.metrics import macro_f1
from selfsup_model.transfer.protocol import label_subsets, load_labelled

CANDIDATES = {
    "lbfgs": lambda c: LogisticRegression(C=c, max_iter=2000),
    "newton-cg": lambda c: LogisticRegression(C=c, solver="newton-cg", max_iter=1000),
    "saga": lambda c: LogisticRegression(C=c, solver="saga", max_iter=1000),
    "ovr-liblinear": lambda c: OneVsRestClassifier(LogisticRegression(C=c, solver="liblinear")),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, help="a run with ingest, split and encode done")
    p.add_argument("--fractions", default="0.05,0.25,1", help="label fractions")
    p.add_argument("--c", default="1,10", help="C values")
    p.add_argument("--solvers", default=",".join(CANDIDATES), help="candidates to time")
    args = p.parse_args(argv)
    wd = Path(args.workdir)
    fractions = tuple(float(f) for f in args.fractions.split(","))
    cfg = build_config("demo").finetune.model_copy(update={"fractions": fractions})
    data = load_labelled(wd / "encode", cfg.max_len)
    texts = (pd.read_parquet(wd / "ingest" / "documents.parquet", columns=["id", "text"])
             .set_index("id")["text"])
    train, val = data.splits["train"], data.splits["val"]
    val_texts = texts.loc[val.ids].tolist()
    warnings.filterwarnings("ignore", category=ConvergenceWarning)
    print("fraction  n_train  features  solver          C      fit_s  val_macro_f1")
    totals: dict[str, float] = {}
    for fraction, subset in label_subsets(data, cfg):
        train_texts = texts.loc[train.ids[subset]].tolist()
        vectorizer = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True).fit(train_texts)
        x_train, x_val = vectorizer.transform(train_texts), vectorizer.transform(val_texts)
        for c in (float(v) for v in args.c.split(",")):
            for name in args.solvers.split(","):
                start = time.perf_counter()
                clf = CANDIDATES[name](c).fit(x_train, train.labels[subset])
                seconds = time.perf_counter() - start
                totals[name] = totals.get(name, 0.0) + seconds
                f1 = macro_f1(val.labels, clf.predict(x_val))
                print(f"{fraction:8g}  {len(subset):7d}  {x_train.shape[1]:8d}  {name:14s} "
                      f"{c:4g}  {seconds:8.2f}  {f1:.4f}", flush=True)
    base = totals.get("lbfgs")
    for name, seconds in totals.items():
        ratio = f"  ({base / seconds:.1f}x faster than lbfgs)" if base and name != "lbfgs" else ""
        print(f"# {name}: {seconds:.1f} s in all{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
