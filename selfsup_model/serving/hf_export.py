"""A finished masked-LM run as a Hugging Face `transformers` checkpoint directory.

What the export writes (no torch needed: the weights are written with numpy):

    config.json              the architecture that computes what ours computes (below)
    model.safetensors        the encoder and its masked-LM head, float32
    tokenizer.json           the run's tokenizer, with selfsup's document normalisation and the
                             [CLS] ... [SEP] framing, so `AutoTokenizer` ids are ours
    tokenizer_config.json    the special tokens, the model's length, no token type ids
    special_tokens_map.json
    README.md                the model card: what it was pretrained on, its validation loss
                             with the scored-token count, the run it came from
    selfsup_export.json      provenance: the run's files it was made from and their sha256,
                             and the sha256 of every file above

The architecture is chosen by the encoder's layout, and each is exact, not an approximation:

* post-LN (a LayerNorm after the embeddings and after each residual): BERT
  (`BertForMaskedLM`);
* pre-LN (no embedding LayerNorm, a LayerNorm before attention and before the feed-forward of
  each block, a final LayerNorm): Megatron-BERT (`MegatronBertForMaskedLM`).

Both read learned absolute positions from 0, hide [PAD] keys through the attention mask the
tokenizer returns, use the tanh GELU (`gelu_pytorch_tanh`) and our LayerNorm epsilon (1e-6).
The fused (H, 3H) query/key/value kernel is split into the three (H, H) projections (its
columns are query, key, value, each head by head); Keras kernels (in, out) become torch
weights (out, in); the token-type embedding is one zero row (`type_vocab_size` 1: we have no
segments); the head's transform, LayerNorm and bias map to `cls.predictions`, its vocabulary
projection tied to the token embedding (`tie_word_embeddings`) or its own matrix.

Refused, in one line each, where no `transformers` architecture computes what ours does:
a causal-LM run (its head has a transform and LayerNorm before the vocabulary projection,
which GPT-style models lack), and a run that packs documents into rows (per-document attention
and positions).

The tokenizer: `AutoTokenizer` ids equal selfsup's on any text, with one exception: a literal
special-token string in a text ("[MASK]", "[SEP]") is that special token for `transformers`
(its fill-mask pipeline needs "[MASK]"), while selfsup's training path reads it as text. Texts
longer than the model's windows are cut to the first window (`truncation=True`), where
selfsup reads every window; an empty text is `[CLS] [SEP]` there, and no window here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from selfsup_model.artifacts import atomic_write_json, current_umask, read_manifest, sha256_file
from selfsup_model.errors import ArtifactError, UserError
from selfsup_model.text.specials import (
    BOS,
    CLS,
    CLS_ID,
    EOS,
    MASK,
    PAD,
    PAD_ID,
    SEP,
    SEP_ID,
    UNK,
)

EXPORT_VERSION = 1
PROVENANCE_FILE = "selfsup_export.json"
WEIGHTS_FILE = "model.safetensors"
LAYER_NORM_EPS = 1e-6  # every LayerNorm in selfsup_model.nn
HIDDEN_ACT = "gelu_pytorch_tanh"  # keras gelu(approximate=True)
_ALIGN = 8  # safetensors: the header is padded so the data starts 8-byte aligned


@dataclasses.dataclass(frozen=True)
class HfExport:
    out: Path
    architecture: str  # "BertForMaskedLM" or "MegatronBertForMaskedLM"
    files: dict[str, str]  # name -> sha256


# ------------------------------------------------------------------------------ weights


def _refusal(export_model) -> str | None:
    """Why no `transformers` architecture computes what `export_model` computes, or None."""
    from selfsup_model.nn.model import separates_documents

    objective = getattr(export_model, "objective", None)
    if objective == "clm":
        return ("a causal-LM run: its head (dense + GELU + LayerNorm before the vocabulary "
                "projection) has no transformers causal-LM architecture; export a masked-LM "
                "run (pretrain.objective=mlm)")
    if objective == "rtd":
        return ("a replaced-token-detection run (pretrain.objective=rtd): exporting its "
                "discriminator as a transformers ELECTRA model is not built yet; export a "
                "masked-LM run")
    if objective != "mlm":
        return f"model {export_model.name!r} is not a pretraining export model"
    if separates_documents(export_model.backbone):
        return ("a packed run (pretrain.packing=true): its per-document attention and positions "
                "have no transformers equivalent; export a run pretrained without packing")
    return None


def _np(variable) -> np.ndarray:
    return np.asarray(variable.numpy(), dtype=np.float32)


def hf_state(export_model) -> tuple[str, dict[str, np.ndarray], dict[str, Any]]:
    """(architecture, torch-layout float32 tensors by name, config.json) for a masked-LM
    `pretrain_model.keras`; raises UserError where `_refusal` says no."""
    from selfsup_model.nn.layers import TransformerEncoderBlock
    from selfsup_model.nn.model import token_embedding_of

    if (why := _refusal(export_model)) is not None:
        raise UserError(f"cannot export to transformers: {why}")
    backbone, head = export_model.backbone, export_model.head
    embedding = token_embedding_of(backbone)
    blocks = [layer for layer in backbone.layers if isinstance(layer, TransformerEncoderBlock)]
    norm = blocks[0].norm if blocks else "post"
    hidden, heads = embedding.hidden, blocks[0].heads if blocks else 1
    state: dict[str, np.ndarray] = {
        "bert.embeddings.word_embeddings.weight": _np(embedding.token_embedding.embeddings),
        "bert.embeddings.position_embeddings.weight": _np(embedding.position_embedding.embeddings),
        "bert.embeddings.token_type_embeddings.weight": np.zeros((1, hidden), np.float32),
    }
    if norm == "post":
        ln = backbone.get_layer("embeddings_norm")
        state["bert.embeddings.LayerNorm.weight"] = _np(ln.gamma)
        state["bert.embeddings.LayerNorm.bias"] = _np(ln.beta)
    for i, block in enumerate(blocks):
        p = f"bert.encoder.layer.{i}."
        kernel = _np(block.qkv.kernel).reshape(hidden, 3, hidden)  # (in, [q k v], out)
        bias = _np(block.qkv.bias).reshape(3, hidden)
        for j, name in enumerate(("query", "key", "value")):
            state[f"{p}attention.self.{name}.weight"] = kernel[:, j].T
            state[f"{p}attention.self.{name}.bias"] = bias[j]
        for ours, theirs in ((block.attention_output, "attention.output.dense"),
                             (block.ff_in, "intermediate.dense"), (block.ff_out, "output.dense")):
            state[f"{p}{theirs}.weight"] = _np(ours.kernel).T
            state[f"{p}{theirs}.bias"] = _np(ours.bias)
        norms = ((block.attention_norm, "attention.output.LayerNorm"),
                 (block.ff_norm, "output.LayerNorm")) if norm == "post" else (
                (block.attention_norm, "attention.ln"), (block.ff_norm, "ln"))
        for ours, theirs in norms:
            state[f"{p}{theirs}.weight"] = _np(ours.gamma)
            state[f"{p}{theirs}.bias"] = _np(ours.beta)
    if norm == "pre":
        ln = backbone.get_layer("final_norm")
        state["bert.encoder.ln.weight"] = _np(ln.gamma)
        state["bert.encoder.ln.bias"] = _np(ln.beta)
    state["cls.predictions.transform.dense.weight"] = _np(head.transform.kernel).T
    state["cls.predictions.transform.dense.bias"] = _np(head.transform.bias)
    state["cls.predictions.transform.LayerNorm.weight"] = _np(head.transform_norm.gamma)
    state["cls.predictions.transform.LayerNorm.bias"] = _np(head.transform_norm.beta)
    state["cls.predictions.bias"] = _np(head.output_bias)
    if not head.tie_embeddings:  # tied: transformers ties decoder.weight to the embedding
        # and decoder.bias to cls.predictions.bias; untied (5.x), it reads both from the file
        state["cls.predictions.decoder.weight"] = _np(head.decoder.kernel).T
        state["cls.predictions.decoder.bias"] = _np(head.output_bias)
    architecture = "BertForMaskedLM" if norm == "post" else "MegatronBertForMaskedLM"
    dropout = blocks[0].dropout if blocks else 0.0
    config = {
        "architectures": [architecture],
        "model_type": "bert" if norm == "post" else "megatron-bert",
        "vocab_size": embedding.vocab_size, "hidden_size": hidden,
        "num_hidden_layers": len(blocks), "num_attention_heads": heads,
        "intermediate_size": blocks[0].ff if blocks else hidden,
        "hidden_act": HIDDEN_ACT, "layer_norm_eps": LAYER_NORM_EPS,
        "hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout,
        "max_position_embeddings": embedding.max_len, "position_embedding_type": "absolute",
        "type_vocab_size": 1, "initializer_range": 0.02,
        "pad_token_id": PAD_ID, "tie_word_embeddings": bool(head.tie_embeddings),
        "dtype": "float32",
    }
    return architecture, {k: np.ascontiguousarray(v) for k, v in state.items()}, config


def safetensors_bytes(tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> bytes:
    """The safetensors serialisation of float32 `tensors` (the format's spec: an 8-byte
    little-endian header length, a JSON header of dtype/shape/byte offsets, then the data)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset, chunks = 0, []
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name], dtype="<f4")
        data = array.tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(len(encoded) + 8) % _ALIGN)
    return struct.pack("<Q", len(encoded)) + encoded + b"".join(chunks)


