"""Throughput of `mask_tokens` on one core: best of several repeats.

    .venv/bin/python benchmarks/masking.py            # 256 x 128, both selection rules
    .venv/bin/python benchmarks/masking.py --json     # one JSON object per rule

Batches hold random non-special ids framed [CLS] ... [SEP] and right-padded,
with realistic lengths (a third fill the window, the rest are uniform in
[8, L]). tokens/s counts every position of the (B, L) batch, padding included,
because that is the array the training step corrupts; real_tokens/s counts
the non-[PAD] positions only. Target: >= 20 million tokens/s.
"""

from __future__ import annotations

import os

# numpy's own work here is single-threaded, but pin BLAS/OpenMP pools before import
# so nothing else can borrow the second core and flatter the number.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import json
import time

import numpy as np
from synthetic import synthetic_windows

from selfsup_model.config import MaskingConfig
from selfsup_model.text.masking import mask_counts, mask_tokens
from selfsup_model.text.specials import PAD_ID

TARGET_TOKENS_PER_S = 20e6


def measure(ids: np.ndarray, cfg: MaskingConfig, vocab: int, repeats: int, iters: int) -> dict:
    rng = np.random.default_rng(0)
    mask_tokens(ids, rng, cfg, vocab)  # warm-up: first-call allocations
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = mask_tokens(ids, rng, cfg, vocab)
        best = min(best, (time.perf_counter() - start) / iters)
    counts = mask_counts(out)
    return {
        "selection": cfg.selection,
        "batch": list(ids.shape),
        "ms_per_batch": round(best * 1e3, 4),
        "tokens_per_s": round(ids.size / best),
        "real_tokens_per_s": round(np.count_nonzero(ids != PAD_ID) / best),
        "selected_per_batch": counts["selected"],
        "meets_target": ids.size / best >= TARGET_TOKENS_PER_S,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--max-predictions", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats; the best is kept")
    parser.add_argument("--iters", type=int, default=50, help="mask_tokens calls per repeat")
    parser.add_argument("--selection", choices=["fixed", "bernoulli", "both"], default="both")
    parser.add_argument("--core", type=int, default=0, help="CPU to pin to (-1: do not pin)")
    parser.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    args = parser.parse_args(argv)

    if args.core >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.core})
    ids = synthetic_windows(np.random.default_rng(1), args.batch, args.length, args.vocab)
    rules = ["fixed", "bernoulli"] if args.selection == "both" else [args.selection]
    results = []
    for rule in rules:
        cfg = MaskingConfig(selection=rule, max_predictions=args.max_predictions)
        results.append(measure(ids, cfg, args.vocab, args.repeats, args.iters))
    for r in results:
        if args.json:
            print(json.dumps(r))
        else:
            print(
                f"{r['selection']:>9}  {r['batch'][0]}x{r['batch'][1]}  "
                f"{r['ms_per_batch']:.3f} ms/batch  {r['tokens_per_s'] / 1e6:.1f} M tokens/s  "
                f"({r['real_tokens_per_s'] / 1e6:.1f} M real tokens/s)  "
                f"target {TARGET_TOKENS_PER_S / 1e6:.0f} M: "
                f"{'met' if r['meets_target'] else 'MISSED'}"
            )
    return 0 if all(r["meets_target"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
