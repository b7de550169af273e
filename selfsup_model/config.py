"""The typed pipeline configuration: one pydantic section per stage.

One `PipelineConfig` holds a section per stage. Prefect renders it as a form,
and each stage fingerprints only the sections that affect its output. Presets,
YAML files and `--set a.b=value` overrides are turned into one in
`selfsup_model.presets`; this module needs pydantic alone, so the training
path imports it without YAML.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

DEFAULT_WORKDIR = "data/runs/default"
SPLITS = ("train", "val", "test")  # the order every stage lists them in
# What `--corpus` names: a folder of class sub-folders, a table file, or the embedded docstrings.
CorpusFormat = Literal["auto", "folder", "table", "pydocs"]


def _words_from_yaml_booleans(value: object) -> object:
    """YAML reads on/off (and yes/no) as booleans, in `--set` values and config files alike:
    `--set finetune.jit=on` means the word."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


Switch = Annotated[Literal["auto", "on", "off"], BeforeValidator(_words_from_yaml_booleans)]
Precision = Annotated[Literal["auto", "off", "bf16"], BeforeValidator(_words_from_yaml_booleans)]

DEFAULT_PYDOCS_LIBRARIES = (
    "numpy", "pandas", "scipy", "sklearn", "tensorflow", "keras",
    "mlflow", "prefect", "sqlalchemy", "matplotlib",
)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _sums_to_one(section: str, names: tuple[str, ...], values: tuple[float, ...]) -> None:
    total = sum(values)
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"{' + '.join(f'{section}.{n}' for n in names)} must sum to 1 "
                         f"(got {total:g})")


class IngestConfig(_Section):
    min_chars: int = Field(
        40, ge=1, description="Documents shorter than this (after normalisation) are rejected.")
    max_chars: int = Field(200_000, ge=1, description="Longer documents are rejected as too_long.")
    text_column: str = "text"
    id_column: str = "id"
    label_column: str = "label"
    group_column: str = "group"
    pydocs_libraries: tuple[str, ...] = DEFAULT_PYDOCS_LIBRARIES
    pydocs_max_per_library: int | None = Field(
        None, ge=1,
        description="Keep at most this many docstrings per library: a deterministic sample "
                    "spread over the library by a hash of each id, in file order."
    )
    workers: int = Field(2, ge=1, le=64)

    @model_validator(mode="after")
    def _check(self) -> IngestConfig:
        if self.min_chars > self.max_chars:
            raise ValueError("ingest.min_chars must not exceed ingest.max_chars")
        return self


class DedupConfig(_Section):
    shingle: Literal["char", "word"] = "char"
    shingle_size: int = Field(5, ge=1, le=32)
    num_perm: int = Field(128, ge=16, le=1024)
    threshold: float = Field(0.8, gt=0.0, lt=1.0)
    batch_size: int = Field(2048, ge=1)
    seed: int = 1


class SplitConfig(_Section):
    train: float = Field(0.8, gt=0.0, lt=1.0)
    val: float = Field(0.1, gt=0.0, lt=1.0)
    test: float = Field(0.1, gt=0.0, lt=1.0)
    relatedness_threshold: float = Field(0.5, gt=0.0, lt=1.0)
    use_groups: bool = True
    stratify: bool = True
    seed: int = 7
    audit_action: Literal["fail", "warn"] = Field(
        "fail", description="What a leak does: val/test near-copies of train (the split's "
                            "audit) or of what a pretrain.init_from lineage pretrained on (the "
                            "tokenizer stage's check). 'fail' stops the run; 'warn' reports it.")

    @model_validator(mode="after")
    def _check(self) -> SplitConfig:
        _sums_to_one("split", ("train", "val", "test"), (self.train, self.val, self.test))
        return self


class TokenizerConfig(_Section):
    kind: Literal["wordpiece", "bpe"] = "wordpiece"
    vocab_size: int = Field(8192, ge=64, le=262_144)
    lowercase: bool = True
    min_frequency: int = Field(2, ge=1)


class EncodeConfig(_Section):
    max_len: int = Field(128, ge=8, le=8192,
                         description="Tokens per sequence including [CLS]/[SEP].")
    overlap: int = Field(32, ge=0,
                         description="Tokens shared by consecutive windows of a long document.")
    max_windows_per_doc: int = Field(
        8, ge=1,
        description="Pretraining windows kept per document (the rest are counted as truncated).")
    batch_size: int = Field(2048, ge=1)

    @model_validator(mode="after")
    def _check(self) -> EncodeConfig:
        if self.overlap >= self.max_len - 2:
            raise ValueError("encode.overlap must be smaller than encode.max_len - 2")
        return self