# ------------------------------------------------------------------------------ tokenizer

@functools.cache
def _horizontal_space_class() -> str:
    """normalize_document's horizontal whitespace (Python's \\s but newline) as a regex class
    for the tokenizer's engine, spelled out: Oniguruma's \\s is not Python's (Python's also
    holds U+001C..U+001F)."""
    chars = [c for c in range(sys.maxunicode + 1) if chr(c).isspace() and chr(c) != "\n"]
    return "[" + "".join(f"\\x{{{c:x}}}" for c in chars) + "]"


def hf_tokenizer_json(tokenizer) -> str:
    """tokenizer.json for `transformers`: the run's tokenizer, behind the steps of
    `corpus.ingest.normalize_document` (NFC, newlines unified, horizontal whitespace runs
    collapsed, lines stripped, at most one blank line, stripped), and framing `[CLS] text [SEP]`
    (a pair `[CLS] a [SEP] b [SEP]`, every segment type 0: the model has one)."""
    from tokenizers import Regex, Tokenizer, normalizers, processors

    tok = Tokenizer.from_str(tokenizer.to_str())
    horizontal = _horizontal_space_class()
    steps = [
        normalizers.NFC(),
        normalizers.Replace("\r\n", "\n"),
        normalizers.Replace("\r", "\n"),
        normalizers.Replace(Regex(horizontal + "+"), " "),
        normalizers.Replace(Regex(" ?\n ?"), "\n"),
        normalizers.Replace(Regex("\n{3,}"), "\n\n"),
        normalizers.Strip(),
    ]
    if tok.normalizer is not None:
        steps.append(tok.normalizer)
    tok.normalizer = normalizers.Sequence(steps)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{CLS}:0 $A:0 {SEP}:0", pair=f"{CLS}:0 $A:0 {SEP}:0 $B:0 {SEP}:0",
        special_tokens=[(CLS, CLS_ID), (SEP, SEP_ID)])
    tok.no_truncation()  # the caller's: tokenizer_config.json gives the model's length
    tok.no_padding()
    return tok.to_str(pretty=True)


