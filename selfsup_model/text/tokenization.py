"""Fit, save, load and measure the subword tokenizer (Hugging Face `tokenizers`).

Two kinds, chosen by `TokenizerConfig.kind`:

* ``wordpiece`` (default): BERT-style. NFC first (so composed and decomposed
  input agree), then the BERT normaliser (control-char cleanup, CJK isolation,
  lowercasing per config; accents are stripped only when lowercasing, as in
  uncased BERT), the BERT pre-tokeniser (whitespace + punctuation) and the
  WordPiece ``##`` decoder.
* ``bpe``: byte-level BPE (NFC, optional lowercasing, a prefix space so a
  document's first word is split like every other word). Never produces [UNK].

The special tokens are handed to the trainer in `SPECIAL_TOKENS` order, which
pins their ids to 0..6; `fit_tokenizer` checks that. No post-processor adds
[CLS]/[SEP]: framing is the job of `encoding.encode_split`. Literal special
strings in raw text (a docstring quoting "[SEP]") are tokenised as ordinary
text (`encode_special_tokens = True`), so content never carries framing ids.
`tokenizer.json` does not persist that flag, so always load with
`load_tokenizer`.

Determinism (measured with tokenizers 0.23.3): byte-level BPE training is
reproducible as is. WordPiece training is NOT: the trainer creates the
``##c`` continuation tokens while iterating a Rust hash map whose order is
randomised per map, so their ids differ between fits, and because merge ties
are broken by token id, even the learned merges can differ near the vocabulary
limit (upstream huggingface/tokenizers#1794). `RAYON_NUM_THREADS=1` does not
help. The fix here: pass every continuation token ``##c`` (for each character
of the normalised corpus that can continue a word) to the trainer up front,
after the real specials, so all ids exist before the hash-map walk; then
rebuild the tokenizer from the trained vocabulary with only the seven real
specials registered. Training then gives a byte-identical `to_str()` across
fits, processes, thread counts and input orders (word counts are
order-independent), which `tests/text/test_tokenization.py` checks.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from selfsup_model.artifacts import atomic_path
from selfsup_model.config import TokenizerConfig
from selfsup_model.errors import ArtifactError, UserError
from selfsup_model.text.specials import SPECIAL_TOKENS, UNK, UNK_ID

CONTINUATION_PREFIX = "##"
_STATS_BATCH = 1024


def fit_tokenizer(texts: Iterable[str], cfg: TokenizerConfig) -> Tokenizer:
    """Train a tokenizer on `texts` (the training split only); special ids are 0..6."""
    corpus = list(texts)
    bad = next((i for i, t in enumerate(corpus) if not isinstance(t, str)), None)
    if bad is not None:
        raise UserError(f"training text #{bad} is {type(corpus[bad]).__name__}, not str")
    if not any(t.strip() for t in corpus):
        raise UserError(
            "cannot fit the tokenizer: the training texts are empty "
            "(check that the train split has documents with text)"
        )
    if cfg.kind == "bpe":
        tok = _fit_byte_level_bpe(corpus, cfg)
    else:
        tok = _fit_wordpiece(corpus, cfg)
    tok.encode_special_tokens = True
    _check_special_ids(tok)
    return tok


def _wordpiece_normalizer(cfg: TokenizerConfig) -> normalizers.Normalizer:
    bert = normalizers.BertNormalizer(
        clean_text=True,
        handle_chinese_chars=True,
        strip_accents=cfg.lowercase,
        lowercase=cfg.lowercase,
    )
    return normalizers.Sequence([normalizers.NFC(), bert])


def _continuation_tokens(corpus: Sequence[str], norm, pre) -> list[str]:
    """``##c`` for every normalised character that can sit inside a word, sorted."""
    chars: set[str] = set()
    ascii_chars: set[str] = set()
    for text in corpus:
        if text.isascii():
            ascii_chars.update(text)
        else:
            chars.update(norm.normalize_str(text))
    # Pure-ASCII text normalises character by character (nothing composes with ASCII
    # unless a combining mark is present, and that is not ASCII), so its characters
    # are normalised once each instead of once per document: most corpora are ASCII.
    for c in ascii_chars:
        chars.update(norm.normalize_str(c))
    # A character continues a word iff the pre-tokeniser leaves "a<c>a" whole.
    inner = [c for c in sorted(chars) if len(pre.pre_tokenize_str(f"a{c}a")) == 1]
    return [CONTINUATION_PREFIX + c for c in inner]


