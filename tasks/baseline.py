"""baseline: TF-IDF + logistic regression, majority class, the same encoder from random init,
a bag of embeddings, and (with the `embeddings` extra) a pretrained sentence-embedding probe."""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd

from selfsup_model.corpus.splitting import SPLITS
from selfsup_model.errors import UserError
from selfsup_model.nn.model import build_backbone
from selfsup_model.pretraining.devices import resolve_precision
from selfsup_model.text.tokenization import load_tokenizer
from selfsup_model.transfer.protocol import (
    LabelledData,
    MethodResults,
    NeuralMethod,
    features_probe,
    load_labelled,
    scratch_baselines,
    summary_metrics,
    text_baselines,
    train_neural_methods,
    write_method_results,
)
from selfsup_model.transfer.sentence_embeddings import (
    SENTENCE_METHOD,
    embed_texts,
    sentence_embedding_status,
)
from tasks.joined import invite
from tasks.stage import RunContext, StageOutput, progress_logger

log = logging.getLogger("selfsup.baseline")


def sentence_baseline(data: LabelledData, texts: pd.Series,
                      ctx: RunContext) -> tuple[MethodResults, dict]:
    """Pretrained MiniLM sentence embeddings + logistic regression; reported as unavailable
    without the extra."""
    cfg = ctx.config.baseline
    if cfg.sentence_embeddings == "off":
        return MethodResults(), {SENTENCE_METHOD: "disabled (baseline.sentence_embeddings=off)"}
    available, reason = sentence_embedding_status()
    if not available:
        if cfg.sentence_embeddings == "on":
            raise UserError(f"baseline.sentence_embeddings=on but {reason}")
        log.warning("%s not run: %s", SENTENCE_METHOD, reason)
        return MethodResults(), {SENTENCE_METHOD: reason}
    # keyed by text hash; survives stage reruns
    cache = ctx.workdir / ".cache" / "sentence_embeddings"
    features, embed_time = {}, 0.0
    for split in SPLITS:
        out = embed_texts(texts.loc[data.splits[split].ids].tolist(), cache, cfg.embed_batch_size,
                          progress=progress_logger(log, f"embedding {split}"))
        features[split], embed_time = out.vectors, embed_time + out.embed_time_s
    return features_probe(SENTENCE_METHOD, data, features, cfg.sentence_c, ctx.config.finetune,
                          embed_time), {}


def compute(ctx: RunContext, out: Path, inputs: dict[str, Path]) -> StageOutput:
    cfg = ctx.config
    data = load_labelled(ctx.stage_dir("encode"), cfg.finetune.max_len)
    if data is None:
        reason = "the corpus has fewer than two labels in the training split"
        return StageOutput(write_method_results(out, MethodResults(), skipped=reason),
                           {"skipped": 1, "runs": 0})
    texts = (pd.read_parquet(inputs["ingest/documents.parquet"], columns=["id", "text"])
             .set_index("id")["text"])
    results = text_baselines(data, texts, cfg.baseline, cfg.finetune)
    invite("baseline")  # other training processes, if any, join in (`follow`)
    methods = _neural_methods(ctx, data, inputs["tokenizer/tokenizer.json"])
    results.extend(train_neural_methods(data, methods, cfg.finetune)[0])
    sentence, unavailable = sentence_baseline(data, texts, ctx)
    results.extend(sentence)
    files = write_method_results(out, results, classes=data.classes, unavailable=unavailable)
    return StageOutput(files, {**data.counts, "runs": len(results.summaries),
                               "unavailable_methods": len(unavailable)},
                       summary_metrics(results.summaries))


def _neural_methods(ctx: RunContext, data: LabelledData,
                    tokenizer_path: Path) -> list[NeuralMethod]:
    """random_init (exactly the pretrained architecture, causal too, in the precision
    pretraining built the encoder in: bf16 on a GPU under `auto`) and the bag of embeddings."""
    cfg = ctx.config
    vocab = load_tokenizer(tokenizer_path).get_vocab_size()
    causal = cfg.pretrain.objective == "clm"
    dtype = resolve_precision(cfg.pretrain.mixed_precision)

    def random_init():
        return build_backbone(vocab, data.window_len, cfg.model, causal=causal, dtype=dtype)

    return scratch_baselines(vocab, data.window_len, random_init, cfg.baseline)


def follow(ctx: RunContext) -> None:
    """A training process other than 0, invited by process 0: train the neural baselines with
    it (a shared workdir), writing nothing."""
    cfg = ctx.config
    data = load_labelled(ctx.stage_dir("encode"), cfg.finetune.max_len)
    assert data is not None  # process 0 invites only when there is something to classify
    methods = _neural_methods(ctx, data, ctx.artifact("tokenizer/tokenizer.json"))
    train_neural_methods(data, methods, cfg.finetune)