def _tokenizer_config(max_len: int) -> dict[str, Any]:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
            "padding_side": "right", "truncation_side": "right",
            "model_input_names": ["input_ids", "attention_mask"],
            "clean_up_tokenization_spaces": False, **_special_tokens_map()}


def _special_tokens_map() -> dict[str, str]:
    return {"unk_token": UNK, "cls_token": CLS, "sep_token": SEP, "pad_token": PAD,
            "mask_token": MASK, "bos_token": BOS, "eos_token": EOS}


# ------------------------------------------------------------------------------ the card


_CARD = """---
library_name: transformers
pipeline_tag: fill-mask
tags: [selfsup, masked-lm]
---

# A selfsup masked-LM encoder ({architecture})

Pretrained by selfsup with a masked-LM objective ({corruption}) and exported from the run's
`pretrain/pretrain_model.keras` with `selfsup export --format hf`.
`transformers` computes what selfsup computes: selfsup's tests hold the logits to 1e-4 at
every real position.

## Pretrained on

- corpus `{corpus}`, its training split only: {train_documents} documents, {train_windows}
  windows of at most {max_position_embeddings} tokens
- {steps} steps, {real_tokens_seen} real tokens seen; started from {initialised_from}
- validation masked-LM loss **{val_loss}** (nats per scored token) over **{scored_tokens}**
  scored tokens: a fixed, seeded corruption of the validation split

## The run it came from

- workdir `{workdir}`
- pretrain stage finished {finished_at} (selfsup {code_version})
- `pretrain/pretrain_model.keras` sha256 `{model_sha256}`
- `tokenizer/tokenizer.json` sha256 `{tokenizer_sha256}`

## Architecture

{num_hidden_layers} layers, hidden size {hidden_size}, {num_attention_heads} heads,
feed-forward {intermediate_size}, vocabulary {vocab_size}, {max_position_embeddings}
positions, {tying} output embedding, tanh GELU, LayerNorm epsilon {layer_norm_eps}. One token
type (0).

## Tokenizer

`AutoTokenizer` applies selfsup's document normalisation and `[CLS] ... [SEP]` framing, so
its ids are selfsup's, except that a literal special-token string in a text ("[SEP]") is that
token here and text for selfsup. Pass `truncation=True`: the model reads at most
{max_position_embeddings} tokens (selfsup reads a long document as several overlapping
windows and averages them).

```python
from transformers import pipeline
fill = pipeline("fill-mask", model="{out}")
fill("import the [MASK] module")
```
"""


