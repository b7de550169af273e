"""What one dropout site costs on TensorFlow, with and without XLA: keras' draws against ours.

    .venv/bin/python benchmarks/dropout.py
    .venv/bin/python benchmarks/dropout.py --rounds 7 --reps 10

A forward and backward pass of `dropout(x)` (rate 0.1) inside a `tf.function`, for the two
tensor shapes a reference-size block (4 x 256, L 128, B 32) drops: attention probabilities
(B, N, L, L) and hidden states (B, L, H). Contenders: no dropout, keras.layers.Dropout (one
float32 uniform per element from TensorFlow's random ops) and selfsup's FastDropout (a counter
hash, four bytes a word), each compiled without and with XLA. All of them take turns, `--reps`
passes each per round, so load from other jobs hits all of them; the median ms of a pass over
the rounds is printed, and the extra cost over no dropout.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np

SHAPES = {"probabilities (32, 4, 128, 128)": (32, 4, 128, 128),
          "hidden (32, 128, 256)": (32, 128, 256)}


def site(kind: str, jit: bool):
    import tensorflow as tf

    from selfsup_model.nn.layers import FastDropout

    layer = {"none": None, "keras": keras.layers.Dropout(0.1, seed=1),
             "ours": FastDropout(0.1, seed=1)}[kind]

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = x * 1.0 if layer is None else layer(x, training=True)
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, x)

    return tf.function(step, jit_compile=jit)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=5, help="passes per contender per round")
    args = p.parse_args(argv)
    if keras.backend.backend() != "tensorflow":
        raise SystemExit("this measures TensorFlow's draws: run with KERAS_BACKEND=tensorflow")
    import tensorflow as tf

    print(f"# {os.cpu_count()} CPUs visible, 1-min load average "
          f"{os.getloadavg()[0]:.2f}; median ms of a forward + backward pass", file=sys.stderr)
    for label, shape in SHAPES.items():
        x = tf.random.normal(shape, seed=0)
        field = {(kind, jit): site(kind, jit) for kind in ("none", "keras", "ours")
                 for jit in (False, True)}
        for fn in field.values():  # tracing and compilation, never timed
            fn(x).numpy()
        times: dict = {key: [] for key in field}
        for _ in range(args.rounds):
            for key, fn in field.items():
                for _ in range(args.reps):
                    start = time.perf_counter()
                    fn(x).numpy()
                    times[key].append(1e3 * (time.perf_counter() - start))
        ms = {key: float(np.median(t)) for key, t in times.items()}
        print(f"\n{label}\n{'draws':<8}{'no XLA':>10}{'extra':>10}{'XLA':>10}{'extra':>10}")
        for kind in ("none", "keras", "ours"):
            cells = []
            for jit in (False, True):
                extra = ms[(kind, jit)] - ms[("none", jit)]
                cells += [f"{ms[(kind, jit)]:10.2f}",
                          f"{extra:10.2f}" if kind != "none" else " " * 10]
            print(f"{kind:<8}{''.join(cells)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
