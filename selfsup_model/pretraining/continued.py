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
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from selfsup_model.artifacts import MANIFEST_NAME, StageManifest, cached_sha256
from selfsup_model.config import ModelConfig
from selfsup_model.errors import ArtifactError, UserError

if TYPE_CHECKING:  # Keras loads with the model check: the tokenizer stage's checks need none
    import keras


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
        run = reused_source(run, parent) if parent else None
    return runs, None


def reused_source(run: Path, reused_from: str) -> Path:
    """The run a tokenizer manifest's `reused_from` names: an absolute workdir (init_from), or a
    corpus version's snapshot relative to the workdir that holds `run` (`flows.versions`: the
    nearest folder, `run` or above, with a versions/lineage.json)."""
    path = Path(reused_from)
    if path.is_absolute():
        return path.resolve()
    root = next((p for p in (run, *run.parents) if (p / "versions" / "lineage.json").is_file()),
                run)
    return (root / path).resolve()


@dataclasses.dataclass(frozen=True)
class Continuation:
    """What a later corpus version pretrains on when it continues the last version's encoder:
    `rows`, the training windows (new documents' and a replay sample's, in corpus order), and
    `doc_offsets` ((docs + 1,), where each selected document's windows start among them)."""

    rows: np.ndarray
    doc_offsets: np.ndarray
    new_documents: int
    replayed_documents: int


def continuation_windows(doc_offsets: np.ndarray, earlier: np.ndarray, replay: float,
                         seed: int, batch_size: int) -> Continuation:
    """Every window of the documents that are new (`~earlier`, one flag per document of
    `doc_offsets`) and of a seeded sample of round(replay x new) earlier documents (all of them
    when fewer). A version with no new training document replays documents enough for one batch
    (at least one), so that the encoder still meets this version's data."""
    offsets = np.asarray(doc_offsets, dtype=np.int64)
    earlier = np.asarray(earlier, dtype=bool)
    if len(earlier) != len(offsets) - 1:
        raise ValueError(f"{len(earlier)} document flags for {len(offsets) - 1} documents")
    new, old = np.flatnonzero(~earlier), np.flatnonzero(earlier)
    wanted = round(replay * len(new)) if len(new) else max(batch_size, 1)
    replayed = np.random.default_rng(seed).choice(old, size=min(len(old), wanted), replace=False)
    docs = np.sort(np.concatenate([new, replayed]))
    lengths = offsets[1:][docs] - offsets[:-1][docs]
    kept = np.concatenate([[0], np.cumsum(lengths)])
    rows = np.repeat(offsets[:-1][docs] - kept[:-1], lengths) + np.arange(kept[-1])
    return Continuation(rows, kept, len(new), len(replayed))


def continuation_budget(full_steps: int, warmup_steps: int, windows: int,
                        all_windows: int) -> tuple[int, int]:
    """(steps, warm-up steps) of a continued version: the first version's schedule scaled to the
    share of the training windows it trains on (at least one step), warm-up included."""
    steps = max(1, math.ceil(full_steps * windows / max(all_windows, 1)))
    warmup = max(1, round(warmup_steps * steps / full_steps)) if warmup_steps else 0
    return steps, min(warmup, steps)


def check_compatible(backbone: keras.Model, *, vocab_size: int, max_len: int, causal: bool,
                     model_cfg: ModelConfig, tokenizer_sha256: str, source: InitSource,
                     head_tied: bool | None = None) -> None:
    """Refuse, with the reason, a checkpoint that does not fit this run (`head_tied`: whether
    its objective head shares the token embedding, when the head continues too)."""
    from selfsup_model.nn.layers import TransformerEncoderBlock
    from selfsup_model.nn.model import token_embedding_of

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
