"""Pretraining throughput on the current Keras backend, compile time excluded.

    .venv/bin/python benchmarks/pretrain.py                        # tiny and demo presets
    .venv/bin/python benchmarks/pretrain.py --sizes tiny,demo,base --steps 30
    .venv/bin/python benchmarks/pretrain.py --config-4x256 --jit on  # the issue's reference
    .venv/bin/python benchmarks/pretrain.py --size custom --hidden 256 --layers 4 --ff 1024 \\
        --vocab 8192 --seq 128 --batch 32 --peak-tflops 0.2 --peer hf

A size is a preset from `selfsup_model.config.PRESETS` merged into
PipelineConfig (model, encode.max_len, tokenizer.vocab_size, pretrain.batch_size,
masks.max_predictions). Windows are synthetic, framed [CLS] ... [SEP] and
padded like real ones. The timed run is `model.fit` over the real
`PretrainBatches` pipeline, after `--warmup` steps that absorb tracing and XLA
compilation. tokens/s counts every input position (batch * seq, padding
included), the same definition as the pretrain stage's budget.

FLOPs/token (forward + backward) = 6 * (non-embedding params + V*H*P/L, the
gathered vocabulary projection) + 12 * layers * L * H (attention scores and
mixing). MFU = tokens/s * FLOPs/token / --peak-tflops.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
from synthetic import synthetic_windows

from selfsup_model.config import MaskingConfig, ModelConfig, PretrainConfig
from selfsup_model.presets import build_config
from selfsup_model.specials import PAD_ID

REFERENCE = {"hidden": 256, "layers": 4, "ff": 1024, "vocab": 8192, "seq": 128,  # heads = 4
             "batch": 32}
REFERENCE_TARGET_TOKENS_PER_S = 9_000


def size_spec(name: str, args) -> dict:
    if name == "custom":
        spec = {k: getattr(args, k) for k in REFERENCE}
        spec["heads"] = args.heads or max(1, spec["hidden"] // 64)
        spec["predictions"], spec["dropout"] = args.predictions, args.dropout
        return {"name": "custom", **spec}
    cfg = build_config(name)
    return {"name": name, "hidden": cfg.model.hidden, "layers": cfg.model.layers,
            "heads": cfg.model.heads, "ff": cfg.model.ff, "vocab": cfg.tokenizer.vocab_size,
            "seq": cfg.encode.max_len,
            "batch": cfg.pretrain.batch_size, "predictions": cfg.masks.max_predictions,
            "dropout": cfg.model.dropout if args.dropout is None else args.dropout}


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


def bench_size(spec: dict, args) -> dict:
    import keras

    from selfsup_model.model import build_backbone, build_pretraining_model
    from selfsup_model.pretrain_data import PretrainBatches
    from selfsup_model.pretraining import build_optimizer, resolve_jit, resolve_precision

    model_cfg = ModelConfig(hidden=spec["hidden"], layers=spec["layers"], heads=spec["heads"],
                            ff=spec["ff"], dropout=spec["dropout"])
    total = args.warmup + args.steps
    pre_cfg = PretrainConfig(batch_size=spec["batch"], steps=total, warmup_steps=min(10, total),
                             mixed_precision=args.precision, jit=args.jit)
    masks = MaskingConfig(max_predictions=spec["predictions"])
    windows = synthetic_windows(np.random.default_rng(0), max(4 * spec["batch"], 512), spec["seq"],
                                spec["vocab"])
    data = PretrainBatches(windows, objective="mlm", batch_size=spec["batch"], total_steps=total,
                           seed=0, masking=masks, vocab_size=spec["vocab"])
    data_s = time_data(data, min(args.steps, 50))

    keras.utils.set_random_seed(0)
    policy, jit = resolve_precision(args.precision), resolve_jit(args.jit)
    backbone = build_backbone(spec["vocab"], spec["seq"], model_cfg, dtype=policy)
    model = build_pretraining_model(backbone, "mlm", model_cfg)
    model.compile(optimizer=build_optimizer(pre_cfg, total), jit_compile=jit)
    emb = backbone.get_layer("embeddings")
    embedding_params = sum(int(np.prod(v.shape)) for v in emb.weights)
    non_embedding = model.count_params() - embedding_params

    times: list[float] = []

    class StepTimer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            float(logs["mlm_loss_sum"])  # wait for the step (TF and JAX dispatch asynchronously)
            times.append(time.perf_counter() - self.t)

    compile_start = time.perf_counter()
    model.fit(data, epochs=1, steps_per_epoch=total, verbose=0, shuffle=False,
              callbacks=[StepTimer()])
    wall = time.perf_counter() - compile_start
    # Median: the typical step; best: what the machine does when nothing else competes for it.
    step_s, best_s = float(np.median(times[args.warmup:])), float(np.min(times[args.warmup:]))
    tokens_per_s = spec["batch"] * spec["seq"] / step_s
    fpt = flops_per_token(spec, non_embedding)
    out = {**spec, "backend": keras.backend.backend(), "policy": policy, "jit": jit,
           "params": model.count_params(), "non_embedding_params": non_embedding,
           "step_ms": round(step_s * 1e3, 2), "data_ms": round(data_s * 1e3, 2),
           "data_share": round(data_s / step_s, 3), "tokens_per_s": round(tokens_per_s),
           "tokens_per_s_best_step": round(spec["batch"] * spec["seq"] / best_s),
           "gflops_per_token": round(fpt / 1e9, 5),
           "achieved_tflops": round(tokens_per_s * fpt / 1e12, 4),
           "warmup_s": round(sum(times[:args.warmup]), 2), "wall_s": round(wall, 2)}
    if args.peak_tflops:
        out["mfu"] = round(tokens_per_s * fpt / (args.peak_tflops * 1e12), 4)
    return out


def bench_hf(spec: dict, args) -> dict | None:
    """The same architecture as a Hugging Face BertForMaskedLM on torch (CPU), dense MLM head."""
    try:
        import torch
        from transformers import BertConfig, BertForMaskedLM
    except ImportError:
        print("peer hf: torch/transformers are not installed; install the bench extra "
              "(pip install torch transformers) to compare", file=sys.stderr)
        return None
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=spec["vocab"], hidden_size=spec["hidden"],
                     num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                     intermediate_size=spec["ff"], max_position_embeddings=spec["seq"])
    model = BertForMaskedLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.from_numpy(synthetic_windows(np.random.default_rng(0), spec["batch"], spec["seq"],
                                             spec["vocab"])
                           .astype(np.int64))
    labels = torch.full_like(ids, -100)
    labels[:, 1:1 + spec["predictions"]] = ids[:, 1:1 + spec["predictions"]]
    times = []
    for _ in range(args.warmup + args.steps):
        t = time.perf_counter()
        loss = model(input_ids=ids, attention_mask=(ids != PAD_ID).long(), labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    step_s = float(np.median(times[args.warmup:]))
    return {"name": f"{spec['name']} (hf torch {torch.__version__}, "
                    f"{torch.get_num_threads()} threads)",
            "step_ms": round(step_s * 1e3, 2),
            "tokens_per_s": round(spec["batch"] * spec["seq"] / step_s)}


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
                   help="override the size's dropout (custom default 0.1); dropout's random "
                        "draws are a large share of a CPU step")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps (tracing, XLA compile)")
    p.add_argument("--jit", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--precision", choices=["auto", "off", "bf16"], default="auto")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="hardware peak, for MFU")
    p.add_argument("--peer", choices=["hf"], help="also time a Hugging Face BERT of the same size")
    p.add_argument("--json", action="store_true", help="print one JSON object per size")
    args = p.parse_args(argv)

    if args.config_4x256:
        args.size, args.heads = "custom", 4
        for k, v in REFERENCE.items():
            setattr(args, k, v)
    if args.size and args.dropout is None:
        args.dropout = 0.1
    names = ["custom"] if args.size else [s.strip() for s in args.sizes.split(",") if s.strip()]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# {os.cpu_count()} CPUs visible, 1-min load average {load:.2f} before the run; "
          "numbers drop when other jobs share the CPUs", file=sys.stderr)
    for name in names:
        spec = size_spec(name, args)
        result = bench_size(spec, args)
        if spec == {**spec, **REFERENCE}:
            result["target_tokens_per_s"] = REFERENCE_TARGET_TOKENS_PER_S
            result["meets_target"] = result["tokens_per_s"] >= REFERENCE_TARGET_TOKENS_PER_S
        print(json.dumps(result) if args.json else _line(result))
        if args.peer == "hf":
            peer = bench_hf(spec, args)
            if peer:
                print(json.dumps(peer) if args.json else _line(peer))
    return 0


def _line(r: dict) -> str:
    keys = ("name", "backend", "policy", "jit", "dropout", "params", "step_ms", "data_ms",
            "data_share", "tokens_per_s", "tokens_per_s_best_step",
            "gflops_per_token", "achieved_tflops", "mfu", "warmup_s", "meets_target")
    return "  ".join(f"{k}={r[k]}" for k in keys if k in r)


if __name__ == "__main__":
    sys.exit(main())