class MaskingConfig(_Section):
    select_rate: float = Field(0.15, gt=0.0, le=1.0)
    mask_rate: float = Field(0.8, ge=0.0, le=1.0)
    random_rate: float = Field(0.1, ge=0.0, le=1.0)
    keep_rate: float = Field(0.1, ge=0.0, le=1.0)
    selection: Literal["fixed", "bernoulli"] = "fixed"
    max_predictions: int = Field(
        20, ge=1,
        description="Selected positions kept per sequence (the gathered MLM head's width).")
    empty_policy: Literal["force_one", "skip"] = "force_one"
    seed: int = 1234

    @model_validator(mode="after")
    def _check(self) -> MaskingConfig:
        _sums_to_one("masks", ("mask_rate", "random_rate", "keep_rate"),
                     (self.mask_rate, self.random_rate, self.keep_rate))
        return self


class ModelConfig(_Section):
    hidden: int = Field(256, ge=2)
    layers: int = Field(4, ge=1)
    heads: int = Field(4, ge=1)
    ff: int = Field(1024, ge=2)
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    norm: Literal["post", "pre"] = "post"
    tie_embeddings: bool = True

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.hidden % self.heads:
            raise ValueError("model.hidden must be divisible by model.heads")
        return self


class PretrainConfig(_Section):
    objective: Literal["mlm", "clm", "rtd"] = Field(
        "mlm",
        description="mlm: masked-LM (the selected positions are predicted); clm: causal-LM "
                    "(every next token); rtd: replaced-token detection (ELECTRA): a small "
                    "generator, sharing the token embeddings, fills the selected positions "
                    "with samples and the encoder learns to tell, for every real token, "
                    "whether it was replaced.")
    generator_blocks: int = Field(
        1, ge=1, description="rtd: encoder blocks of the generator (shaped like the model's).")
    rtd_weight: float = Field(
        50.0, gt=0.0, description="rtd: weight of the detection loss beside the generator's "
                                  "masked-LM loss (ELECTRA: 50).")
    batch_size: int = Field(32, ge=1)
    steps: int = Field(2000, ge=1,
                       description="Optimiser steps (the budget), unless max_tokens is set.")
    max_tokens: int | None = Field(None, ge=1,
                                   description="Budget in input tokens; overrides steps.")
    learning_rate: float = Field(5e-4, gt=0.0)
    warmup_steps: int = Field(100, ge=0)
    decay: Literal["cosine", "linear"] = "cosine"
    weight_decay: float = Field(0.01, ge=0.0)
    clip_norm: float = Field(1.0, gt=0.0)
    log_every: int = Field(50, ge=1)
    eval_every: int = Field(500, ge=1)
    checkpoint_every: int = Field(500, ge=1)
    static_train_masks: bool = False
    mixed_precision: Precision = "auto"
    jit: Switch = "auto"
    length_buckets: int = Field(
        1, ge=1, le=64,
        description="Train on batches trimmed to a few fixed lengths: this many equal slices of "
                    "encode.max_len (rounded up to multiples of 8); each window goes in the "
                    "shortest that holds its real tokens, so less padding is computed. "
                    "1: every batch at max_len.")
    packing: bool = Field(
        False,
        description="Pack several training windows into each row of encode.max_len positions "
                    "(best fit, longest first) instead of padding each to its own row: almost "
                    "no padding is computed and every batch has one shape. Attention stays "
                    "within each window's document and positions restart at its [CLS]. "
                    "Needs length_buckets=1, no contrastive term and dynamic masks.")
    contrastive_weight: float = Field(
        0.0, ge=0.0,
        description="Weight of a same-document contrastive term added to the objective's loss: "
                    "each batch holds batch_size/2 pairs of windows of one document (a "
                    "one-window document pairs with itself, corrupted twice), and the pooled "
                    "final states of a pair are pulled together against the batch's other "
                    "windows (InfoNCE). 0: the objective's loss alone.")
    contrastive_temperature: float = Field(0.05, gt=0.0, le=1.0,
                                           description="InfoNCE temperature of that term.")
    embedding_init: Literal["random", "cooccurrence"] = Field(
        "random",
        description="How a fresh encoder's token embeddings start. random: the truncated normal "
                    "of every other weight; cooccurrence: the top model.hidden dimensions of "
                    "the SVD of the training windows' positive PMI matrix (pairs of tokens up "
                    "to 4 apart, weighted 1/distance), at the random rows' scale. Seconds on "
                    "the demo; not used when continuing another encoder.")
    seed: int = 42
    init_from: str | None = Field(
        None, description="Continue pretraining from another selfsup run: its workdir or its "
                          "pretrain/encoder.keras. Its tokenizer is reused, not refitted, "
                          "after checking that none of this run's val/test documents is a "
                          "near-copy of what that run's lineage pretrained on.")
    versions: Literal["continue", "scratch"] = Field(
        "continue",
        description="How a later version of a grown corpus pretrains (docs/operations.md, \"A "
                    "corpus that grows\"). continue: from the last version's encoder, over the "
                    "version's new training documents plus a replay sample of earlier ones, "
                    "with the warm-up run again and the budget scaled to those windows; "
                    "scratch: from random initialisation on the whole training split, as a "
                    "first version does (the control). init_from, when set, wins.")
    replay: float = Field(
        1.0, ge=0.0,
        description="Continuing a version: earlier training documents replayed per new one (a "
                    "seeded sample; 0: the new documents alone).")

    @model_validator(mode="after")
    def _check_pairs(self) -> PretrainConfig:
        if self.contrastive_weight > 0 and (self.batch_size < 4 or self.batch_size % 2):
            raise ValueError("pretrain.contrastive_weight > 0 pairs windows: pretrain.batch_size "
                             f"must be even and at least 4, got {self.batch_size}")
        clash = [name for name, on in (("pretrain.length_buckets > 1", self.length_buckets > 1),
                                       ("pretrain.contrastive_weight > 0",
                                        self.contrastive_weight > 0),
                                       ("pretrain.static_train_masks", self.static_train_masks))
                 if on]
        if self.packing and clash:
            raise ValueError(f"pretrain.packing fills rows with whole windows; it cannot be "
                             f"combined with {' or '.join(clash)}")
        return self


