"""Tokenizer fitting: special ids, reproducibility, leak safety, persistence, stats."""

from __future__ import annotations

import json
import random
import unicodedata

import numpy as np
import pytest

from selfsup_model.config import TokenizerConfig
from selfsup_model.errors import ArtifactError, UserError
from selfsup_model.text.specials import CLS_ID, SEP_ID, SPECIAL_TOKENS, UNK_ID
from selfsup_model.text.tokenization import (
    fit_tokenizer,
    load_tokenizer,
    save_tokenizer,
    tokenizer_stats,
)

KINDS = ["wordpiece", "bpe"]
_WORD_TEXT = (
    "the array shape value index column frame parse return default type error raise "
    "string number integer float vector matrix sparse dense sample random seed module "
    "function method class object attribute instance iterate sorted unique Café naïve"
)
WORDS = _WORD_TEXT.split()


def corpus(n_docs: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 15))]
        docs.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ", ok."]))
    return docs


def small_cfg(kind: str, **kw) -> TokenizerConfig:
    return TokenizerConfig(kind=kind, vocab_size=kw.pop("vocab_size", 320), min_frequency=1, **kw)


@pytest.fixture(scope="module")
def train_texts() -> list[str]:
    return corpus()


@pytest.mark.parametrize("kind", KINDS)
def test_special_ids_are_fixed_and_nothing_is_framed(train_texts, kind):
    tok = fit_tokenizer(train_texts, small_cfg(kind))
    assert [tok.token_to_id(s) for s in SPECIAL_TOKENS] == list(range(7))
    # No post-processor: framing is the encoder's job, even if asked for specials.
    assert tok.encode("the array", add_special_tokens=True).ids == tok.encode("the array").ids
    assert CLS_ID not in tok.encode("the array").ids
    # A literal "[SEP]" in raw text is text, never the framing id.
    assert SEP_ID not in tok.encode("see [SEP] here", add_special_tokens=False).ids


@pytest.mark.parametrize("kind", KINDS)
def test_fitting_twice_is_identical_and_order_free(train_texts, kind):
    first = fit_tokenizer(train_texts, small_cfg(kind)).to_str()
    assert fit_tokenizer(train_texts, small_cfg(kind)).to_str() == first
    shuffled = list(train_texts)
    random.Random(1).shuffle(shuffled)
    assert fit_tokenizer(shuffled, small_cfg(kind)).to_str() == first


@pytest.mark.parametrize("kind", KINDS)
def test_tokenizer_never_sees_held_out_text(train_texts, kind):
    held_out = "the zyxwvqp quokkazebra sample"
    tok = fit_tokenizer(train_texts, small_cfg(kind, vocab_size=2000))
    vocab = tok.get_vocab()
    for word in ("zyxwvqp", "quokkazebra"):
        assert not [t for t in vocab if word in t.lstrip("#Ġ")]
    assert "array" in vocab or "Ġarray" in vocab  # a frequent training word is one token
    # Fitting on train + held-out would have learned the word: the test can fail.
    leaky = fit_tokenizer(train_texts + [held_out] * 5, small_cfg(kind, vocab_size=2000))
    assert [t for t in leaky.get_vocab() if "quokkazebra" in t]


def test_wordpiece_lowercases_and_strips_accents_only_when_lowercasing(train_texts):
    nfd = unicodedata.normalize("NFD", "Café naïve")
    lower = fit_tokenizer(train_texts, small_cfg("wordpiece"))
    assert lower.encode("Café naïve").tokens == lower.encode("cafe naive").tokens
    assert lower.encode(nfd).tokens == lower.encode("cafe naive").tokens
    cased = fit_tokenizer(train_texts, small_cfg("wordpiece", lowercase=False))
    assert cased.encode("Café").tokens != cased.encode("Cafe").tokens
    assert cased.encode(nfd).tokens == cased.encode("Café naïve").tokens  # NFC first
    assert cased.decode(cased.encode("Café naïve").ids) == "Café naïve"


@pytest.mark.parametrize("texts", [[], ["", "   \n"]])
def test_empty_training_texts_raise_user_error(texts):
    with pytest.raises(UserError, match="training texts are empty"):
        fit_tokenizer(texts, small_cfg("wordpiece"))


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_round_trip(train_texts, kind, tmp_path):
    tok = fit_tokenizer(train_texts, small_cfg(kind))
    path = tmp_path / "tokenizer" / "tokenizer.json"
    save_tokenizer(tok, path)
    assert [p.name for p in path.parent.iterdir()] == ["tokenizer.json"]
    loaded = load_tokenizer(path)
    assert loaded.to_str() == tok.to_str()
    text = "Parse the sparse matrix [SEP] again."
    assert loaded.encode(text).ids == tok.encode(text).ids
    assert json.loads(path.read_text("utf-8"))["post_processor"] is None
    with pytest.raises(ArtifactError, match="missing tokenizer file"):
        load_tokenizer(tmp_path / "nope.json")


def test_stats_by_hand():
    # Every word is frequent, so with a large vocabulary each is one token.
    tok = fit_tokenizer(["alpha beta gamma"] * 20, small_cfg("wordpiece", vocab_size=200))
    stats = tokenizer_stats(tok, ["alpha beta", "gamma alpha beta"])
    assert stats == {
        "vocab_size": tok.get_vocab_size(),
        "tokens": 5,
        "words": 5,
        "unk_rate": 0.0,
        "tokens_per_word": 1.0,
    }
    # "ж" never occurs in training: its word is one [UNK] among 3 tokens.
    stats = tokenizer_stats(tok, ["alpha ж beta"])
    assert stats["unk_rate"] == pytest.approx(1 / 3) and stats["tokens_per_word"] == 1.0
    assert tok.encode("ж").ids == [UNK_ID]


def test_bpe_never_produces_unk(train_texts):
    tok = fit_tokenizer(train_texts, small_cfg("bpe"))
    stats = tokenizer_stats(tok, ["жжж ☃ naïve", "the array"])
    assert stats["unk_rate"] == 0.0 and stats["tokens_per_word"] > 1.0
    ids = np.array(tok.encode("жжж ☃").ids)
    assert (ids >= len(SPECIAL_TOKENS)).all()
