"""How wide the TF-IDF baseline's grid must be: every point's validation macro-F1 and the time.

    .venv/bin/python benchmarks/tfidf_grid.py --workdir data/runs/default \
        --c 0.1,1,10,100,1000 --ngram 1,2,3 --features word,char,word+char --sublinear true,false

Reads a finished run's documents, split and encode outputs, takes the label subsets the
pipeline trains on (the demo preset's fractions unless `--fractions`), and runs the baseline's
own search (`baselines.tfidf_logreg`) over the grid given: the vectoriser's settings x C. It
prints each point's validation macro-F1, then what was selected, whether it sits at an end of a
numeric grid, and the search's time. Test labels are never read (nothing is predicted on test).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from selfsup_model.config import BaselineConfig
from selfsup_model.presets import build_config
from selfsup_model.transfer.protocol import label_subsets, load_labelled


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, help="a run with ingest, split and encode done")
    p.add_argument("--fractions", help="label fractions [default: the demo preset's]")
    p.add_argument("--c", default="0.1,1,10,100,1000")
    p.add_argument("--ngram", default="1,2,3", help="word n-gram orders")
    p.add_argument("--features", default="word,char,word+char")
    p.add_argument("--sublinear", default="true,false")
    args = p.parse_args(argv)
    wd = Path(args.workdir)
    cfg = build_config("demo").finetune
    if args.fractions:
        cfg = cfg.model_copy(update={"fractions": tuple(map(float, args.fractions.split(",")))})
    grid = BaselineConfig(tfidf_c=tuple(map(float, args.c.split(","))),
                          tfidf_ngram_max=tuple(map(int, args.ngram.split(","))),
                          tfidf_features=tuple(args.features.split(",")),
                          tfidf_sublinear=tuple(v == "true" for v in args.sublinear.split(",")))
    data = load_labelled(wd / "encode", cfg.max_len)
    texts = (pd.read_parquet(wd / "ingest" / "documents.parquet", columns=["id", "text"])
             .set_index("id")["text"])
    train, val = data.splits["train"], data.splits["val"]
    val_texts = texts.loc[val.ids].tolist()
    from selfsup_model.transfer.baselines import tfidf_logreg

    for fraction, subset in label_subsets(data, cfg):
        res = tfidf_logreg(texts.loc[train.ids[subset]].tolist(), train.labels[subset],
                           val_texts, val.labels, {}, grid)
        print(f"## fraction {fraction:g}: {len(subset)} training documents, "
              f"{res.fit_time_s:.1f} s for {len(res.grid)} points")
        for g in res.grid:
            print("  " + ", ".join(f"{k}={v}" for k, v in g.items()))
        ends = [f"{k}={res.params[k]:g} ({'top' if res.params[k] == max(values) else 'bottom'})"
                for k, values in (("C", grid.tfidf_c), ("ngram_max", grid.tfidf_ngram_max))
                if k in res.params and len(values) >= 3
                and res.params[k] in (min(values), max(values))]
        print(f"  selected: {res.params}, val macro-F1 {res.val_macro_f1:.4f}; at an end: "
              f"{', '.join(ends) or 'none'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