def _model_card(architecture: str, config: dict[str, Any], run: RunInfo, out: Path) -> str:
    manifest = run.pretrain_manifest
    metrics, counts = (manifest.metrics, manifest.counts) if manifest else ({}, {})
    loss, scored = metrics.get("val/mlm_loss"), metrics.get("val/scored_tokens")
    unknown = "(not recorded)"
    masks = manifest.params.get("masks", {}) if manifest else {}
    corruption = (f"{masks['select_rate']:.0%} of the eligible tokens selected, of them "
                  f"{masks['mask_rate']:.0%} [MASK], {masks['random_rate']:.0%} a random token, "
                  f"{masks['keep_rate']:.0%} unchanged" if {"select_rate", "mask_rate",
                  "random_rate", "keep_rate"} <= set(masks) else "corruption not recorded")
    return _CARD.format(corruption=corruption,
        architecture=architecture, corpus=run.corpus or unknown,
        train_documents=unknown if run.train_documents is None else run.train_documents,
        train_windows=counts.get("train_windows", unknown), steps=counts.get("steps", unknown),
        real_tokens_seen=counts.get("real_tokens_seen", unknown),
        initialised_from=counts.get("initialised_from", "random initialisation"),
        val_loss=unknown if loss is None else f"{loss:.4f}",
        scored_tokens=unknown if scored is None else int(scored),
        workdir=run.workdir, finished_at=manifest.finished_at if manifest else unknown,
        code_version=manifest.code_version if manifest else unknown, model_sha256=run.model_sha256,
        tokenizer_sha256=run.tokenizer_sha256,
        tying="tied" if config["tie_word_embeddings"] else "untied", out=out, **config)


# ------------------------------------------------------------------------------ the export


