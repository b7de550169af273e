"""Length bucketing: real (non-[PAD]) tokens/s and validation MLM loss, buckets 1 vs 2/4/8.

    .venv/bin/python benchmarks/bucketing.py --workdir /tmp/demo_base --rounds 8
    .venv/bin/python benchmarks/bucketing.py --workdir /tmp/demo_base --steps 150 --seconds 120

Trains the demo preset's model with the real pretrain stage code (`pretrain()`, the preset's
batch, learning rate, jit) on a workdir's encoded training windows and scores its static
validation masks (the masks stage's yardstick, evaluated at full length); without a workdir,
on synthetic windows with the corpus's length mix (benchmarks/synthetic.py).

Interleaved (`--rounds`, robust to a shared machine): one compiled model per setting, every
shape compiled first (timed apart), then rounds of `--round-steps` train steps per setting in
turn on pre-built batches, so load that comes and goes hits every setting alike.
Phase 1 (`--steps`): the whole `pretrain()` per setting; positions/s and real tokens/s
exclude each shape's first (compiling) step, `wall_s` is the whole call (compiles, evaluation
and saving included). Phase 2 (`--seconds`, with `--steps`): each setting trains for that
many seconds of steps, its step count taken from its phase-1 step time, so every setting
gets the same time and a schedule that fits it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import keras
import numpy as np
from synthetic import synthetic_windows

from selfsup_model.nn.model import build_backbone, build_pretraining_model
from selfsup_model.presets import build_config
from selfsup_model.pretraining.batches import PretrainBatches
from selfsup_model.pretraining.loop import build_optimizer, pretrain
from selfsup_model.text.masking import load_masks, make_static_masks
from selfsup_model.text.tokenization import load_tokenizer


def load_inputs(workdir: str | None, cfg):
    if workdir and (Path(workdir) / "encode" / "train_windows.npy").exists():
        wd = Path(workdir)
        windows = np.load(wd / "encode" / "train_windows.npy", mmap_mode="r")
        vocab = load_tokenizer(wd / "tokenizer" / "tokenizer.json").get_vocab_size()
        return windows, load_masks(wd / "masks" / "val_masks.npz"), vocab, str(wd)
    rng, vocab, length = np.random.default_rng(0), cfg.tokenizer.vocab_size, cfg.encode.max_len
    val = make_static_masks(synthetic_windows(rng, 2000, length, vocab), cfg.masks, vocab, seed=1)
    return synthetic_windows(rng, 30000, length, vocab), val, vocab, "synthetic"


def run(windows, val, vocab, cfg, buckets: int, steps: int) -> dict:
    p = cfg.pretrain.model_copy(update={
        "length_buckets": buckets, "steps": steps, "warmup_steps": max(1, steps // 20),
        "log_every": steps, "eval_every": steps, "checkpoint_every": steps})
    data = PretrainBatches(windows, objective="mlm", batch_size=p.batch_size, total_steps=steps,
                           seed=p.seed, masking=cfg.masks, vocab_size=vocab, length_buckets=buckets)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        r = pretrain(windows, val, vocab, cfg.model, p, cfg.masks, tmp, progress=False)
    wall = time.perf_counter() - t0
    return {"buckets": buckets, "shapes": len(data.shapes()), "steps": steps,
            "positions_per_s": round(r.tokens_per_s),
            "real_tokens_per_s": round(r.real_tokens_per_s),
            "real_share": round(r.real_tokens_seen / r.tokens_seen, 4),
            "step_s": r.tokens_seen / steps / r.tokens_per_s, "wall_s": round(wall, 1),
            "val_mlm_loss": round(r.val_metrics["val/mlm_loss"], 4)}


def timed_rounds(runs: list[dict], rounds: int, per_round: int) -> None:
    """`rounds` rounds of `per_round` train steps of each run's `model` on its `batches`, the
    runs in turn, so load that comes and goes hits each alike; adds to each run's `seconds`."""
    for r in range(rounds):
        for run_ in runs:
            t0 = time.perf_counter()
            for b in run_["batches"][r * per_round:(r + 1) * per_round]:
                run_["model"].train_on_batch(*b)
            run_["seconds"] += time.perf_counter() - t0


def interleaved(windows, vocab, cfg, settings: list[int], rounds: int, per_round: int) -> list:
    p, steps = cfg.pretrain, rounds * per_round
    runs = []
    for k in settings:
        data = PretrainBatches(windows, objective="mlm", batch_size=p.batch_size,
                               total_steps=steps, seed=p.seed, masking=cfg.masks,
                               vocab_size=vocab, length_buckets=k)
        keras.utils.set_random_seed(p.seed)
        model = build_pretraining_model(build_backbone(vocab, windows.shape[1], cfg.model),
                                        "mlm", cfg.model)
        model.compile(optimizer=build_optimizer(p, steps), jit_compile=True)
        t0, firsts = time.perf_counter(), {}
        for s in range(data.batches_per_pass):  # one step of every shape: tracing + XLA
            shape = data.step_tokens(s)[:2]
            if shape not in firsts:
                firsts[shape] = data.batch_for_step(s)
                model.train_on_batch(*firsts[shape])
        batches = [data.batch_for_step(s) for s in range(steps)]
        runs.append({"buckets": k, "shapes": len(firsts), "model": model, "batches": batches,
                     "tokens": [data.step_tokens(s) for s in range(steps)],
                     "compile_s": time.perf_counter() - t0, "seconds": 0.0})
    timed_rounds(runs, rounds, per_round)
    rows = []
    for run_ in runs:
        positions = sum(t.positions for t in run_["tokens"])
        real = sum(t.real for t in run_["tokens"])
        rows.append({"buckets": run_["buckets"], "shapes": run_["shapes"],
                     "compile_s": round(run_["compile_s"], 1), "steps": steps,
                     "positions_per_s": round(positions / run_["seconds"]),
                     "real_tokens_per_s": round(real / run_["seconds"]),
                     "real_share": round(real / positions, 4)})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", help="a run whose encode, tokenizer and masks stages are done")
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--buckets", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=0, help="interleaved rounds")
    parser.add_argument("--round-steps", type=int, default=10)
    parser.add_argument("--steps", type=int, default=0, help="phase 1 steps per setting")
    parser.add_argument("--seconds", type=float, default=0.0, help="phase 2 training time")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args(argv)
    cfg = build_config(args.preset)
    windows, val, vocab, source = load_inputs(args.workdir, cfg)
    settings = [int(k) for k in args.buckets.split(",")]
    real = np.count_nonzero(np.asarray(windows) != 0) / windows.size
    print(f"{source}: {windows.shape[0]} windows x {windows.shape[1]}, real share {real:.3f}")
    out = {}
    if args.rounds:
        out["interleaved"] = interleaved(windows, vocab, cfg, settings, args.rounds,
                                         args.round_steps)
    if args.steps:
        out["pretrain"] = [run(windows, val, vocab, cfg, k, args.steps) for k in settings]
    for name, rows in out.items():
        for row in rows:
            row["real_tokens_per_s_ratio"] = round(row["real_tokens_per_s"]
                                                   / rows[0]["real_tokens_per_s"], 3)
            print(name, json.dumps(row), flush=True)
    if args.seconds > 0 and args.steps:
        rows = out["pretrain"]
        for row in rows:
            steps = max(30, int(args.seconds / row["step_s"]))
            timed = run(windows, val, vocab, cfg, row["buckets"], steps)
            row["equal_time"] = {k: timed[k] for k in ("steps", "wall_s", "val_mlm_loss")}
            print(json.dumps({"buckets": row["buckets"], **row["equal_time"]}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
