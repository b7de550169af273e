"""Paired batches for the contrastive term: padding and train-step time, partners drawn per
batch (the first version) against pairs drawn per pass and bucketed by their longer window.

    .venv/bin/python benchmarks/pairing.py --workdir data/runs/default --rounds 6

Reads a workdir's encoded training windows and document offsets. Counts, from the window
lengths alone, the real (non-[PAD]) share of the input positions over `--passes` passes for
three layouts of the demo preset's batches: unpaired (the reference), paired with each batch's
partners drawn after its anchors were bucketed (a batch is trimmed to its longest partner), and
paired per pass (the shipped `PretrainBatches`). Then, interleaved like benchmarks/bucketing.py
(every shape compiled first and timed apart; rounds of `--round-steps` steps per setting in
turn, so load that comes and goes hits each alike), the demo model with the contrastive term
trains on each paired layout's batches: seconds per step and real tokens per second, as a
ratio to the first paired layout, in one run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import keras
import numpy as np
from bucketing import timed_rounds

from selfsup_model.nn.model import build_backbone, build_pretraining_model
from selfsup_model.presets import build_config
from selfsup_model.pretraining.batches import _PAIR_STREAM, PretrainBatches
from selfsup_model.pretraining.loop import build_optimizer
from selfsup_model.text.tokenization import load_tokenizer


class PartnersPerBatch(PretrainBatches):
    """The first paired layout: anchors bucketed alone (as unpaired batches, B/2 rows), then
    each step's partners drawn from a Generator seeded by the step, and the batch trimmed to
    the longest bucket either half needs."""

    def __init__(self, windows, **kw):
        super().__init__(windows, **kw)
        self.pairs = False  # lay out the anchors alone; `_rows` stays B/2

    def window_indices(self, step: int) -> np.ndarray:
        anchors, _ = self._anchors(step)
        first, span = self._first[anchors], self._span[anchors]
        rng = np.random.default_rng([self.seed, _PAIR_STREAM, step])
        shift = 1 + rng.integers(0, np.maximum(span - 1, 1))
        partners = np.where(span > 1, first + (anchors - first + shift) % span, anchors)
        return np.stack([anchors, partners], axis=1).reshape(-1)

    def step_length(self, step: int) -> int:
        return int(self.bucket_lengths[self.bucket_of[self.window_indices(step)].max()])


def layouts(windows, offsets, vocab, cfg, steps: int) -> dict[str, PretrainBatches]:
    p = cfg.pretrain
    kw = {"objective": "mlm", "batch_size": p.batch_size, "total_steps": steps, "seed": p.seed,
          "masking": cfg.masks, "vocab_size": vocab, "length_buckets": p.length_buckets}
    return {"unpaired": PretrainBatches(windows, **kw),
            "partners per batch": PartnersPerBatch(windows, pairs=True, doc_offsets=offsets,
                                                   **kw),
            "pairs per pass": PretrainBatches(windows, pairs=True, doc_offsets=offsets, **kw)}


def padding(data: PretrainBatches, steps: int) -> dict:
    tokens = [data.step_tokens(s) for s in range(steps)]
    positions, real = sum(t.positions for t in tokens), sum(t.real for t in tokens)
    return {"steps": steps, "positions": positions, "real": real,
            "real_share": round(real / positions, 4),
            "shapes": len({(t.rows, t.length) for t in tokens})}


def interleaved(data: dict[str, PretrainBatches], vocab, cfg, rounds: int, per_round: int):
    p, steps, runs = cfg.pretrain, rounds * per_round, []
    for name, batches in data.items():
        keras.utils.set_random_seed(p.seed)
        model = build_pretraining_model(
            build_backbone(vocab, batches.max_len, cfg.model), "mlm", cfg.model,
            contrastive_weight=p.contrastive_weight,
            contrastive_temperature=p.contrastive_temperature)
        model.compile(optimizer=build_optimizer(p, steps), jit_compile=True)
        t0, firsts = time.perf_counter(), {}
        for s in range(steps):  # one step of every shape the timed steps use
            shape = batches.step_tokens(s)[:2]
            if shape not in firsts:
                firsts[shape] = True
                model.train_on_batch(*batches.batch_for_step(s))
        runs.append({"name": name, "model": model, "compile_s": time.perf_counter() - t0,
                     "batches": [batches.batch_for_step(s) for s in range(steps)],
                     "tokens": [batches.step_tokens(s) for s in range(steps)], "seconds": 0.0})
    timed_rounds(runs, rounds, per_round)
    rows = []
    for run_ in runs:
        real = sum(t.real for t in run_["tokens"])
        rows.append({"layout": run_["name"], "steps": steps,
                     "compile_s": round(run_["compile_s"], 1),
                     "step_ms": round(1000 * run_["seconds"] / steps, 1),
                     "real_tokens_per_s": round(real / run_["seconds"])})
    for row in rows:
        row["step_time_ratio"] = round(row["step_ms"] / rows[0]["step_ms"], 3)
        row["real_tokens_per_s_ratio"] = round(row["real_tokens_per_s"]
                                               / rows[0]["real_tokens_per_s"], 3)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True,
                        help="a run whose encode and tokenizer stages are done")
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--passes", type=int, default=3, help="passes to count padding over")
    parser.add_argument("--rounds", type=int, default=0, help="interleaved rounds (0: none)")
    parser.add_argument("--round-steps", type=int, default=20)
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args(argv)
    cfg = build_config(args.preset)
    if cfg.pretrain.contrastive_weight <= 0:
        parser.error(f"preset {args.preset!r} has no contrastive term to pair batches for")
    wd = Path(args.workdir)
    windows = np.load(wd / "encode" / "train_windows.npy", mmap_mode="r")
    offsets = np.load(wd / "encode" / "train_doc_offsets.npy", allow_pickle=False)
    vocab = load_tokenizer(wd / "tokenizer" / "tokenizer.json").get_vocab_size()
    print(f"{wd}: {windows.shape[0]} windows x {windows.shape[1]} in {len(offsets) - 1} "
          "documents", flush=True)
    data = layouts(windows, offsets, vocab, cfg, cfg.pretrain.steps)
    out = {"padding": []}
    for name, batches in data.items():
        steps = args.passes * batches.batches_per_pass
        out["padding"].append({"layout": name, **padding(batches, steps)})
        print("padding", json.dumps(out["padding"][-1]), flush=True)
    if args.rounds:
        paired = {k: v for k, v in data.items() if k != "unpaired"}
        out["interleaved"] = interleaved(paired, vocab, cfg, args.rounds, args.round_steps)
        for row in out["interleaved"]:
            print("interleaved", json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
