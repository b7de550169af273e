"""Continued (domain-adaptive) pretraining: start from another selfsup run's encoder.

`pretrain.init_from` names that run's workdir or its `pretrain/encoder.keras`.
The new run keeps the source's tokenizer and special-token ids (the tokenizer
stage copies it instead of fitting one), and pretraining starts from the
source's weights, objective head included. Only files the source pipeline
wrote and recorded in its manifests are loaded, and only while their bytes
still match the recorded sha256. A checkpoint that does not fit the run (another
vocabulary, architecture, objective or tokenizer) is refused with the reason.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import keras

from selfsup_model.artifacts import MANIFEST_NAME, StageManifest, cached_sha256
from selfsup_model.config import ModelConfig
from selfsup_model.errors import ArtifactError, UserError
from selfsup_model.nn.layers import TransformerEncoderBlock
from selfsup_model.nn.model import token_embedding_of


@dataclasses.dataclass(frozen=True)
class InitSource:
    workdir: Path
    tokenizer: Path
    pretrain_model: Path  # backbone + objective head
    tokenizer_sha256: str
    pretrain_model_sha256: str
    encoder_sha256: str

    def describe(self) -> str:
        return f"{self.workdir} (encoder.keras sha256 {self.encoder_sha256[:12]})"


def resolve_init_source(init_from: str) -> InitSource:
    """The run `init_from` names, with its tokenizer and pretrained model verified by hash."""
    path = Path(init_from).expanduser()
    if path.is_file() and path.suffix == ".keras" and path.parent.name == "pretrain":
        workdir = path.parent.parent
    elif path.is_dir():
        workdir = path
    else:
        raise UserError(f"pretrain.init_from={init_from!r} is neither a selfsup workdir nor its "
                        "pretrain/encoder.keras")
    files = {name: recorded_file(workdir, stage, name, "pretrain.init_from")
             for stage, name in (("tokenizer", "tokenizer.json"),
                                 ("pretrain", "pretrain_model.keras"),
                                 ("pretrain", "encoder.keras"))}
    return InitSource(workdir.resolve(), files["tokenizer.json"][0],
                      files["pretrain_model.keras"][0], files["tokenizer.json"][1],
                      files["pretrain_model.keras"][1], files["encoder.keras"][1])


def recorded_manifest(workdir: Path, stage: str, what: str) -> StageManifest:
    """The manifest of `workdir`'s finished `stage`; a UserError naming `what` needed it."""
    manifest_path = workdir / stage / MANIFEST_NAME
    if not manifest_path.is_file():
        raise UserError(f"{what}: {workdir} has no finished {stage} stage "
                        f"({manifest_path} is missing)")
    return StageManifest.read(manifest_path)


def recorded_file(workdir: Path, stage: str, name: str, what: str) -> tuple[Path, str]:
    """(path, sha256) of a file `stage` wrote in `workdir`, only while its bytes still match the
    sha256 the stage recorded (hashed once per process while its size and mtime stay, as the
    stage runner verifies its own inputs: the parameters of two stages and two computes ask)."""
    record = recorded_manifest(workdir, stage, what).outputs.get(name)
    file = workdir / stage / name
    if record is None or not file.is_file() or cached_sha256(file) != record.sha256:
        raise ArtifactError(f"{what}: {file} is missing or no longer matches the "
                            "sha256 its run recorded; refusing to load it")
    return file, record.sha256


def lineage(source: Path) -> tuple[list[Path], str | None]:
    """`source` and every run it continued, nearest first: the runs whose pretraining the
    source's encoder carries (each tokenizer manifest's `reused_from` names the one before).

    The walk stops at an ancestor whose workdir no longer holds a finished tokenizer stage and
    says why as the second item (None when the whole lineage was found); a cycle raises
    UserError."""
    runs: list[Path] = []
    run: Path | None = source.resolve()
    while run is not None:
        if run in runs:
            raise UserError("pretrain.init_from: the runs' continued-pretraining sources form a "
                            f"cycle: {' -> '.join(map(str, [*runs, run]))}")
        try:
            manifest = recorded_manifest(run, "tokenizer", "pretrain.init_from's lineage")
        except UserError as err:
            if not runs:
                raise
            return runs, f"{runs[-1]} continued pretraining from {run}, which cannot be read: {err}"
        runs.append(run)
        parent = manifest.counts.get("reused_from") or ""
        run = Path(parent).resolve() if parent else None
    return runs, None


def check_compatible(backbone: keras.Model, *, vocab_size: int, max_len: int, causal: bool,
                     model_cfg: ModelConfig, tokenizer_sha256: str, source: InitSource,
                     head_tied: bool | None = None) -> None:
    """Refuse, with the reason, a checkpoint that does not fit this run (`head_tied`: whether
    its objective head shares the token embedding, when the head continues too)."""
    if tokenizer_sha256 != source.tokenizer_sha256:
        raise UserError(f"this run's tokenizer (sha256 {tokenizer_sha256[:12]}) is not the one "
                        f"{source.describe()} was trained with ({source.tokenizer_sha256[:12]}); "
                        "continued pretraining must keep the checkpoint's tokenizer "
                        "(rerun with --force tokenizer)")
    embedding = token_embedding_of(backbone)
    if embedding.vocab_size != vocab_size:
        raise UserError(f"the checkpoint's vocabulary has {embedding.vocab_size} ids but the "
                        f"tokenizer {vocab_size}: they do not belong together")
    if embedding.max_len < max_len:
        raise UserError(f"the checkpoint has {embedding.max_len} learned positions but this run's "
                        f"windows have {max_len}; set encode.max_len <= {embedding.max_len}")
    blocks = [layer for layer in backbone.layers if isinstance(layer, TransformerEncoderBlock)]
    found = {"hidden": embedding.hidden, "layers": len(blocks), "heads": blocks[0].heads,
             "ff": blocks[0].ff, "norm": blocks[0].norm}
    if head_tied is not None:
        found["tie_embeddings"] = head_tied
    wanted = {key: getattr(model_cfg, key) for key in found}
    differ = [f"model.{k}={wanted[k]} (checkpoint: {found[k]})" for k in found
              if found[k] != wanted[k]]
    if differ:
        raise UserError(f"the settings differ from {source.describe()}: {', '.join(differ)}; "
                        "set them to the checkpoint's")
    if blocks[0].causal != causal:
        objective = "clm" if blocks[0].causal else "mlm"
        raise UserError(f"the checkpoint was pretrained with the {objective} objective; set "
                        f"pretrain.objective={objective} to continue it")
