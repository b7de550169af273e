"""Benchmark: the demo corpus grown once; the new version's encoder continued or from scratch.

Corpus: the documents `make demo` reads (the embedded standard-library docstrings, as the demo's
ingest keeps them), written to a JSONL file. Version 1 is a seeded `--first` share of them;
version 2 is all of them (the rest arrive). Version 1 runs the demo preset up to finetune on a
workdir; the workdir is copied; version 2 then runs on one copy with `pretrain.versions=continue`
(the default: the last version's encoder over the new training documents and a replay sample)
and on the other with `pretrain.versions=scratch` (random initialisation over the whole
training split, the full schedule). Both validate every `--eval-every` steps on the same
static masks.

Reported: each run's pretraining steps and seconds; the scratch run's final validation loss; the
first validation step at which the continued run reached it (or that it did not, and its
final loss); and both encoders' test macro-F1 (pretrained_full, pretrained_probe) on the
lineage's first test set (version 1's test documents), from finetune's predictions.

    .venv/bin/python benchmarks/grow_pretrain.py --out /tmp/grow_pretrain.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
from output import run_cli

UP_TO_FINETUNE = ["ingest", "dedup", "split", "tokenizer", "encode", "masks", "pretrain",
                  "finetune"]


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict:
    from flows.pipeline import run_pipeline
    from selfsup_model.presets import build_config
    from selfsup_model.report.metrics import macro_f1

    root = Path(args.workdir or tempfile.mkdtemp(prefix="grow_pretrain_"))
    overrides = [f"pretrain.eval_every={args.eval_every}"]

    def pipeline(corpus: Path, workdir: Path, *extra: str, stages=UP_TO_FINETUNE) -> dict:
        t0 = time.perf_counter()
        results = run_pipeline(build_config("demo", overrides=[*overrides, *extra]),
                               str(corpus), "jsonl", str(workdir), stages=stages,
                               tracking=False)
        log(f"{workdir.name}: {time.perf_counter() - t0:.0f} s")
        return {r.stage: r for r in results}

    # The demo's documents, as its ingest keeps them.
    source = root / "demo_ingest"
    pipeline_cfg = build_config("demo")
    run_pipeline(pipeline_cfg, "pydocs", workdir=str(source), stages=["ingest"], tracking=False)
    docs = pd.read_parquet(source / "ingest" / "documents.parquet", columns=["id", "text", "label"])
    order = np.random.default_rng(args.seed).permutation(len(docs))
    first = docs.iloc[np.sort(order[:round(args.first * len(docs))])]
    corpus = root / "corpus.jsonl"
    first.to_json(corpus, orient="records", lines=True, force_ascii=False)
    v1 = pipeline(corpus, root / "continue")
    shutil.copytree(root / "continue", root / "scratch")
    test1 = pd.read_parquet(root / "continue" / "split" / "assignments.parquet")
    first_test = set(test1.loc[test1["split"] == "test", "id"])

    docs.to_json(corpus, orient="records", lines=True, force_ascii=False)
    runs = {"continue": pipeline(corpus, root / "continue"),
            "scratch": pipeline(corpus, root / "scratch", "pretrain.versions=scratch")}
    out = {"documents": {"version_1": len(first), "version_2": len(docs)},
           "version_1_pretrain_steps": v1["pretrain"].counts["steps"],
           "eval_every": args.eval_every, "frozen_test_documents": len(first_test)}
    loss_key = "val/mlm_loss"
    histories = {}
    for name, results in runs.items():
        pre = results["pretrain"]
        history = json.loads((root / name / "pretrain" / "history.json").read_text())
        histories[name] = [(h["step"], h[loss_key]) for h in history if loss_key in h]
        preds = pd.read_parquet(root / name / "finetune" / "predictions.parquet")
        frozen = preds[preds["id"].isin(first_test)]
        out[name] = {
            "pretrain_steps": pre.counts["steps"], "pretrain_s": round(pre.duration_s, 1),
            "train_windows": pre.counts["train_windows"],
            "new_train_documents": pre.counts.get("new_train_documents"),
            "replayed_documents": pre.counts.get("replayed_documents"),
            "final_val_loss": round(histories[name][-1][1], 4),
            "frozen_test_macro_f1": {
                f"{method}@{fraction:g}": round(macro_f1(g["label"], g["prediction"]), 4)
                for (method, fraction), g in frozen.groupby(["method", "fraction"])
                if method in ("pretrained_full", "pretrained_probe")}}
    target = histories["scratch"][-1][1]
    reached = next((step for step, loss in histories["continue"] if loss <= target), None)
    out["continued_steps_to_scratch_val_loss"] = reached
    out["continued_history"] = [(s, round(v, 4)) for s, v in histories["continue"]]
    out["scratch_history"] = [(s, round(v, 4)) for s, v in histories["scratch"]]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--first", type=float, default=0.9,
                        help="share of the demo's documents in version 1 (default 0.9)")
    parser.add_argument("--eval-every", type=int, default=50,
                        help="validation every this many pretraining steps (default 50)")
    parser.add_argument("--workdir", help="where the runs go (default: a temporary folder)")
    run_cli(parser, run)


if __name__ == "__main__":
    main()