def _fit_wordpiece(corpus: Sequence[str], cfg: TokenizerConfig) -> Tokenizer:
    norm = _wordpiece_normalizer(cfg)
    pre = pre_tokenizers.BertPreTokenizer()
    # Pre-registering the ##c tokens is the determinism fix (module docstring).
    seeded = list(SPECIAL_TOKENS) + _continuation_tokens(corpus, norm, pre)
    scratch = Tokenizer(
        models.WordPiece(unk_token=UNK, continuing_subword_prefix=CONTINUATION_PREFIX)
    )
    scratch.normalizer = norm
    scratch.pre_tokenizer = pre
    trainer = trainers.WordPieceTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=seeded,
        continuing_subword_prefix=CONTINUATION_PREFIX,
        show_progress=False,
    )
    scratch.train_from_iterator(corpus, trainer, length=len(corpus))
    # Rebuild so the ##c helpers are plain vocabulary, not "special" added tokens.
    model = models.WordPiece(
        scratch.get_vocab(), unk_token=UNK, continuing_subword_prefix=CONTINUATION_PREFIX
    )
    tok = Tokenizer(model)
    tok.normalizer = norm
    tok.pre_tokenizer = pre
    tok.decoder = decoders.WordPiece(prefix=CONTINUATION_PREFIX)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def _fit_byte_level_bpe(corpus: Sequence[str], cfg: TokenizerConfig) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=UNK))
    steps = [normalizers.NFC()] + ([normalizers.Lowercase()] if cfg.lowercase else [])
    tok.normalizer = normalizers.Sequence(steps)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, so nothing is ever [UNK] (vocab is at least 263).
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer, length=len(corpus))
    return tok


def _check_special_ids(tok: Tokenizer) -> None:
    got = [tok.token_to_id(s) for s in SPECIAL_TOKENS]
    if got != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError(f"special token ids must be 0..{len(SPECIAL_TOKENS) - 1}, got {got}")


def save_tokenizer(tok: Tokenizer, path: str | os.PathLike) -> None:
    """Write `tokenizer.json` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(tok.to_str(), encoding="utf-8")


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Read a tokenizer written by `save_tokenizer`, restoring the non-persisted flags."""
    if not os.path.isfile(path):
        raise ArtifactError(f"missing tokenizer file {path}; rerun the tokenizer stage")
    try:
        tok = Tokenizer.from_file(os.fspath(path))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises bare Exception on bad JSON
        raise ArtifactError(f"cannot load tokenizer from {path}: {exc}") from None
    tok.encode_special_tokens = True
    _check_special_ids(tok)
    return tok


def tokenizer_stats(tok: Tokenizer, texts: Iterable[str]) -> dict[str, Any]:
    """Vocabulary size, [UNK] share of produced tokens, and tokens per whitespace word.

    Counted with `encode_batch(..., add_special_tokens=False)`, so only content tokens.
    """
    totals = np.zeros(3, dtype=np.int64)  # tokens, [UNK] tokens, whitespace words
    for batch in _batches(texts, _STATS_BATCH):
        totals += _batch_stats(tok, batch)
    n_tokens, n_unk, n_words = (int(v) for v in totals)
    return {
        "vocab_size": tok.get_vocab_size(),
        "tokens": n_tokens,
        "words": n_words,
        "unk_rate": n_unk / n_tokens if n_tokens else 0.0,
        "tokens_per_word": n_tokens / n_words if n_words else 0.0,
    }


def _batches(texts: Iterable[str], size: int) -> Iterator[list[str]]:
    it = iter(texts)
    while batch := list(itertools.islice(it, size)):
        yield batch


def _batch_stats(tok: Tokenizer, batch: list[str]) -> np.ndarray:
    ids = [e.ids for e in tok.encode_batch(batch, add_special_tokens=False)]
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32)
    words = sum(len(t.split()) for t in batch)
    return np.array([flat.size, np.count_nonzero(flat == UNK_ID), words], dtype=np.int64)
