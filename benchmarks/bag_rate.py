"""The bag of embeddings' rate multiplier: validation macro-F1 at the grid's rates, per multiplier.

    .venv/bin/python benchmarks/bag_rate.py --workdir data/runs/default
    .venv/bin/python benchmarks/bag_rate.py --workdir data/runs/default --multipliers 1 10 30 100

Reads a finished run's encode outputs and trains the bag-of-embeddings baseline as the
baseline stage does (the demo's fine-tuning protocol: its update budget, early stopping and
seed 0; what `finetune.read_windows` says a classifier reads) at every label fraction of the
demo and every learning rate of its shared grid, once per `baseline.bag_rate_multiplier`. Its
table rows move only when their token is in a batch, so at the rates chosen for the
Transformers the bag barely learns in its budget; the multiplier that gives the best
validation macro-F1 is the fair default. Test data is never read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from selfsup_model.presets import build_config
from selfsup_model.text.tokenization import load_tokenizer
from selfsup_model.transfer.bag_of_embeddings import bag_of_embeddings_factory
from selfsup_model.transfer.finetuning import StageTrainers, train_classifier
from selfsup_model.transfer.protocol import label_subsets, load_labelled


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, help="a run with encode done")
    p.add_argument("--multipliers", type=float, nargs="+", default=[1.0, 10.0, 30.0])
    p.add_argument("--learning-rates", type=float, nargs="+", default=None,
                   help="default: the demo's finetune.learning_rates")
    args = p.parse_args(argv)
    wd = Path(args.workdir)
    config = build_config("demo")
    cfg, dim = config.finetune, config.baseline.bag_dim
    rates = args.learning_rates or list(cfg.learning_rates)
    data = load_labelled(wd / "encode", cfg.max_len)
    if data is None:
        raise SystemExit(f"{wd} has nothing to classify")
    vocab = load_tokenizer(wd / "tokenizer" / "tokenizer.json").get_vocab_size()
    every = cfg.read_windows == "all"  # what the baseline stage reads
    y_val = data.y("val")
    val_docs = np.flatnonzero(y_val >= 0)
    val_windows, val_owner = data.splits["val"].windows_of(val_docs, every)
    val = (val_windows, y_val[val_docs])
    print("fraction  multiplier  learning_rate  updates  best_update  val_macro_f1")
    best: dict[float, tuple[float, float, float]] = {}
    for fraction, subset in label_subsets(data, cfg):
        windows, owner = data.splits["train"].windows_of(subset, every)
        train = (windows, data.y("train")[subset][owner])
        for multiplier in args.multipliers:
            factory = bag_of_embeddings_factory(vocab, data.window_len, dim, multiplier)
            trainers = StageTrainers()
            for rate in rates:
                res = train_classifier(factory, train, val, len(data.classes), "scratch", cfg, 0,
                                       rate, trainers=trainers, budget_documents=len(subset),
                                       val_owner=val_owner)
                print(f"{fraction:8g}  {multiplier:10g}  {rate:13g}  {res.updates_run:7d}  "
                      f"{res.best_update:11d}  {res.val_macro_f1:.4f}", flush=True)
                if res.val_macro_f1 > best.get(fraction, (-1.0,))[0]:
                    best[fraction] = (res.val_macro_f1, multiplier, rate)
    for fraction, (f1, multiplier, rate) in best.items():
        print(f"# fraction {fraction:g}: best multiplier {multiplier:g} at rate {rate:g} "
              f"(validation macro-F1 {f1:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
