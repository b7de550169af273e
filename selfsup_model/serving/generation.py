"""Looking inside a pretrained model: fill-mask for an MLM run, KV-cached generation for a CLM run.

Both read `pretrain_model.keras` (a `PretrainExportModel`: ids (B, L) -> logits (B, L, V)) with
the run's tokenizer, and frame text the way training did (`encoding`, `windows`), after the same
`normalize_document` clean-up:

* fill-mask: `[CLS] content [SEP]`, every literal "[MASK]" becoming [MASK]'s id. The tokenizer
  encodes literal special strings as text (see `tokenization`), so the text is split at the
  markers and each piece is encoded on its own: a [MASK] stands for one whole token, and text
  glued to it ("[MASK]ing") is encoded as a separate word. Text longer than the model's
  `max_len` positions is refused, not truncated: a cut could drop a [MASK] or its context.
* generate: `[BOS] content`, never [EOS] (literal "[EOS]" is text). Training feeds x[:-1] of
  max_len-long `[BOS] ... [EOS]` windows, so a sequence ([BOS] + prompt + generated) may grow
  to max_len tokens: positions up to max_len - 2 are fed, and the last token is predicted but
  never fed back. Only content tokens and [EOS] are ever sampled.

Cached decoding re-runs the trained layers' sub-layers (fused qkv, attention output, norms,
feed-forward, head) in inference mode, keeping each block's keys and values, so a step costs one
position instead of the whole prefix. It mirrors `TransformerEncoderBlock.call` and
`build_backbone`; `next_token_logits_uncached` is the reference it is tested against.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, NamedTuple

import keras
import numpy as np
from keras import ops
from tokenizers import Tokenizer

from selfsup_model.corpus.ingest import normalize_document
from selfsup_model.errors import ArtifactError, UserError
from selfsup_model.nn.layers import TransformerEncoderBlock, gelu
from selfsup_model.nn.model import OBJECTIVES, token_embedding_of
from selfsup_model.text.specials import (
    BOS_ID,
    CLS_ID,
    EOS_ID,
    MASK,
    MASK_ID,
    PAD_ID,
    SEP_ID,
    SPECIAL_IDS,
    UNK_ID,
)

StopReason = Literal["eos", "max_new_tokens", "context_full"]
_FRAMING_IDS = np.array([i for i in SPECIAL_IDS if i != UNK_ID])  # never in encoded content
_NEVER_SAMPLED = np.array([i for i in SPECIAL_IDS if i != EOS_ID])
_WRONG_OBJECTIVE = {
    "mlm": "fill-mask needs a masked-LM run; this run's objective is {got} — use "
           "`selfsup generate`",
    "clm": "generation needs a causal-LM run; this run's objective is {got} — use "
           "`selfsup fill-mask`",
}


class Candidate(NamedTuple):
    """One guess for a [MASK]: the vocabulary entry, its probability under the full softmax."""

    token: str
    probability: float
    token_id: int


@dataclasses.dataclass(frozen=True)
class Generation:
    """What `generate` produced; `token_ids` and `text` exclude the prompt and any [EOS]."""

    text: str  # the continuation, decoded so that `prompt_text + text` reads as one text
    full_text: str  # decoded prompt content + continuation (normalised as the model saw it)
    token_ids: tuple[int, ...]
    prompt_ids: tuple[int, ...]  # framed: [BOS] first
    stopped_at_eos: bool
    stop_reason: StopReason


# ------------------------------------------------------------------------------ text -> ids


def _content_ids(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    encoded = [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    if any(np.isin(ids, _FRAMING_IDS).any() for ids in encoded):
        raise UserError("the text encodes to special-token ids: load the tokenizer with "
                        "selfsup_model.text.tokenization.load_tokenizer "
                        "(it encodes '[EOS]' as text)")
    return encoded


def frame_masked_text(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """Text with literal [MASK] markers -> (n,) int32 `[CLS] content [SEP]`, markers -> MASK_ID."""
    pieces = normalize_document(text).split(MASK)
    if len(pieces) == 1:
        raise UserError(f"the text has no {MASK}: write {MASK} where a token should be "
                        f"predicted, e.g. 'the cat {MASK} on the mat'")
    # Edge spaces belong to the [MASK]: byte-level BPE would encode them as a lone 'Ġ'.
    encoded = _content_ids(tokenizer, [piece.strip() for piece in pieces])
    ids = [CLS_ID, *encoded[0]]
    for piece in encoded[1:]:
        ids += [MASK_ID, *piece]
    return np.array([*ids, SEP_ID], dtype=np.int32)


def frame_prompt(tokenizer: Tokenizer, prompt: str) -> np.ndarray:
    """Prompt -> (T,) int32 `[BOS] content`, no [EOS]; an empty prompt is [BOS] alone."""
    return np.array([BOS_ID, *_content_ids(tokenizer, [normalize_document(prompt)])[0]],
                    dtype=np.int32)


def _check_run(model: keras.Model, tokenizer: Tokenizer, objective: str) -> int:
    """The model's max positions, after checking it is an export model of `objective`."""
    got = getattr(model, "objective", None)
    if got == "rtd":
        raise UserError(f"{'fill-mask' if objective == 'mlm' else 'generation'} needs a "
                        f"{'masked' if objective == 'mlm' else 'causal'}-LM run; this run's "
                        "objective is rtd, whose encoder tells replaced tokens apart and "
                        "predicts none")
    if got not in OBJECTIVES or not hasattr(model, "head"):
        raise UserError(f"model {model.name!r} is not a pretraining export model: load the run's "
                        "pretrain/pretrain_model.keras")
    if got != objective:
        raise UserError(_WRONG_OBJECTIVE[objective].format(got=got))
    embedding = token_embedding_of(model.backbone)
    if tokenizer.get_vocab_size() != embedding.vocab_size:
        raise ArtifactError(f"the tokenizer has {tokenizer.get_vocab_size()} tokens but the "
                            f"model's vocabulary is {embedding.vocab_size}: use the "
                            "tokenizer.json of the same run")
    return embedding.max_len


