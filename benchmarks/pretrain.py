"""Pretraining throughput on the current Keras backend, compile time excluded; with --peer, side
by side with plain Keras and Hugging Face peers of the same size, interleaved in one process.

    .venv/bin/python benchmarks/pretrain.py                        # tiny and demo presets
    .venv/bin/python benchmarks/pretrain.py --sizes tiny,demo,base --steps 30
    .venv/bin/python benchmarks/pretrain.py --config-4x256 --jit on  # the issue's reference
    .venv/bin/python benchmarks/pretrain.py --config-4x256 --dropout 0 --peer keras,hf
    .venv/bin/python benchmarks/pretrain.py --config-4x256 --dropout 0.1 --jit on \\
        --peer hf,no-dropout,no-xla --rounds 6 --steps 4
    KERAS_BACKEND=jax python benchmarks/pretrain.py --sizes base --precision bf16 --jit on \\
        --steps 50 --val-loss --peak-tflops 989 --block-tensorflow   # benchmarks/gpu_check.sh

A size is a preset from `selfsup_model.config.PRESETS` merged into
PipelineConfig (model, encode.max_len, tokenizer.vocab_size, pretrain.batch_size,
masks.max_predictions). Windows are synthetic with the demo corpus's length mix
(benchmarks/synthetic.py: 14% padding at 64 tokens, 29% at 128). The timed run
is `model.fit` over the real `PretrainBatches` pipeline (with `--length-buckets`
where the data path has them), after `--warmup` steps that absorb tracing and
XLA compilation. Two rates: positions/s counts every input position fed
(batch x its length, padding included); real tokens/s counts the non-[PAD] ones,
the work that is the same for every contender.

Peers (`--peer`, comma-separated), each timed in turn with ours, `--steps` steps
per contender per round, for `--rounds` rounds, so load from other jobs hits all:
  keras        a plain Keras 3 BERT (post-LN, keras.layers.MultiHeadAttention, exact gelu,
               untied heads, AdamW, SparseCategoricalCrossentropy with sample weights,
               model.fit on numpy arrays, compile's default jit) in two variants:
               keras-full (vocabulary head on every position) and keras-gathered (the head
               on the P selected positions, like ours)
  hf           Hugging Face BertForMaskedLM on PyTorch CPU (the `bench` extra)
  hf-fp32      the same in float32 whatever ours' precision (beside `hf` under --precision bf16)
  keras-draws  ours, but with keras' own dropout draws (FastDropout's before)
  no-dropout   ours at dropout 0 (what dropout costs)
  no-xla       ours compiled without XLA (what --jit on buys)
  buckets      ours unpacked, in --length-buckets buckets (beside --packing: which wins)
Peers see exactly ours' batches of those steps, at full length (as a plain user pads); with
`--packing` ours packs several windows into each row, and the peers read the same windows
one to a row.
Peers compute at ours' precision: under `--precision bf16` the plain Keras peers take the
mixed_bfloat16 policy and Hugging Face runs under torch.autocast(bfloat16), as each library's
users turn mixed precision on (float32 weights and optimizer either way).

FLOPs/token (forward + backward) = 6 * (non-embedding params + V*H*P/L, the
gathered vocabulary projection) + 12 * layers * L * H (attention scores and
mixing), per input position. MFU = positions/s * FLOPs/token / --peak-tflops.
"""

from __future__ import annotations

import argparse
import importlib.abc
import inspect
import json
import os
import sys
import time
import warnings

import numpy as np
from synthetic import padding_share, synthetic_windows

from selfsup_model.config import MaskingConfig, ModelConfig, PretrainConfig
from selfsup_model.presets import build_config
from selfsup_model.text.specials import PAD_ID

REFERENCE = {"hidden": 256, "layers": 4, "ff": 1024, "vocab": 8192, "seq": 128,  # heads = 4
             "batch": 32}
REFERENCE_TARGET_TOKENS_PER_S = 9_000
PEERS = ("keras", "hf", "hf-fp32", "keras-draws", "no-dropout", "no-xla", "buckets")