class FinetuneConfig(_Section):
    fractions: tuple[float, ...] = (0.05, 0.25, 1.0)
    max_len: int | None = Field(
        None, ge=4, description="Classifiers read windows cut to max_len tokens (None: whole "
                                "windows).")
    read_windows: Literal["all", "first"] = Field(
        "all", description="How every classifier reads a document. all: every window; each "
                           "trains as a row carrying the document's label, and a document is "
                           "predicted as the class of highest mean probability over its "
                           "windows (as `selfsup predict` does). first: the first window "
                           "only. The update budget counts documents either way.")
    modes: tuple[Literal["probe", "full", "staged"], ...] = ("probe", "full", "staged")
    pooling: Literal["mean", "cls", "last"] = Field(
        "mean", description="mean: over real tokens; cls: the first state (bidirectional "
                            "encoders only); last: the last real token's state.")
    # The fair protocol: every neural method (pretrained full/staged, random_init, bag of
    # embeddings) searches the same grid with the same update budget and early stopping.
    learning_rates: tuple[float, ...] = Field(
        (3e-4, 1e-3, 3e-3), description="Peak learning rates every neural method tries; the best "
                                        "on validation macro-F1 is kept.")
    layer_decays: tuple[float, ...] = Field(
        (1.0,), description="Layer-wise learning-rate decay every neural method tries with each "
                            "rate (chosen on validation together): a variable d layers below "
                            "the top (the head) learns at decay ** d times the rate. 1.0: none.")
    batch_size: int = Field(32, ge=1)
    epochs: int = Field(4, ge=1, description="Updates for this many passes over the training "
                                             "subset's documents ...")
    min_updates: int = Field(200, ge=1, description="... but at least this many updates ...")
    max_updates: int = Field(2000, ge=1, description="... and at most this many.")
    warmup_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    evals: int = Field(8, ge=1, description="Validation checks over a run's update budget.")
    patience: int = Field(3, ge=1, description="Checks without improvement before stopping.")
    weight_decay: float = Field(0.01, ge=0.0)
    dropout: float = Field(0.1, ge=0.0, lt=1.0, description="Dropout before the head.")
    encoder_dropout: float = Field(
        0.1, ge=0.0, lt=1.0, description="Dropout inside the encoder while it fine-tunes "
                                         "(pretrained and random_init alike).")
    staged_top_blocks: int = Field(1, ge=1, description="Blocks the second staged stage unfreezes.")
    staged_final_lr_scale: float = Field(0.3, gt=0.0, le=1.0,
                                         description="The last staged stage's rate, relative.")
    probe_c: tuple[float, ...] = Field((0.001, 0.01, 0.1, 1.0, 10.0, 100.0),
                                       description="C grid of the frozen-feature linear probe.")
    eval_batch_size: int = Field(256, ge=1)
    jit: Switch = Field(
        "auto", description="XLA for the classifiers' train and predict steps; auto: on a GPU "
                            "or under JAX (as pretrain.jit).")
    subset_seed: int = Field(3, description="Seed of the label subsets every method shares.")
    seeds: tuple[int, ...] = Field(
        (0,), description="Training seeds: the rate grid runs with the first, the rate it chose "
                          "with every other.")
    repeat_seeds_up_to: float = Field(
        1.0, gt=0.0, le=1.0, description="Label fractions above this train with the first seed "
                                         "only.")

    @model_validator(mode="after")
    def _check(self) -> FinetuneConfig:
        if not self.fractions or any(not (0.0 < f <= 1.0) for f in self.fractions):
            raise ValueError("finetune.fractions must be non-empty values in (0, 1]")
        if not self.learning_rates or min(self.learning_rates) <= 0:
            raise ValueError("finetune.learning_rates must be non-empty positive values")
        if not self.layer_decays or not all(0 < d <= 1 for d in self.layer_decays):
            raise ValueError("finetune.layer_decays must be non-empty values in (0, 1]")
        if not self.seeds or not self.probe_c or min(self.probe_c) <= 0:
            raise ValueError("finetune.seeds and finetune.probe_c (positive) must be non-empty")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError("finetune.seeds must not repeat a seed")
        if self.min_updates > self.max_updates:
            raise ValueError("finetune.min_updates must not exceed finetune.max_updates")
        return self

    def seeds_at(self, fraction: float) -> tuple[int, ...]:
        """Training seeds at one label fraction."""
        return self.seeds if fraction <= self.repeat_seeds_up_to else self.seeds[:1]