def _replace_dir(staged: Path, out: Path) -> None:
    """Put the finished directory `staged` at `out`; an earlier export there is replaced, any
    other non-empty directory or a file is left alone with an error."""
    if out.exists():
        if not out.is_dir():
            raise UserError(f"{out} exists and is not a directory; choose another --out")
        if any(out.iterdir()) and not (out / PROVENANCE_FILE).is_file():
            raise UserError(f"{out} is not empty and holds no earlier selfsup export; choose an "
                            "empty or new directory")
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        staged.rename(out)
        shutil.rmtree(old)
    else:
        staged.rename(out)


def export_hf(workdir: str | Path, out: str | Path) -> HfExport:
    """Write a finished masked-LM run's encoder, head and tokenizer to `out` as a
    `transformers` checkpoint directory (module docstring); the run's files are checked
    against their manifests first."""
    from selfsup_model.serving.inference import load_run_pretrained

    workdir = Path(workdir)
    pretrained = load_run_pretrained(workdir)
    run = RunInfo(workdir=str(workdir.resolve()),
                  pretrain_manifest=read_manifest(pretrained.model_path.parent),
                  model_sha256=sha256_file(pretrained.model_path),
                  tokenizer_sha256=sha256_file(pretrained.tokenizer_path))
    if (settings := workdir / "run_settings.json").is_file():
        run.corpus = json.loads(settings.read_text("utf-8")).get("corpus")
    if (split := read_manifest(workdir / "split")) is not None:
        run.train_documents = split.counts.get("docs_per_split", {}).get("train")
    return write_hf_checkpoint(pretrained.model, pretrained.tokenizer, out, run)


@dataclasses.dataclass
class RunInfo:
    """Where an export came from, for its provenance file and model card."""

    workdir: str
    pretrain_manifest: Any  # artifacts.StageManifest of the pretrain stage (None: unknown)
    model_sha256: str
    tokenizer_sha256: str
    corpus: str | None = None
    train_documents: int | None = None


def write_hf_checkpoint(export_model, tokenizer, out: str | Path, run: RunInfo) -> HfExport:
    """`export_model` (a masked-LM `pretrain_model.keras`) and its `tokenizer` as a
    `transformers` checkpoint directory at `out`. The directory appears whole or not at all: it
    is written beside `out` and renamed into place (an earlier export there is replaced)."""
    out = Path(out)
    architecture, tensors, config = hf_state(export_model)
    max_len = config["max_position_embeddings"]
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        files = {
            WEIGHTS_FILE: safetensors_bytes(tensors, {"format": "pt"}),
            "config.json": json.dumps(config, indent=2).encode(),
            "tokenizer.json": hf_tokenizer_json(tokenizer).encode(),
            "tokenizer_config.json": json.dumps(_tokenizer_config(max_len), indent=2).encode(),
            "special_tokens_map.json": json.dumps(_special_tokens_map(), indent=2).encode(),
            "README.md": _model_card(architecture, config, run, out).encode(),
        }
        for name, data in files.items():
            (staged / name).write_bytes(data)
        digests = {name: sha256_file(staged / name) for name in files}
        atomic_write_json(staged / PROVENANCE_FILE, {
            "version": EXPORT_VERSION, "format": "hf", "architecture": architecture,
            "from": {"workdir": run.workdir,
                     "pretrain/pretrain_model.keras": run.model_sha256,
                     "tokenizer/tokenizer.json": run.tokenizer_sha256},
            "files": digests})
        os.chmod(staged, 0o777 & ~current_umask())  # mkdtemp's 0700 otherwise
        _replace_dir(staged, out)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return HfExport(out, architecture, digests)


def check_export(out: str | Path) -> dict[str, Any]:
    """The provenance of an export directory, every file checked against it."""
    out = Path(out)
    try:
        provenance = json.loads((out / PROVENANCE_FILE).read_text("utf-8"))
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{out} is not a selfsup export ({PROVENANCE_FILE}: {exc})") from None
    for name, digest in provenance["files"].items():
        if not (out / name).is_file() or sha256_file(out / name) != digest:
            raise ArtifactError(f"{out / name} is missing or changed since the export")
    return provenance