def size_spec(name: str, args) -> dict:
    if name == "custom":
        spec = {k: getattr(args, k) for k in REFERENCE}
        spec["heads"] = args.heads or max(1, spec["hidden"] // 64)
        spec["predictions"], spec["dropout"] = args.predictions, args.dropout
        # The reference is a BERT: post-LN, like both peers; the optimiser at its defaults.
        return {"name": "custom", **spec, **_recipe(ModelConfig(), PretrainConfig())}
    cfg = build_config(name)
    return {"name": name, "hidden": cfg.model.hidden, "layers": cfg.model.layers,
            "heads": cfg.model.heads, "ff": cfg.model.ff, "vocab": cfg.tokenizer.vocab_size,
            "seq": cfg.encode.max_len,
            "batch": cfg.pretrain.batch_size, "predictions": cfg.masks.max_predictions,
            "dropout": cfg.model.dropout if args.dropout is None else args.dropout,
            **_recipe(cfg.model, cfg.pretrain)}


def _recipe(model: ModelConfig, pretrain: PretrainConfig) -> dict:
    """What a preset trains with beyond its size: a benchmark of the preset measures these too
    (a post-LN stand-in for a pre-LN preset would time, and train, another model)."""
    return {"norm": model.norm, "learning_rate": pretrain.learning_rate,
            "warmup": pretrain.warmup_steps, "decay": pretrain.decay,
            "length_buckets": pretrain.length_buckets}


def flops_per_token(spec: dict, non_embedding_params: int) -> float:
    head = spec["vocab"] * spec["hidden"] * spec["predictions"] / spec["seq"]
    return (6.0 * (non_embedding_params + head)
            + 12.0 * spec["layers"] * spec["seq"] * spec["hidden"])


def time_data(data, steps: int) -> float:
    """Seconds per batch of the input pipeline alone (memmap read + corruption + framing)."""
    data.batch_for_step(0)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        data.batch_for_step(step)
    return (time.perf_counter() - start) / steps


# --- ours -------------------------------------------------------------------------------------

def bucket_setting(args, spec: dict) -> int | None:
    """The length_buckets to pass, or None where the data path has no such argument."""
    from selfsup_model.pretraining.batches import PretrainBatches

    if "length_buckets" not in inspect.signature(PretrainBatches).parameters:
        if args.length_buckets not in (None, 1):
            print("# --length-buckets ignored: PretrainBatches has no length_buckets yet",
                  file=sys.stderr)
        return None
    if args.length_buckets is not None:
        return args.length_buckets
    return spec.get("length_buckets", 1)


def make_batches(spec: dict, windows, total: int, buckets: int | None, packing: bool = False):
    from selfsup_model.pretraining.batches import PretrainBatches

    extra = {} if buckets is None else {"length_buckets": buckets}
    if packing:  # several windows to a row, one shape (no buckets)
        if "packing" not in inspect.signature(PretrainBatches).parameters:
            raise SystemExit("--packing: this checkout's PretrainBatches cannot pack")
        extra = {"packing": True}
    return PretrainBatches(windows, objective="mlm", batch_size=spec["batch"], total_steps=total,
                           seed=0, masking=MaskingConfig(max_predictions=spec["predictions"]),
                           vocab_size=spec["vocab"], **extra)


def step_tokens(data, step: int) -> tuple[int, int]:
    """(positions, real tokens) that `step` feeds."""
    if hasattr(data, "step_tokens"):
        t = data.step_tokens(step)
        return t.positions, t.real
    ids = data.batch_for_step(step)[0]["input_ids"]
    return int(ids.size), int(np.count_nonzero(ids != PAD_ID))


def build_ours(spec: dict, args, total: int, dropout_draws: str = "hash", jit: str | None = None,
               packed: bool | None = None):
    """Our compiled PretrainingModel; `dropout_draws="keras"` swaps our FastDropout for
    keras.layers.Dropout (the counter hash's before); `jit` overrides `--jit`; `packed`
    (default `--packing`) builds it for packed rows."""
    data_packed = args.packing if packed is None else packed
    import keras

    from selfsup_model.nn import layers as our_layers
    from selfsup_model.nn import model as our_model
    from selfsup_model.nn.model import build_backbone, build_pretraining_model
    from selfsup_model.pretraining.devices import resolve_jit, resolve_precision
    from selfsup_model.pretraining.loop import build_optimizer

    jit = args.jit if jit is None else jit
    model_cfg = ModelConfig(hidden=spec["hidden"], layers=spec["layers"], heads=spec["heads"],
                            ff=spec["ff"], dropout=spec["dropout"], norm=spec["norm"])
    # The preset's schedule squeezed into the run's steps: its warmup, but at most a tenth of them.
    pre_cfg = PretrainConfig(batch_size=spec["batch"], steps=total,
                             learning_rate=spec["learning_rate"], decay=spec["decay"],
                             warmup_steps=min(spec["warmup"], max(1, total // 10)),
                             mixed_precision=args.precision, jit=jit)
    keras.utils.set_random_seed(0)
    policy, jit = resolve_precision(args.precision), resolve_jit(jit)
    # Older checkouts (other Python modules) may lack FastDropout: then there is nothing to swap.
    swapped = [m for m in (our_layers, our_model) if hasattr(m, "FastDropout")]
    ours_dropout = our_layers.__dict__.get("FastDropout")
    if dropout_draws == "keras":
        for module in swapped:
            module.FastDropout = keras.layers.Dropout
    # Packed rows need the encoder that keeps their documents apart, as pretraining builds it.
    documents = {"documents": True} if data_packed else {}
    try:
        backbone = build_backbone(spec["vocab"], spec["seq"], model_cfg, dtype=policy,
                                  **documents)
    finally:
        for module in swapped:
            module.FastDropout = ours_dropout
    model = build_pretraining_model(backbone, "mlm", model_cfg)
    model.compile(optimizer=build_optimizer(pre_cfg, total), jit_compile=jit)
    return model, policy, jit


def warm_steps(data, n: int) -> list[int]:
    """The first `n` steps plus, with length buckets, the first step of every other batch shape,
    so no timed step traces or compiles."""
    steps = list(range(n))
    if getattr(data, "bucketed", False):
        seen = {data.step_tokens(s)[:2] for s in steps}
        for s in range(data.batches_per_pass):
            shape = data.step_tokens(s)[:2]
            if shape not in seen:
                seen.add(shape)
                steps.append(s)
    return steps


def fit_source(data, steps: list[int]):
    """A PyDataset over the given global steps of `data`, as the pipeline's `fit` reads it."""
    import keras

    class Steps(keras.utils.PyDataset):
        bucketed = getattr(data, "bucketed", False)

        def __init__(self):
            super().__init__(workers=1, use_multiprocessing=False)

        def __len__(self):
            return len(steps)

        def __getitem__(self, i):
            return data.batch_for_step(steps[i])

    try:
        from selfsup_model.pretraining.batches import fit_input
    except ImportError:  # the data path before length buckets
        return Steps()
    return fit_input(Steps())


def step_timer():
    """A Keras callback collecting each train step's wall time in `.times`."""
    import keras

    class StepTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times: list[float] = []

        def on_train_batch_begin(self, batch, logs=None):
            self.t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            float(next(iter(logs.values())))  # wait for the step (TF and JAX are asynchronous)
            self.times.append(time.perf_counter() - self.t)

    return StepTimer()


def bench_size(spec: dict, args) -> dict:
    """One size alone: step times, positions/s, real tokens/s, MFU (and, with --val-loss, the
    validation MLM loss after the run's steps)."""
    import keras

    total = args.warmup + args.steps
    # With --val-loss, fresh windows for every step, up to 64k windows: a pool cycled through
    # many times can be memorised rather than the chain learnt (the GPU's first 2,000-step run
    # made 125 passes over 2,048 windows and ended above the unigram baseline).
    pool = (min(total * spec["batch"], 1 << 16) if args.val_loss
            else max(4 * spec["batch"], 512))
    windows = synthetic_windows(np.random.default_rng(0), pool, spec["seq"], spec["vocab"],
                                structured=args.val_loss)
    buckets = None if args.packing else bucket_setting(args, spec)
    data = make_batches(spec, windows, total, buckets, args.packing)
    data_s = time_data(data, min(args.steps, 50))
    model, policy, jit = build_ours(spec, args, total)
    emb = model.backbone.get_layer("embeddings")
    non_embedding = model.count_params() - sum(int(np.prod(v.shape)) for v in emb.weights)

    warm = step_timer()
    compile_start = time.perf_counter()
    timed = list(range(args.warmup, total))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Your input ran out of data")
        model.fit(fit_source(data, warm_steps(data, args.warmup)), epochs=1, verbose=0,
                  shuffle=False, callbacks=[warm])
        # No per-step sync here: JAX and TF dispatch asynchronously, so building the next batch
        # overlaps the device's step, as in a real run. fit's epoch-end logs wait for the last.
        start = time.perf_counter()
        model.fit(fit_source(data, timed), epochs=1, verbose=0, shuffle=False)
        seconds = time.perf_counter() - start
    wall = time.perf_counter() - compile_start
    tokens = np.array([step_tokens(data, s) for s in timed])  # (steps, 2)
    step_s = seconds / len(timed)
    positions_per_s = float(tokens[:, 0].sum() / seconds)
    real_per_s = float(tokens[:, 1].sum() / seconds)
    fpt = flops_per_token(spec, non_embedding)
    out = {**spec, "backend": keras.backend.backend(), "policy": policy, "jit": jit,
           "length_buckets": buckets, "packing": args.packing, "params": model.count_params(),
           "non_embedding_params": non_embedding, "padding_share": round(padding_share(windows), 3),
           "step_ms": round(step_s * 1e3, 2), "data_ms": round(data_s * 1e3, 2),
           "data_share": round(data_s / step_s, 3), "tokens_per_s": round(positions_per_s),
           "real_tokens_per_s": round(real_per_s),
           "gflops_per_token": round(fpt / 1e9, 5),
           "achieved_tflops": round(positions_per_s * fpt / 1e12, 4),
           "warmup_s": round(sum(warm.times), 2), "wall_s": round(wall, 2)}
    if args.peak_tflops:
        out["mfu"] = round(positions_per_s * fpt / (args.peak_tflops * 1e12), 4)
    if args.val_loss:
        out.update(validation_loss(model, spec, windows))
    return out


def validation_loss(model, spec: dict, train_windows) -> dict:
    """Token-weighted MLM loss on held-out windows (other seed, same generator), static masks,
    beside the unigram baseline of the training windows."""
    from selfsup_model.nn.model import build_pretrain_export_model
    from selfsup_model.pretraining.evaluation import (
        unigram_log_probs,
        validation_metrics,
        validation_unigram_loss,
    )
    from selfsup_model.text.masking import make_static_masks

    held_out = synthetic_windows(np.random.default_rng(1), 2 * spec["batch"], spec["seq"],
                                 spec["vocab"], structured=True)
    masks = make_static_masks(held_out, MaskingConfig(max_predictions=spec["predictions"]),
                              spec["vocab"], seed=1)
    export = build_pretrain_export_model(model.backbone, model.head, "mlm")
    # Full (B, L, V) float32 logits come back to the host: keep the batches small.
    metrics = validation_metrics(export, "mlm", masks, min(spec["batch"], 32))
    baseline = validation_unigram_loss(unigram_log_probs(train_windows, spec["vocab"], "mlm"),
                                       "mlm", masks)
    return {"val_mlm_loss": round(metrics["val/mlm_loss"], 4),
            "val_mlm_accuracy": round(metrics["val/mlm_accuracy"], 4),
            "val_scored_tokens": int(metrics["val/scored_tokens"]),
            "val_unigram_baseline": round(baseline, 4)}


# --- peers ------------------------------------------------------------------------------------

def build_keras_peer(spec: dict, head: str, jit: str, policy: str = "float32"):
    """A plain Keras 3 BERT encoder + MLM head, as a Keras user writes one from the docs; under
    `policy` (Keras' global dtype policy while it is built, as the mixed-precision guide does)."""
    import keras

    before = keras.config.dtype_policy().name
    keras.config.set_dtype_policy(policy)
    try:
        return _keras_peer(spec, head, jit)
    finally:
        keras.config.set_dtype_policy(before)


def _keras_peer(spec: dict, head: str, jit: str):
    import keras
    from keras import layers, ops

    class PositionEmbedding(layers.Layer):
        def __init__(self, length, width, **kwargs):
            super().__init__(**kwargs)
            self.length, self.width = length, width

        def build(self, input_shape):
            self.table = self.add_weight(shape=(self.length, self.width),
                                         initializer=keras.initializers.TruncatedNormal(0.02))

        def call(self, x):
            return x + self.table[None, : ops.shape(x)[1]]

    h, rate, eps = spec["hidden"], spec["dropout"], 1e-12
    ids = keras.Input((spec["seq"],), dtype="int32", name="input_ids")
    attention_mask = ops.expand_dims(ops.not_equal(ids, PAD_ID), 1)  # (B, 1, L): real keys
    x = layers.Embedding(spec["vocab"], h)(ids)
    x = layers.Dropout(rate)(layers.LayerNormalization(epsilon=eps)(PositionEmbedding(
        spec["seq"], h)(x)))
    for _ in range(spec["layers"]):
        a = layers.MultiHeadAttention(spec["heads"], h // spec["heads"], dropout=rate)(
            x, x, attention_mask=attention_mask)
        x = layers.LayerNormalization(epsilon=eps)(x + layers.Dropout(rate)(a))
        f = layers.Dense(h)(layers.Dense(spec["ff"], activation="gelu")(x))
        x = layers.LayerNormalization(epsilon=eps)(x + layers.Dropout(rate)(f))
    inputs = ids
    if head == "gathered":
        positions = keras.Input((spec["predictions"],), dtype="int32", name="mask_positions")
        x = ops.take_along_axis(x, ops.expand_dims(positions, -1), axis=1)  # (B, P, H)
        inputs = {"input_ids": ids, "mask_positions": positions}
    x = layers.LayerNormalization(epsilon=eps)(layers.Dense(h, activation="gelu")(x))
    logits = layers.Dense(spec["vocab"], dtype="float32")(x)  # the guide: float32 outputs
    model = keras.Model(inputs, logits)
    model.compile(optimizer=keras.optimizers.AdamW(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile={"auto": "auto", "on": True, "off": False}[jit])
    return model


def dense_targets(batch, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """Gathered (positions, ids, weights) -> (B, L) targets and weights of a full-length head."""
    x, ids, weights = batch
    rows = np.arange(len(ids))[:, None]
    targets = np.zeros((len(ids), seq), np.int32)
    dense = np.zeros((len(ids), seq), np.float32)
    # Unused gathered slots point at position 0 ([CLS], never selected) with weight 0.
    targets[rows, x["mask_positions"]] = ids
    dense[rows, x["mask_positions"]] = weights
    return targets, dense


class Contender:
    """One thing to time: `run(steps)` trains on those global steps, returns their times."""

    def __init__(self, name: str, run, tokens, data=None):
        self.name, self.run, self.tokens, self.data = name, run, tokens, data
        self.rounds: list[dict] = []


def keras_contender(name: str, model, data_for_steps, tokens) -> Contender:
    def run(steps):
        x, y, w = data_for_steps(steps)
        timer = step_timer()
        model.fit(x, y, sample_weight=w, batch_size=len(y) // len(steps), epochs=1, verbose=0,
                  shuffle=False, callbacks=[timer])
        return timer.times
    return Contender(name, run, tokens)


def ours_contender(name: str, model, data) -> Contender:
    def run(steps):
        timer = step_timer()
        with warnings.catch_warnings():
            # A bucketed tf.data source has no known length; Keras warns when it ends.
            warnings.filterwarnings("ignore", message="Your input ran out of data")
            model.fit(fit_source(data, steps), epochs=1, verbose=0, shuffle=False,
                      callbacks=[timer])
        return timer.times
    return Contender(name, run, lambda s: step_tokens(data, s), data)


def hf_contender(spec: dict, reference, bf16: bool, name: str = "hf") -> Contender | None:
    """The same architecture as a Hugging Face BertForMaskedLM on torch (CPU), dense MLM head,
    on ours' batches padded to full length; `bf16`: forward and loss under
    torch.autocast(bfloat16) (float32 weights and AdamW, as torch's AMP recipe)."""
    try:
        import torch
        from transformers import BertConfig, BertForMaskedLM
    except ImportError:
        print("peer hf: torch/transformers are not installed; install the bench extra "
              "(pip install -e '.[bench]') to compare", file=sys.stderr)
        return None
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=spec["vocab"], hidden_size=spec["hidden"],
                     num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                     intermediate_size=spec["ff"], max_position_embeddings=spec["seq"],
                     hidden_dropout_prob=spec["dropout"],
                     attention_probs_dropout_prob=spec["dropout"])
    model = BertForMaskedLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def run(steps):
        times = []
        for step in steps:
            batch = reference.batch_for_step(step)
            targets, weights = dense_targets(batch, spec["seq"])
            ids = torch.from_numpy(batch[0]["input_ids"].astype(np.int64))
            labels = torch.from_numpy(np.where(weights > 0, targets, -100).astype(np.int64))
            t = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = model(input_ids=ids, attention_mask=(ids != PAD_ID).long(),
                             labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t)
        return times

    print(f"# {name}: torch {torch.__version__}, {torch.get_num_threads()} threads, attention "
          f"{model.config._attn_implementation}, autocast bfloat16 {bf16}", file=sys.stderr)
    return Contender(name, run, lambda s: step_tokens(reference, s))


def contenders(spec: dict, args, windows, peers: list[str]) -> tuple[list[Contender], dict]:
    total = args.warmup + args.rounds * args.steps
    buckets = bucket_setting(args, spec)
    data = make_batches(spec, windows, total, None if args.packing else buckets, args.packing)
    reference = make_batches(spec, windows, total, None if buckets is None else 1)
    model, policy, jit = build_ours(spec, args, total)
    out = [ours_contender("ours", model, data)]
    if "buckets" in peers:  # the same model (its own copy), fed bucketed rows, one window each
        bucketed = make_batches(spec, windows, total, buckets or 1)
        out.append(ours_contender(f"ours-{buckets or 1}-buckets",
                                  build_ours(spec, args, total, packed=False)[0], bucketed))
    if "keras-draws" in peers:
        out.append(ours_contender("ours-keras-draws",
                                  build_ours(spec, args, total, dropout_draws="keras")[0], data))
    if "no-dropout" in peers:
        out.append(ours_contender("ours-dropout-0",
                                  build_ours({**spec, "dropout": 0.0}, args, total)[0], data))
    if "no-xla" in peers:
        out.append(ours_contender("ours-no-xla", build_ours(spec, args, total, jit="off")[0], data))
    if "keras" in peers:
        def gathered(steps):
            b = [reference.batch_for_step(s) for s in steps]
            x = {k: np.concatenate([bb[0][k] for bb in b]) for k in b[0][0]}
            return x, np.concatenate([bb[1] for bb in b]), np.concatenate([bb[2] for bb in b])

        def full(steps):
            x, _, _ = gathered(steps)
            dense = [dense_targets(reference.batch_for_step(s), spec["seq"]) for s in steps]
            return (x["input_ids"], np.concatenate([d[0] for d in dense]),
                    np.concatenate([d[1] for d in dense]))

        def ref_tokens(step):
            return step_tokens(reference, step)

        out.append(keras_contender("keras-full",
                                   build_keras_peer(spec, "full", args.peer_jit, policy),
                                   full, ref_tokens))
        out.append(keras_contender("keras-gathered",
                                   build_keras_peer(spec, "gathered", args.peer_jit, policy),
                                   gathered, ref_tokens))
    for name in ("hf", "hf-fp32"):
        if name in peers:
            bf16 = name == "hf" and policy == "mixed_bfloat16"
            hf = hf_contender(spec, reference, bf16, name)
            if hf is not None:
                out.append(hf)
    info = {"policy": policy, "jit": jit, "packing": args.packing,
            "length_buckets": None if args.packing else buckets, "peer_jit": args.peer_jit}
    return out, info


def bench_peers(spec: dict, args, peers: list[str]) -> dict:
    import keras

    windows = synthetic_windows(np.random.default_rng(0), max(8 * spec["batch"], 1024),
                                spec["seq"], spec["vocab"])
    field, info = contenders(spec, args, windows, peers)
    print(f"# {spec} backend={keras.backend.backend()} {info} padding_share="
          f"{padding_share(windows):.3f}; {args.rounds} rounds x {args.steps} steps each, "
          "interleaved", file=sys.stderr)
    for c in field:  # tracing, compilation, first-touch allocations: never timed
        c.run(warm_steps(c.data, args.warmup) if c.data is not None else list(range(args.warmup)))
    for r in range(args.rounds):
        steps = list(range(args.warmup + r * args.steps, args.warmup + (r + 1) * args.steps))
        for c in field:
            times = c.run(steps)
            tokens = np.array([c.tokens(s) for s in steps])  # (steps, 2)
            seconds = float(np.sum(times))
            c.rounds.append({"step_ms": 1e3 * float(np.median(times)),
                             "positions_per_s": tokens[:, 0].sum() / seconds,
                             "real_tokens_per_s": tokens[:, 1].sum() / seconds})
        print(_round_line(r, field), file=sys.stderr, flush=True)
    return summarise(spec, info, field)


def summarise(spec: dict, info: dict, field: list[Contender]) -> dict:
    ours = field[0]
    out = {**spec, **info, "contenders": {}}
    for c in field:
        med = {k: round(float(np.median([r[k] for r in c.rounds])), 1) for k in c.rounds[0]}
        entry = {**med}
        if c is not ours:
            for k in ("real_tokens_per_s", "positions_per_s"):
                ratios = [o[k] / p[k] for o, p in zip(ours.rounds, c.rounds, strict=True)]
                entry[f"ours_over_{k}"] = round(float(np.median(ratios)), 3)
                entry[f"ours_over_{k}_rounds"] = [round(x, 3) for x in ratios]
        out["contenders"][c.name] = entry
    return out


def _round_line(r: int, field: list[Contender]) -> str:
    ours = field[0].rounds[-1]
    parts = [(f"round {r}: ours {ours['real_tokens_per_s']:,.0f} real tok/s "
              f"({ours['positions_per_s']:,.0f} pos/s)")]
    for c in field[1:]:
        x = c.rounds[-1]
        parts.append(f"{c.name} {x['real_tokens_per_s']:,.0f} "
                     f"(ours/{c.name} {ours['real_tokens_per_s'] / x['real_tokens_per_s']:.2f}x)")
    return "; ".join(parts)


def _peer_lines(summary: dict) -> list[str]:
    lines = []
    for name, e in summary["contenders"].items():
        line = (f"{name:28s} real tokens/s {e['real_tokens_per_s']:>9,.0f}  positions/s "
                f"{e['positions_per_s']:>9,.0f}  step_ms {e['step_ms']:>8,.1f}")
        if "ours_over_real_tokens_per_s" in e:
            line += (f"  ours/this: real {e['ours_over_real_tokens_per_s']:.2f}x  "
                     f"positions {e['ours_over_positions_per_s']:.2f}x (median of rounds)")
        lines.append(line)
    return lines


# --- command line -----------------------------------------------------------------------------

class _NoTensorFlow(importlib.abc.MetaPathFinder):
    """Makes `import tensorflow` fail, as on a JAX-only GPU machine."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "tensorflow":
            raise ImportError("tensorflow is blocked (--block-tensorflow)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="tiny,demo",
                   help="comma-separated presets (tiny, demo, base)")
    p.add_argument("--size", choices=["custom"],
                   help="measure one custom size from the flags below")
    p.add_argument("--config-4x256", action="store_true",
                   help="the reference: 4 x 256, ff 1024, V 8192, L 128, B 32")
    for name, default in REFERENCE.items():
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--heads", type=int, default=0, help="default hidden // 64")
    p.add_argument("--predictions", type=int, default=20,
                   help="gathered MLM positions per sequence")
    p.add_argument("--dropout", type=float, default=None,
                   help="override the size's dropout (custom default 0.1)")
    p.add_argument("--steps", type=int, default=20,
                   help="timed steps (with --peer: per contender per round)")
    p.add_argument("--rounds", type=int, default=5, help="with --peer: interleaved rounds")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps (tracing, XLA compile)")
    p.add_argument("--jit", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--peer-jit", choices=["auto", "on", "off"], default="auto",
                   help="the plain Keras peer's compile(jit_compile=...): auto = Keras' default")
    p.add_argument("--precision", choices=["auto", "off", "bf16"], default="auto")
    p.add_argument("--length-buckets", type=int, default=None,
                   help="ours' pretrain.length_buckets (default: the config's), where the data "
                        "path has them")
    p.add_argument("--packing", action="store_true",
                   help="ours' pretrain.packing: several windows to a row (no buckets)")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="hardware peak, for MFU")
    p.add_argument("--peer", default="",
                   help=f"comma-separated, any of {', '.join(PEERS)}: time them interleaved "
                        "with ours")
    p.add_argument("--val-loss", action="store_true",
                   help="train on structured synthetic windows and report the validation MLM "
                        "loss after the run's steps")
    p.add_argument("--block-tensorflow", action="store_true",
                   help="fail any import of tensorflow (prove a JAX run never needs it)")
    p.add_argument("--json", action="store_true", help="print one JSON object per size")
    args = p.parse_args(argv)
    peers = [x.strip() for x in args.peer.split(",") if x.strip()]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        p.error(f"unknown --peer {', '.join(unknown)}; choose from {', '.join(PEERS)}")
    if args.block_tensorflow:
        sys.meta_path.insert(0, _NoTensorFlow())

    if args.config_4x256:
        args.size, args.heads = "custom", 4
        for k, v in REFERENCE.items():
            setattr(args, k, v)
    if args.size and args.dropout is None:
        args.dropout = 0.1
    names = ["custom"] if args.size else [s.strip() for s in args.sizes.split(",") if s.strip()]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# {os.cpu_count()} CPUs visible, 1-min load average {load:.2f} before the run; "
          "absolute numbers drop when other jobs share the CPUs, interleaved ratios much less",
          file=sys.stderr)
    for name in names:
        spec = size_spec(name, args)
        if peers:
            summary = bench_peers(spec, args, peers)
            print(json.dumps(summary) if args.json else "\n".join(_peer_lines(summary)))
            continue
        result = bench_size(spec, args)
        if spec == {**spec, **REFERENCE}:
            result["target_tokens_per_s"] = REFERENCE_TARGET_TOKENS_PER_S
            result["meets_target"] = result["tokens_per_s"] >= REFERENCE_TARGET_TOKENS_PER_S
        print(json.dumps(result) if args.json else _line(result))
    if args.block_tensorflow:
        print(f"# tensorflow imported: {'tensorflow' in sys.modules}", file=sys.stderr)
    return 0


def _line(r: dict) -> str:
    keys = ("name", "backend", "policy", "jit", "norm", "dropout", "learning_rate",
            "length_buckets", "packing", "params", "step_ms",
            "data_ms", "data_share", "tokens_per_s", "real_tokens_per_s", "gflops_per_token",
            "achieved_tflops", "mfu", "warmup_s", "meets_target", "val_mlm_loss",
            "val_unigram_baseline")
    return "  ".join(f"{k}={r[k]}" for k in keys if k in r)


if __name__ == "__main__":
    sys.exit(main())
