"""Which small-budget pretraining recipe lowers validation masked-LM loss most, at equal wall time.

    .venv/bin/python benchmarks/pretrain_recipe.py --workdir data/runs/default --seconds 90

Reads a workdir whose ingest, split and tokenizer stages are done (after `make demo`, or
`selfsup run --to tokenizer`), encodes the training split at each setting's window length,
and pretrains each setting of the demo model size for the same wall time: the number of
steps comes from a short timed calibration run, so the learning-rate schedule fits the budget.
The yardstick is the same for every setting: static validation masks (seed 1234, 15%) over
the validation split encoded at `--eval-len` tokens, the length the demo classifier reads.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from selfsup_model.config import EncodeConfig, MaskingConfig, ModelConfig, PretrainConfig
from selfsup_model.corpus.splitting import documents_in_split
from selfsup_model.pretraining.loop import pretrain
from selfsup_model.text.encoding import encode_split
from selfsup_model.text.masking import make_static_masks
from selfsup_model.text.tokenization import load_tokenizer

DEMO_MODEL = {"hidden": 128, "layers": 2, "heads": 4, "ff": 512}
BASE = {"norm": "post", "dropout": 0.1, "decay": "cosine", "lr": 1e-3, "len": 128, "batch": 32,
        "select": 0.15}
# Each setting changes the previous best guess by one thing, so a gain can be attributed.
SETTINGS = {
    "before (post-LN, dropout 0.1, cosine, 1e-3, len 128)": {},
    "pre-LN": {"norm": "pre"},
    "pre-LN, dropout 0": {"norm": "pre", "dropout": 0.0},
    "pre-LN, dropout 0, linear decay": {"norm": "pre", "dropout": 0.0, "decay": "linear"},
    "... + peak LR 2e-3": {"norm": "pre", "dropout": 0.0, "decay": "linear", "lr": 2e-3},
    "... + windows of 64, batch 64": {"norm": "pre", "dropout": 0.0, "decay": "linear",
                                      "lr": 2e-3, "len": 64, "batch": 64},
    "... + peak LR 3e-3 (len 64)": {"norm": "pre", "dropout": 0.0, "decay": "linear", "lr": 3e-3,
                                    "len": 64, "batch": 64},
    "... + selection rate 0.25 (len 64, 2e-3)": {"norm": "pre", "dropout": 0.0, "decay": "linear",
                                                 "lr": 2e-3, "len": 64, "batch": 64,
                                                 "select": 0.25},
    "... + peak LR 1e-3 (len 64)": {"norm": "pre", "dropout": 0.0, "decay": "linear", "lr": 1e-3,
                                    "len": 64, "batch": 64},
}


def encode(tok, texts: list[str], max_len: int) -> np.ndarray:
    # Windows per document scale with their length, so every setting sees about as much text.
    cfg = EncodeConfig(max_len=max_len, overlap=max_len // 4, max_windows_per_doc=512 // max_len)
    return encode_split(tok, texts, cfg).windows


def run_setting(name: str, overrides: dict, windows: dict[int, np.ndarray], val_masks: dict,
                vocab: int, seconds: float) -> dict:
    s = {**BASE, **overrides}
    model = ModelConfig(**DEMO_MODEL, norm=s["norm"], dropout=s["dropout"])
    width = max(2, round(s["select"] * s["len"] * 1.4))  # room for the selection's upper tail
    masks = MaskingConfig(select_rate=s["select"], max_predictions=width)
    train = windows[s["len"]]

    def cfg(steps: int) -> PretrainConfig:
        return PretrainConfig(batch_size=s["batch"], steps=steps, learning_rate=s["lr"],
                              warmup_steps=max(1, steps // 15), decay=s["decay"], log_every=steps,
                              eval_every=steps, checkpoint_every=steps, jit="on", seed=42)

    with tempfile.TemporaryDirectory() as tmp:
        calib = pretrain(train, val_masks, vocab, model, cfg(30), masks, Path(tmp) / "c",
                         progress=False)
    step_s = s["batch"] * s["len"] / calib.tokens_per_s
    steps = max(30, int(seconds / step_s))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = pretrain(train, val_masks, vocab, model, cfg(steps), masks, Path(tmp) / "r",
                          progress=False)
    return {"setting": name, "steps": steps, "seconds": round(time.perf_counter() - t0, 1),
            "tokens_per_s": round(result.tokens_per_s),
            "val_mlm_loss": result.val_metrics["val/mlm_loss"],
            "val_mlm_accuracy": result.val_metrics["val/mlm_accuracy"],
            "unigram_loss": result.unigram_baseline_loss}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="data/runs/default")
    parser.add_argument("--seconds", type=float, default=90.0, help="training time per setting")
    parser.add_argument("--eval-len", type=int, default=64)
    parser.add_argument("--only", help="comma-separated setting indices (0-based)")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args(argv)
    wd = Path(args.workdir)
    tok = load_tokenizer(wd / "tokenizer" / "tokenizer.json")
    docs = pd.read_parquet(wd / "ingest" / "documents.parquet", columns=["id", "text"])
    assign = pd.read_parquet(wd / "split" / "assignments.parquet", columns=["id", "split"])
    train_texts = documents_in_split(docs, assign, "train")["text"].tolist()
    val_texts = documents_in_split(docs, assign, "val")["text"].tolist()
    vocab = tok.get_vocab_size()
    lengths = sorted({BASE["len"], *(o.get("len", BASE["len"]) for o in SETTINGS.values())})
    windows = {n: encode(tok, train_texts, n) for n in lengths}
    yardstick = make_static_masks(encode(tok, val_texts, args.eval_len),
                                  MaskingConfig(max_predictions=12), vocab, seed=1234)
    chosen = list(SETTINGS.items())
    if args.only:
        chosen = [chosen[int(i)] for i in args.only.split(",")]
    rows = []
    print(f"{'setting':<45} {'steps':>6} {'tok/s':>7} {'val MLM loss':>12} {'acc':>6}")
    for name, overrides in chosen:
        row = run_setting(name, overrides, windows, yardstick, vocab, args.seconds)
        rows.append(row)
        print(f"{name:<45} {row['steps']:>6} {row['tokens_per_s']:>7} {row['val_mlm_loss']:>12.4f} "
              f"{row['val_mlm_accuracy']:>6.3f}", flush=True)
    print(f"unigram baseline on the yardstick: {rows[0]['unigram_loss']:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