# ------------------------------------------------------------------------------ fill-mask


def fill_mask(model: keras.Model, tokenizer: Tokenizer, text: str,
              top_k: int = 5) -> list[list[Candidate]]:
    """Per [MASK] in order, the `top_k` non-special tokens by probability, most likely first.

    Probabilities are the model's softmax over the whole vocabulary; special tokens are
    dropped from the candidates afterwards, not renormalised away.
    """
    max_len = _check_run(model, tokenizer, "mlm")
    if top_k < 1:
        raise UserError(f"top_k must be at least 1, got {top_k}")
    ids = frame_masked_text(tokenizer, text)  # (n,)
    if ids.size > max_len:
        raise UserError(f"the text is {ids.size - 2} tokens; this model reads at most "
                        f"{max_len - 2} between [CLS] and [SEP]: shorten it around the {MASK}s")
    logits = ops.convert_to_numpy(model(ids[None], training=False))[0]  # (n, V)
    probs = _softmax(logits[ids == MASK_ID])  # (M, V) float64
    probs[:, list(SPECIAL_IDS)] = -1.0  # below every real probability: never a candidate
    k = min(top_k, probs.shape[1] - len(SPECIAL_IDS))
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]  # (M, k)
    top_p = np.take_along_axis(probs, top, axis=-1)  # (M, k), descending
    return [[Candidate(tokenizer.id_to_token(int(t)), float(p), int(t))
             for t, p in zip(row_ids, row_p, strict=True)]
            for row_ids, row_p in zip(top, top_p, strict=True)]


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


# ------------------------------------------------------------------------------ cached decoding