class BaselineConfig(_Section):
    tfidf_c: tuple[float, ...] = (0.1, 1.0, 10.0, 100.0)
    tfidf_ngram_max: tuple[int, ...] = Field(
        (1, 2), description="Word n-gram orders 1..n tried (word features).")
    tfidf_sublinear: tuple[bool, ...] = Field(
        (True,), description="Term frequency as 1 + log(tf) (true) or raw (false); each tried.")
    tfidf_features: tuple[Literal["word", "char", "word+char"], ...] = Field(
        ("word", "char"), description="TF-IDF features tried: word n-grams, character 2-5-grams "
                                      "within word boundaries (identifiers read in pieces), or "
                                      "both side by side. Validation chose characters at 3 of "
                                      "the 4 points of the demo and the second corpus.")
    random_init: bool = True
    majority: bool = True
    bag_of_embeddings: bool = True
    bag_dim: int = Field(64, ge=1)
    bag_rate_multiplier: float = Field(
        300.0, gt=0.0, description="The bag's token vectors learn this many times faster than "
                                  "the shared grid's rate (sparse rows; see bag_of_embeddings).")
    sentence_embeddings: Switch = Field(
        "auto",
        description="auto: run when the `embeddings` extra is installed; on: fail without it.")
    sentence_c: tuple[float, ...] = (0.1, 1.0, 10.0, 100.0)
    embed_batch_size: int = Field(64, ge=1)


class CompareConfig(_Section):
    bootstrap: int = Field(1000, ge=10)
    seed: int = 5
    ensemble_weights: tuple[float, ...] = Field(
        tuple(i / 10 for i in range(11)),
        description="Weights w the ensemble row tries (chosen on validation macro-F1): a "
                    "document's class is the arg-max of w x the best pretrained method's "
                    "probabilities + (1 - w) x TF-IDF's. Empty: no ensemble row.")

    @model_validator(mode="after")
    def _check(self) -> CompareConfig:
        if any(not 0 <= w <= 1 for w in self.ensemble_weights):
            raise ValueError("compare.ensemble_weights must lie in [0, 1]")
        return self


class PipelineConfig(_Section):
    """Everything that shapes a run's outputs."""

    experiment: str = "selfsup"
    registered_model: str | None = Field(
        "selfsup-classifier", min_length=1,
        description="MLflow Model Registry name the kept classifier is registered under "
                    "(null: log the model on the finetune run without registering it)")
    logged_model: Literal["keras", "onnx"] = Field(
        "keras", description="What the logged MLflow model scores with: keras (classifier.keras) "
                             "or onnx (the same classifier as an ONNX model, scored by ONNX "
                             "Runtime; needs the export extra). Takes effect when finetune runs.")
    ingest: IngestConfig = IngestConfig()
    dedup: DedupConfig = DedupConfig()
    split: SplitConfig = SplitConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    encode: EncodeConfig = EncodeConfig()
    masks: MaskingConfig = MaskingConfig()
    model: ModelConfig = ModelConfig()
    pretrain: PretrainConfig = PretrainConfig()
    finetune: FinetuneConfig = FinetuneConfig()
    baseline: BaselineConfig = BaselineConfig()
    compare: CompareConfig = CompareConfig()
