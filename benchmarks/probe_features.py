"""What the linear probe reads: validation (and test) macro-F1 of other frozen-feature poolings.

    .venv/bin/python benchmarks/probe_features.py --workdir data/runs/default

Reads a finished run (encode and pretrain done), runs its frozen encoder once over the
windows the probe reads (inference mode) and keeps each layer's states pooled several ways.
Each variant then gets the probe's own fit (`transfer.features_probe`: standardised on the
training subset's windows, C tuned on validation, a document predicted from the mean
probability of its windows) at every label fraction of the demo:

- ``last``: the masked mean of the final states, what the probe ships with;
- ``layers``: that mean for the embeddings' output and every block's, concatenated;
- ``emb+last``: the embeddings' mean beside the final states' mean;
- ``weighted``: the final states averaged with weight a / (a + p(token)), p each token's
  frequency in the training split's windows (unlabelled text) and a = 1e-3, specials left
  out: frequent words count less;
- ``doc-mean``: ``last`` averaged over each document's windows, one training row per document.

Validation decides; test is printed beside it so a reader can see whether validation's
preference carries over, not to choose by it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import keras
import numpy as np

from selfsup_model.nn.saving import load_keras_model
from selfsup_model.presets import build_config
from selfsup_model.report.metrics import macro_f1
from selfsup_model.text.specials import SPECIAL_TOKENS
from selfsup_model.text.windows import mean_over_documents
from selfsup_model.transfer.classify import encoder_inputs
from selfsup_model.transfer.protocol import SPLITS, features_probe, label_subsets, load_labelled

SIF_A = 1e-3


def layer_states(backbone: keras.Model) -> keras.Model:
    """ids -> [embeddings' output, each block's output but the last, final states]."""
    names = [layer.name for layer in backbone.layers]
    taps = ["embeddings_dropout", *[n for n in names if n.startswith("block_")][:-1], names[-1]]
    return keras.Model(backbone.input, [backbone.get_layer(n).output for n in taps])


def pooled_features(model: keras.Model, windows: np.ndarray, token_weight: np.ndarray,
                    batch_size: int = 256) -> dict[str, np.ndarray]:
    """Per variant, (rows, d) features of framed windows (rows, L)."""
    out: dict[str, list[np.ndarray]] = {"mean": [], "weighted": []}
    for lo in range(0, len(windows), batch_size):
        ids = windows[lo:lo + batch_size]
        states = model.predict_on_batch(ids)  # [(B, L, H)] per tapped layer
        real = (ids != 0).astype(np.float32)  # [PAD] is id 0
        weight = token_weight[ids] * (ids >= len(SPECIAL_TOKENS))
        out["mean"].append(np.concatenate(
            [(s * real[..., None]).sum(1) / real.sum(1, keepdims=True) for s in states], 1))
        out["weighted"].append((states[-1] * weight[..., None]).sum(1)
                               / np.maximum(weight.sum(1, keepdims=True), 1e-9))
    return {name: np.concatenate(parts).astype(np.float32) for name, parts in out.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, help="a run with encode and pretrain done")
    args = p.parse_args(argv)
    wd = Path(args.workdir)
    cfg = build_config("demo").finetune
    data = load_labelled(wd / "encode", cfg.max_len)
    if data is None:
        raise SystemExit(f"{wd} has nothing to classify")
    backbone = load_keras_model(wd / "pretrain" / "encoder.keras")  # safe_mode=True
    train_windows = np.load(wd / "encode" / "train_windows.npy", mmap_mode="r")
    vocab = backbone.get_layer("embeddings").get_config()["vocab_size"]
    counts = np.zeros(vocab, np.float64)
    for lo in range(0, len(train_windows), 4096):  # chunked: bounded memory
        counts += np.bincount(np.asarray(train_windows[lo:lo + 4096]).ravel(), minlength=vocab)
    token_weight = (SIF_A / (SIF_A + counts / counts.sum())).astype(np.float32)

    used = np.unique(np.concatenate([subset for _, subset in label_subsets(data, cfg)]))
    read = {"train": used, **{s: np.arange(len(data.splits[s].ids)) for s in ("val", "test")}}
    inputs = {s: data.splits[s].windows_of(docs, cfg.read_windows == "all")
              for s, docs in read.items()}
    owners = {s: inputs[s][1] for s in SPLITS}
    owners["train"] = used[owners["train"]]
    model = layer_states(backbone)
    pooled = {s: pooled_features(model, encoder_inputs(backbone, inputs[s][0]), token_weight)
              for s in SPLITS}
    hidden = pooled["train"]["weighted"].shape[1]
    variants = {
        "last": ({s: pooled[s]["mean"][:, -hidden:] for s in SPLITS}, owners),
        "layers": ({s: pooled[s]["mean"] for s in SPLITS}, owners),
        "emb+last": ({s: np.concatenate([pooled[s]["mean"][:, :hidden],
                                         pooled[s]["mean"][:, -hidden:]], 1) for s in SPLITS},
                     owners),
        "weighted": ({s: pooled[s]["weighted"] for s in SPLITS}, owners),
        "doc-mean": ({s: mean_over_documents(pooled[s]["mean"][:, -hidden:], inputs[s][1],
                                             len(read[s])) for s in SPLITS},
                     {"train": used}),  # one row per document, its own index
    }
    test = data.splits["test"]
    print("variant    dim  fraction  C        val_macro_f1  test_macro_f1")
    for name, (features, own) in variants.items():
        res = features_probe(name, data, features, cfg.probe_c, cfg, standardize=True,
                             owners=own)
        predicted = {}
        for doc_id, _, fraction, _, label in res.rows:
            predicted.setdefault(fraction, {})[doc_id] = label
        for summary in res.summaries:
            fraction = summary["fraction"]
            test_f1 = macro_f1(test.labels, np.array([predicted[fraction][i] for i in test.ids]))
            print(f"{name:9s} {features['train'].shape[1]:4d}  {fraction:8g}  "
                  f"{summary['params']['C']:<7g}  {summary['val_macro_f1']:12.4f}  "
                  f"{test_f1:13.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