@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of the positions decoded so far, one (B, S, N, D) pair per block."""

    keys: tuple
    values: tuple

    @property
    def length(self) -> int:
        return int(ops.shape(self.keys[0])[1])


class CachedDecoder:
    """A causal export model's forward pass, split into a prefill and one-position steps.

    Calls the trained layers themselves (no copies of weights), never their dropout. Ids must
    hold no [PAD]: the export model would hide those keys, and nothing here does.
    """

    def __init__(self, model: keras.Model):
        backbone = model.backbone
        self.blocks = [la for la in backbone.layers if isinstance(la, TransformerEncoderBlock)]
        if not self.blocks or not all(block.causal for block in self.blocks):
            raise UserError("cached decoding needs a causal backbone (pretrain.objective=clm)")
        self.embedding = token_embedding_of(backbone)
        self.max_len = self.embedding.max_len
        names = {layer.name: layer for layer in backbone.layers}
        self.embeddings_norm = names.get("embeddings_norm")  # post-norm backbones only
        self.final_norm = names.get("final_norm")  # pre-norm backbones only
        self.head = model.head

    def prefill(self, ids) -> tuple[np.ndarray, KVCache]:
        """ids (B, T) -> logits (B, T, V) float32 and the cache of those T positions."""
        return self._forward(np.asarray(ids, dtype=np.int32), None)

    def step(self, ids, cache: KVCache) -> tuple[np.ndarray, KVCache]:
        """ids (B,) at position `cache.length` -> next-token logits (B, V), a one-longer cache."""
        logits, cache = self._forward(np.asarray(ids, dtype=np.int32)[:, None], cache)
        return logits[:, 0], cache

    def _forward(self, ids: np.ndarray, cache: KVCache | None) -> tuple[np.ndarray, KVCache]:
        start = 0 if cache is None else cache.length
        length = ids.shape[1]
        if start + length > self.max_len:
            raise ValueError(f"positions up to {start + length} exceed max_len {self.max_len}")
        if (ids == PAD_ID).any():
            raise ValueError("cached decoding takes no [PAD] ids")
        positions = ops.arange(start, start + length, dtype="int32")  # (T,)
        x = (self.embedding.token_embedding(ops.convert_to_tensor(ids))  # (B, T, H)
             + ops.expand_dims(self.embedding.position_embedding(positions), 0))
        if self.embeddings_norm is not None:
            x = self.embeddings_norm(x)
        keys, values = [], []
        for i, block in enumerate(self.blocks):
            past = None if cache is None else (cache.keys[i], cache.values[i])
            x, k, v = _block_forward(block, x, past, start)
            keys.append(k)
            values.append(v)
        if self.final_norm is not None:
            x = self.final_norm(x)
        logits = ops.convert_to_numpy(self.head.project(x))  # (B, T, V) float32
        return logits, KVCache(tuple(keys), tuple(values))


def _attend(block: TransformerEncoderBlock, x, past, start: int):
    """x (B, T, H) at positions start.. -> attention output (B, T, H), keys/values (B, S+T, N, D).

    The same arithmetic as `TransformerEncoderBlock.self_attention`, with the cached keys and
    values of positions 0..start-1 in front of the new ones.
    """
    batch, length = ops.shape(x)[0], ops.shape(x)[1]
    head_dim = block.hidden // block.heads
    qkv = ops.reshape(block.qkv(x), (batch, length, 3, block.heads, head_dim))  # (B, T, 3, N, D)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # (B, T, N, D) each
    if past is not None:
        k = ops.concatenate([past[0], k], axis=1)  # (B, S+T, N, D)
        v = ops.concatenate([past[1], v], axis=1)
    scores = ops.einsum("bqnd,bknd->bnqk", q, k) / math.sqrt(head_dim)  # (B, N, T, S+T)
    key_pos = ops.arange(start + length)  # (S+T,)
    query_pos = ops.arange(start, start + length)  # (T,)
    visible = ops.expand_dims(query_pos, 1) >= ops.expand_dims(key_pos, 0)  # (T, S+T): j <= i
    scores = ops.where(visible[None, None], ops.cast(scores, "float32"), -1e9)
    # exp / sum, not ops.softmax: that warns on a one-key row (the prefill of a bare [BOS]).
    scores = ops.exp(scores - ops.max(scores, axis=-1, keepdims=True))
    probs = ops.cast(scores / ops.sum(scores, axis=-1, keepdims=True), x.dtype)
    mixed = ops.einsum("bnqk,bknd->bqnd", probs, v)  # (B, T, N, D)
    out = block.attention_output(ops.reshape(mixed, (batch, length, block.hidden)))  # (B, T, H)
    return out, k, v


def _block_forward(block: TransformerEncoderBlock, x, past, start: int):
    """One block in inference mode: `TransformerEncoderBlock.call` with a cache."""
    def feed_forward(h):
        return block.ff_out(gelu(block.ff_in(h)))  # (B, T, F) -> (B, T, H)

    if block.norm == "post":
        attended, k, v = _attend(block, x, past, start)
        x = block.attention_norm(x + attended)
        return block.ff_norm(x + feed_forward(x)), k, v
    attended, k, v = _attend(block, block.attention_norm(x), past, start)
    x = x + attended
    return x + feed_forward(block.ff_norm(x)), k, v


def next_token_logits_uncached(model: keras.Model, ids) -> np.ndarray:
    """The reference: the export model on the whole prefix ids (B, T) -> last logits (B, V)."""
    ids = np.atleast_2d(np.asarray(ids, dtype=np.int32))
    return ops.convert_to_numpy(model(ids, training=False))[:, -1]


# ------------------------------------------------------------------------------ generation


def choose_next_token(logits, temperature: float, top_k: int | None,
                      rng: np.random.Generator) -> np.ndarray:
    """logits (B, V) -> token ids (B,): argmax at temperature 0, else a draw from
    softmax(logits / temperature) restricted to the top_k logits (Gumbel-max: exact, no
    renormalisation)."""
    scaled = np.asarray(logits, dtype=np.float64)
    if temperature == 0:
        return np.argmax(scaled, axis=-1)
    scaled = scaled / temperature
    if top_k is not None and top_k < scaled.shape[-1]:
        keep = np.argpartition(-scaled, top_k - 1, axis=-1)[:, :top_k]  # (B, k), ties cut at k
        kept = np.full_like(scaled, -np.inf)
        np.put_along_axis(kept, keep, np.take_along_axis(scaled, keep, axis=-1), axis=-1)
        scaled = kept
    return np.argmax(scaled + rng.gumbel(size=scaled.shape), axis=-1)


def _check_sampling(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    if max_new_tokens < 0:
        raise UserError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not temperature >= 0:
        raise UserError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise UserError(f"top_k must be at least 1 (or unset for no cut), got {top_k}")


def generate(model: keras.Model, tokenizer: Tokenizer, prompt: str, max_new_tokens: int = 50,
             temperature: float = 1.0, top_k: int | None = None, seed: int = 0) -> Generation:
    """Continue `prompt` with a causal-LM run, one cached step per token, until [EOS] is drawn,
    `max_new_tokens` are produced or the sequence fills the model's max_len positions."""
    max_len = _check_run(model, tokenizer, "clm")
    _check_sampling(max_new_tokens, temperature, top_k)
    prompt_ids = frame_prompt(tokenizer, prompt)  # (T,)
    if prompt_ids.size >= max_len:
        raise UserError(f"the prompt is {prompt_ids.size - 1} tokens; this model's context is "
                        f"{max_len} positions with [BOS], so at most {max_len - 2} leave room "
                        "to generate: shorten the prompt")
    budget = min(max_new_tokens, max_len - prompt_ids.size)
    decoder, rng = CachedDecoder(model), np.random.default_rng(seed)
    new_ids: list[int] = []
    reason: StopReason = "max_new_tokens" if budget == max_new_tokens else "context_full"
    if budget:
        logits, cache = decoder.prefill(prompt_ids[None])
        logits = logits[:, -1]  # (1, V)
    while len(new_ids) < budget:  # one cached step per generated token
        allowed = np.array(logits, dtype=np.float64)  # (1, V), a writable copy
        allowed[:, _NEVER_SAMPLED] = -np.inf
        token = int(choose_next_token(allowed, temperature, top_k, rng)[0])
        if token == EOS_ID:
            reason = "eos"
            break
        new_ids.append(token)
        if len(new_ids) < budget:
            logits, cache = decoder.step(np.array([token], dtype=np.int32), cache)
    text, full_text = _decode_continuation(tokenizer, prompt_ids[1:].tolist(), new_ids)
    return Generation(text, full_text, tuple(new_ids), tuple(int(i) for i in prompt_ids),
                      reason == "eos", reason)


def _decode_continuation(tokenizer: Tokenizer, content: list[int],
                         new_ids: list[int]) -> tuple[str, str]:
    """(continuation, whole text): the continuation is cut from the whole decode, so a
    word-piece continuation ('##t' after 'ca') joins its word instead of showing '##'."""
    full = tokenizer.decode(content + new_ids, skip_special_tokens=True)
    head = tokenizer.decode(content, skip_special_tokens=True)
    if full.startswith(head):
        return full[len(head):], full.strip()
    return tokenizer.decode(new_ids, skip_special_tokens=True), full.strip()
