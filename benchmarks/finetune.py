"""Fine-tuning with and without XLA: seconds per classifier run under the demo's protocol.

    .venv/bin/python benchmarks/finetune.py --workdir data/runs/default
    .venv/bin/python benchmarks/finetune.py --workdir data/runs/default --fraction 0.25 --rounds 3

Reads a finished run's encode and pretrain outputs and trains the pretrained encoder as a
classifier (mode ``full``, or ``scratch``: the random_init baseline) at one label fraction, seed
and learning rate, exactly as the pipeline's fine-tuning stage does, once per `finetune.jit`
setting per round, interleaved (off, on, off, on, ...). Each setting keeps its own compiled
trainers across rounds, as a stage does across its runs, so round 1 pays the compilation and
later rounds show the steady state. A run's seconds include its validation checks. Test data
is never read.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from selfsup_model.nn.saving import load_keras_model
from selfsup_model.presets import build_config
from selfsup_model.transfer.finetuning import StageTrainers, train_classifier
from selfsup_model.transfer.protocol import label_subsets, load_labelled

SETTINGS = ("off", "on")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, help="a run with encode and pretrain done")
    p.add_argument("--fraction", type=float, default=0.05, help="label fraction")
    p.add_argument("--mode", choices=("full", "scratch"), default="full")
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--encoder-dropout", type=float, default=None,
                   help="finetune.encoder_dropout (default: the demo's, 0)")
    args = p.parse_args(argv)
    wd = Path(args.workdir)
    base = build_config("demo").finetune.model_copy(update={"fractions": (args.fraction,)})
    if args.encoder_dropout is not None:
        base = base.model_copy(update={"encoder_dropout": args.encoder_dropout})
    data = load_labelled(wd / "encode", base.max_len)
    if data is None:
        raise SystemExit(f"{wd} has nothing to classify")
    ((_, subset),) = label_subsets(data, base)
    train = (data.splits["train"].windows[subset], data.y("train")[subset])
    y_val = data.y("val")
    val = (data.splits["val"].windows[y_val >= 0], y_val[y_val >= 0])

    def encoder():
        return load_keras_model(wd / "pretrain" / "encoder.keras")

    trainers = {jit: StageTrainers() for jit in SETTINGS}
    seconds: dict[str, list[float]] = {jit: [] for jit in SETTINGS}
    print(f"# {args.mode}, fraction {args.fraction:g} ({len(subset)} documents), "
          f"lr {args.learning_rate:g}, seed 0, encoder dropout {base.encoder_dropout:g}")
    print("round  jit  updates  run_s  ms/update  val_macro_f1")
    for rnd in range(1, args.rounds + 1):
        for jit in SETTINGS:
            cfg = base.model_copy(update={"jit": jit})
            res = train_classifier(encoder, train, val, len(data.classes), args.mode, cfg, 0,
                                   args.learning_rate, trainers=trainers[jit])
            seconds[jit].append(res.train_time_s)
            print(f"{rnd:5d}  {jit:3s}  {res.updates_run:7d}  {res.train_time_s:5.1f}  "
                  f"{1000 * res.train_time_s / res.updates_run:9.1f}  {res.val_macro_f1:.4f}",
                  flush=True)
    first = seconds["off"][0] / seconds["on"][0]
    print(f"# round 1 (compiling): XLA {first:.2f}x the speed of no XLA")
    if args.rounds > 1:
        steady = statistics.median(seconds["off"][1:]) / statistics.median(seconds["on"][1:])
        print(f"# rounds 2-{args.rounds} (median): XLA {steady:.2f}x the speed of no XLA")
    return 0


if __name__ == "__main__":
    sys.exit(main())
