"""Pretraining settings at equal wall time, judged on validation only: the pretraining loss and
the linear probe's and full fine-tuning's validation macro-F1.

    .venv/bin/python benchmarks/objective_sweep.py --base data/runs/default --out /tmp/sweep \
        --seconds 240 --settings mlm,rtd,rtd-contrastive --json /tmp/sweep.json

`--base` is a workdir whose stages up to masks are done (after `make demo`). Each setting gets
its own workdir under `--out`, a copy of the base's stages up to masks (a setting that changes
the tokenizer or the masks reruns those stages there), and runs the pipeline's own stages with
the demo preset and the setting's overrides, without tracking:

1. a calibration run of `--calibrate` pretraining steps, whose timed steps (the first step of
   each batch shape, which compiles, is left out) give the setting's seconds per step;
2. pretraining for as many steps as fit `--seconds` at that speed, then the finetune stage
   (the linear probe and full fine-tuning at the preset's label fractions, its rates and
   seeds).

Every setting trains for the same time, so a faster objective gets more steps. Test labels are
never read: the table is validation numbers only (the finetune stage scores test too, but this
script does not read it).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("ingest", "dedup", "split", "tokenizer", "encode", "masks")
SETTINGS: dict[str, dict[str, str]] = {
    "mlm": {},  # the demo's: masked-LM with the same-document contrastive term at 0.1
    "mlm-no-contrastive": {"pretrain.contrastive_weight": "0"},
    "rtd": {"pretrain.objective": "rtd", "pretrain.contrastive_weight": "0"},
    "rtd-contrastive": {"pretrain.objective": "rtd"},
    "vocab-8k": {"tokenizer.vocab_size": "8192"},
    "vocab-16k": {"tokenizer.vocab_size": "16384"},
    "rtd-vocab-8k": {"pretrain.objective": "rtd", "pretrain.contrastive_weight": "0",
                     "tokenizer.vocab_size": "8192"},
    "select-0.25": {"masks.select_rate": "0.25", "masks.max_predictions": "18"},
    "mlm-cooc": {"pretrain.embedding_init": "cooccurrence"},  # the demo's, counted embeddings
    "mlm-cooc-no-contrastive": {"pretrain.embedding_init": "cooccurrence",
                                "pretrain.contrastive_weight": "0"},
    "rtd-select-0.25": {"pretrain.objective": "rtd", "pretrain.contrastive_weight": "0",
                        "masks.select_rate": "0.25", "masks.max_predictions": "18"},
}


def selfsup(workdir: Path, overrides: dict[str, str], *args: str) -> float:
    """Run `selfsup run` on `workdir` with the demo preset; its wall time in seconds."""
    cmd = [sys.executable, "-m", "flows.cli", "run", "--preset", "demo", "--workdir",
           str(workdir), "--no-tracking", *args]
    for key, value in overrides.items():
        cmd += ["--set", f"{key}={value}"]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def manifest(workdir: Path, stage: str) -> dict:
    return json.loads((workdir / stage / "manifest.json").read_text())


def seconds_per_step(workdir: Path) -> float:
    """From a finished pretrain stage: input positions per step over timed positions/s."""
    counts = manifest(workdir, "pretrain")["counts"]
    history = json.loads((workdir / "pretrain" / "history.json").read_text())
    speed = [h["train/tokens_per_s"] for h in history if "train/tokens_per_s" in h][-1]
    return counts["tokens_seen"] / counts["steps"] / speed


def run_setting(name: str, base: Path, out: Path, seconds: float, calibrate: int) -> dict:
    overrides = SETTINGS[name]
    workdir = out / name
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    for stage in COPIED:
        shutil.copytree(base / stage, workdir / stage)
    shutil.copy(base / "run_settings.json", workdir / "run_settings.json")
    calibration = {**overrides, "pretrain.steps": str(calibrate),
                   "pretrain.eval_every": str(calibrate), "pretrain.log_every": "10",
                   "pretrain.warmup_steps": "10"}
    selfsup(workdir, calibration, "--to", "pretrain")
    per_step = seconds_per_step(workdir)
    steps = max(1, math.floor(seconds / per_step))
    shutil.rmtree(workdir / "pretrain")
    warmup = max(1, round(100 * steps / 2400))  # the demo's warm-up share of its schedule
    wall = selfsup(workdir, {**overrides, "pretrain.steps": str(steps),
                             "pretrain.warmup_steps": str(warmup),
                             "pretrain.eval_every": str(steps)}, "--to", "finetune")
    pre = manifest(workdir, "pretrain")
    results = json.loads((workdir / "finetune" / "results.json").read_text())["results"]
    row = {"setting": name, "overrides": overrides, "seconds_per_step": round(per_step, 4),
           "steps": steps, "pretrain_s": pre["duration_s"],
           "finetune_s": manifest(workdir, "finetune")["duration_s"], "wall_s": round(wall, 1),
           "val": {k: round(v, 4) for k, v in pre["metrics"].items() if k.startswith("val/")}}
    for r in results:
        row[f"{r['method']}@{r['fraction']:g}"] = round(r["val_macro_f1"], 4)
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="a workdir with every stage up to masks done")
    p.add_argument("--out", required=True, help="where each setting's workdir goes")
    p.add_argument("--seconds", type=float, default=240.0,
                   help="pretraining time per setting (timed steps)")
    p.add_argument("--calibrate", type=int, default=80, help="steps of the calibration run")
    p.add_argument("--settings", default="mlm,rtd,rtd-contrastive",
                   help=f"comma-separated, of: {', '.join(SETTINGS)}")
    p.add_argument("--json", help="append each row here as a JSON line too")
    args = p.parse_args(argv)
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        p.error(f"unknown settings {unknown}; choose from {list(SETTINGS)}")
    for name in names:
        row = run_setting(name, Path(args.base), Path(args.out), args.seconds, args.calibrate)
        if args.json:
            with open(args.json, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
