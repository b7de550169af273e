"""The stages in pipeline order: one source of truth for names, specs and tasks."""

from __future__ import annotations

from tasks import (
    baseline,
    compare,
    dedup,
    encode,
    finetune,
    ingest,
    masks,
    pretrain,
    split,
    tokenizer,
)

# (spec, task) in the order the pipeline runs them.
PIPELINE = [
    (ingest.SPEC, ingest.ingest_task),
    (dedup.SPEC, dedup.dedup_task),
    (split.SPEC, split.split_task),
    (tokenizer.SPEC, tokenizer.tokenizer_task),
    (encode.SPEC, encode.encode_task),
    (masks.SPEC, masks.masks_task),
    (pretrain.SPEC, pretrain.pretrain_task),
    (finetune.SPEC, finetune.finetune_task),
    (baseline.SPEC, baseline.baseline_task),
    (compare.SPEC, compare.compare_task),
]
STAGE_NAMES: tuple[str, ...] = tuple(spec.name for spec, _ in PIPELINE)
SPECS = {spec.name: spec for spec, _ in PIPELINE}
TASKS = {spec.name: task for spec, task in PIPELINE}
