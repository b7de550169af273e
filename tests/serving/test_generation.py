"""Fill-mask and KV-cached generation on tiny models: cached == uncached at every step, framing,
stopping, sampling, and hand-built models whose outputs are known in advance."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from selfsup_model.artifacts import save_keras_atomic
from selfsup_model.config import ModelConfig, TokenizerConfig
from selfsup_model.errors import ArtifactError, UserError
from selfsup_model.nn.model import (
    build_backbone,
    build_pretrain_export_model,
    build_pretraining_model,
    token_embedding_of,
)
from selfsup_model.nn.saving import load_keras_model
from selfsup_model.serving.generation import (
    CachedDecoder,
    choose_next_token,
    fill_mask,
    frame_masked_text,
    frame_prompt,
    generate,
    next_token_logits_uncached,
)
from selfsup_model.text.specials import (
    BOS_ID,
    CLS_ID,
    EOS_ID,
    MASK_ID,
    NUM_SPECIAL,
    SEP_ID,
    SPECIAL_TOKENS,
)
from selfsup_model.text.tokenization import fit_tokenizer

WORDS = ["the", "cat", "sat", "on", "mat", "dog", "ran", "a", "big"]
V, L = NUM_SPECIAL + len(WORDS), 10  # 16 tokens, 10 positions
ID = {w: NUM_SPECIAL + i for i, w in enumerate(WORDS)}


def toy_tokenizer() -> Tokenizer:
    """One id per lowercased whitespace word, the seven specials at 0..6, literal specials as
    text: the contract of `tokenization.load_tokenizer` with a vocabulary known by heart."""
    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.encode_special_tokens = True
    return tok


TOK = toy_tokenizer()


def export_model(objective: str, seed: int = 0, vocab: int = V, **cfg):
    """A randomly initialised export model (ids (B, L) -> logits (B, L, V))."""
    keras.utils.set_random_seed(seed)
    config = ModelConfig(**{"hidden": 8, "layers": 2, "heads": 2, "ff": 16, "dropout": 0.0,
                            **cfg})
    backbone = build_backbone(vocab, L, config, causal=objective == "clm")
    head = build_pretraining_model(backbone, objective, config).head
    return build_pretrain_export_model(backbone, head, objective)


def scramble(model, seed: int, scale: float = 0.3):
    """Every weight random and non-zero (biases, LayerNorm offsets included): at its default
    initialisation a tiny model is nearly scale-invariant, so a skipped norm could go unseen."""
    rng = np.random.default_rng(seed)
    for w in model.weights:
        w.assign((1.0 if "gamma" in w.path else 0.0) + rng.normal(0, scale, w.shape))
    return model


def logits_are_bias(model, bias: dict[int, float], default: float = 0.0):
    """Zero the head's last LayerNorm, so every position's logits are exactly the output bias."""
    norm = model.head.transform_norm
    norm.gamma.assign(np.zeros(norm.gamma.shape, "float32"))
    norm.beta.assign(np.zeros(norm.beta.shape, "float32"))
    b = np.full(V, default, "float32")
    for token, value in bias.items():
        b[token] = value
    model.head.output_bias.assign(b)
    return model


def one_hot_model(objective: str, token_rows: np.ndarray, position_rows: np.ndarray,
                  next_of: dict[int, int]):
    """hidden = V, blocks silenced (zero attention and feed-forward outputs), identity head
    transform, untied decoder with 10 at [a, next_of[a]]: the argmax after a position holding
    one-hot(a) is next_of[a]. LayerNorm and gelu keep the hot coordinate the largest."""
    model = export_model(objective, hidden=V, heads=2, ff=4, norm="pre", tie_embeddings=False)
    embedding = token_embedding_of(model.backbone)
    embedding.token_embedding.embeddings.assign(token_rows.astype("float32"))
    embedding.position_embedding.embeddings.assign(position_rows.astype("float32"))
    for layer in model.backbone.layers:
        for dense in (getattr(layer, "attention_output", None), getattr(layer, "ff_out", None)):
            if dense is not None:
                dense.kernel.assign(np.zeros(dense.kernel.shape, "float32"))
                dense.bias.assign(np.zeros(dense.bias.shape, "float32"))
    model.head.transform.kernel.assign(np.eye(V, dtype="float32"))
    model.head.transform.bias.assign(np.zeros(V, "float32"))
    decoder = np.zeros((V, V), "float32")
    for a, b in next_of.items():
        decoder[a, b] = 10.0
    model.head.decoder.kernel.assign(decoder)
    return model


def successor_model(next_of: dict[int, int]):
    """A causal model that greedily writes next_of[last token], whatever came before."""
    return one_hot_model("clm", np.eye(V), np.zeros((L, V)), next_of)


# ----------------------------------------------------------------------------- cached decoding


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_cached_logits_equal_the_export_model_at_every_step(norm):
    # Dropout 0.3: a cached path that ran any dropout would not match the inference model.
    model = scramble(export_model("clm", seed=3, norm=norm, dropout=0.3), seed=3)
    decoder = CachedDecoder(model)
    rng = np.random.default_rng(0)
    seq = rng.integers(NUM_SPECIAL, V, size=(2, L)).astype(np.int32)  # (B, L) two rows
    seq[:, 0] = BOS_ID
    prompt = 3

    logits, cache = decoder.prefill(seq[:, :prompt])  # (B, 3, V)
    full = keras.ops.convert_to_numpy(model(seq[:, :prompt], training=False))
    np.testing.assert_allclose(logits, full, atol=1e-4)
    steps = [logits[:, -1]]
    for t in range(prompt, L):  # teacher-forced to the last position the model has
        logits, cache = decoder.step(seq[:, t], cache)
        assert cache.length == t + 1
        np.testing.assert_allclose(logits, next_token_logits_uncached(model, seq[:, : t + 1]),
                                   atol=1e-4)
        steps.append(logits)
    assert len(cache.keys) == 2 and cache.keys[0].shape == (2, L, 2, 4)  # (B, L, N, D)
    # Not a degenerate model: the next-token distribution moves from step to step.
    assert np.abs(np.diff(np.stack(steps), axis=0)).max() > 1e-3
    with pytest.raises(ValueError, match="max_len"):
        decoder.step(seq[:, 0], cache)


def test_cached_decoding_of_a_saved_and_reloaded_model(tmp_path):
    model = scramble(export_model("clm", seed=4, norm="post"), seed=4)
    path = save_keras_atomic(model, tmp_path / "pretrain_model.keras")
    loaded = load_keras_model(path)
    ids = np.array([[BOS_ID, ID["the"], ID["cat"], ID["sat"]]], np.int32)
    logits, cache = CachedDecoder(loaded).prefill(ids[:, :3])
    step, _ = CachedDecoder(loaded).step(ids[:, 3], cache)
    np.testing.assert_allclose(logits[:, -1], next_token_logits_uncached(model, ids[:, :3]),
                               atol=1e-4)
    np.testing.assert_allclose(step, next_token_logits_uncached(model, ids), atol=1e-4)


def test_greedy_generation_follows_the_uncached_argmax_and_ignores_the_seed():
    model = export_model("clm", seed=5, norm="pre")
    out = generate(model, TOK, "the cat", max_new_tokens=5, temperature=0.0, seed=1)
    assert out == generate(model, TOK, "the cat", max_new_tokens=5, temperature=0.0, seed=2)
    ids = [BOS_ID, ID["the"], ID["cat"]]
    assert list(out.prompt_ids) == ids
    for token in out.token_ids:  # each generated token is the best content token or [EOS]
        logits = next_token_logits_uncached(model, [ids])[0]
        logits[[i for i in range(NUM_SPECIAL) if i != EOS_ID]] = -np.inf
        assert token == int(np.argmax(logits))
        ids.append(token)
    assert len(out.token_ids) == 5 and out.stop_reason == "max_new_tokens"  # for this seed


# ----------------------------------------------------------------------------- stopping


def test_generation_stops_at_eos_and_leaves_it_out():
    model = successor_model({BOS_ID: ID["the"], ID["the"]: ID["cat"], ID["cat"]: ID["sat"],
                             ID["sat"]: EOS_ID})
    out = generate(model, TOK, "", temperature=0.0)
    assert out.token_ids == (ID["the"], ID["cat"], ID["sat"])
    assert out.stopped_at_eos and out.stop_reason == "eos"
    assert out.text == "the cat sat" and "[EOS]" not in out.text
    assert out.prompt_ids == (BOS_ID,)

    out = generate(model, TOK, "  The   CAT ", temperature=0.0)  # normalised, framed [BOS] the cat
    assert out.prompt_ids == (BOS_ID, ID["the"], ID["cat"])
    assert (out.token_ids, out.text, out.full_text) == ((ID["sat"],), " sat", "the cat sat")


def test_generation_stops_when_the_context_is_full():
    cycle = {BOS_ID: ID["the"], ID["the"]: ID["cat"], ID["cat"]: ID["sat"], ID["sat"]: ID["the"]}
    model = successor_model(cycle)
    out = generate(model, TOK, "", max_new_tokens=50, temperature=0.0)
    # [BOS] + 9 tokens = L = 10 positions; the 9th is predicted from position 8 and never fed.
    assert out.token_ids == (ID["the"], ID["cat"], ID["sat"]) * 3
    assert out.stop_reason == "context_full" and not out.stopped_at_eos

    out = generate(model, TOK, "", max_new_tokens=4, temperature=0.0)
    assert out.token_ids == (ID["the"], ID["cat"], ID["sat"], ID["the"])
    assert out.stop_reason == "max_new_tokens"

    eight = " ".join(["cat"] * 8)  # [BOS] + 8 = 9 positions: room for exactly one more
    out = generate(model, TOK, eight, max_new_tokens=50, temperature=0.0)
    assert out.token_ids == (ID["sat"],) and out.stop_reason == "context_full"
    with pytest.raises(UserError, match="prompt is 9 tokens"):
        generate(model, TOK, eight + " cat")
    assert generate(model, TOK, "cat", max_new_tokens=0).token_ids == ()


def test_only_content_tokens_and_eos_are_generated():
    # Every special but [EOS] has the top logit; [EOS] is never likely: the content token wins.
    specials = {i: 20.0 for i in range(NUM_SPECIAL) if i != EOS_ID}
    model = logits_are_bias(export_model("clm", seed=6), {**specials, EOS_ID: -30.0,
                                                          ID["dog"]: 1.0})
    out = generate(model, TOK, "a", temperature=0.0)
    assert out.token_ids == (ID["dog"],) * (L - 2)
    assert out.text == " " + " ".join(["dog"] * (L - 2))


# ----------------------------------------------------------------------------- sampling


def test_same_seed_same_sample_other_seeds_differ():
    model = logits_are_bias(export_model("clm", seed=7), {EOS_ID: -30.0})  # uniform over 9 words
    runs = [generate(model, TOK, "the", temperature=1.0, seed=s).token_ids for s in (0, 0, 1, 2)]
    assert runs[0] == runs[1]
    assert len(set(runs)) == 3  # 9^8 possible samples: seeds 0, 1, 2 do not collide
    assert all(set(r) <= set(ID.values()) for r in runs)


def test_sampling_follows_softmax_of_logits_over_temperature():
    rng = np.random.default_rng(0)
    logits = np.tile([math.log(9.0), 0.0, -math.inf], (20_000, 1))  # (B, 3)
    # softmax([ln 9, 0] / 2) = (3/4, 1/4); at temperature 1 it is (9/10, 1/10). sd ~ 0.003.
    assert abs(np.mean(choose_next_token(logits, 2.0, None, rng) == 0) - 0.75) < 0.015
    assert abs(np.mean(choose_next_token(logits, 1.0, None, rng) == 0) - 0.90) < 0.015
    assert (choose_next_token(logits, 0.0, None, rng) == 0).all()
    assert (choose_next_token(logits, 100.0, 1, rng) == 0).all()  # top_k=1 is greedy
    spread = np.tile([3.0, 2.0, 1.0, 0.0], (2_000, 1))
    drawn = choose_next_token(spread, 100.0, 2, rng)
    assert set(np.unique(drawn)) == {0, 1}  # nearly uniform over the top two, never beyond


def test_invalid_sampling_settings_are_user_errors():
    model = export_model("clm", seed=8)
    for kwargs in ({"temperature": -1.0}, {"top_k": 0}, {"max_new_tokens": -1}):
        with pytest.raises(UserError):
            generate(model, TOK, "the", **kwargs)


# ----------------------------------------------------------------------------- fill-mask


@pytest.mark.parametrize("kind", ["wordpiece", "bpe"])
def test_masks_are_framed_like_training_windows(kind):
    docs = ["the cat sat on the mat", "a big dog ran on the mat", "the dog sat"] * 10
    tok = fit_tokenizer(docs, TokenizerConfig(kind=kind, vocab_size=300, min_frequency=1))
    whole = tok.encode("the cat sat on the mat", add_special_tokens=False).ids
    sat = tok.encode("the cat", add_special_tokens=False).ids
    assert len(whole) == 6 and whole[:2] == sat  # one token per word
    expected = [CLS_ID, *whole[:2], MASK_ID, *whole[3:5], MASK_ID, SEP_ID]
    got = frame_masked_text(tok, "the cat  [MASK]\ton the\n[MASK]")
    assert got.tolist() == expected and got.dtype == np.int32
    assert frame_masked_text(tok, "[MASK]").tolist() == [CLS_ID, MASK_ID, SEP_ID]
    assert frame_prompt(tok, "the cat ").tolist() == [BOS_ID, *whole[:2]]


def test_fill_mask_probabilities_are_the_full_softmax_without_specials():
    # Logits = bias: [MASK] e^ln8 (most likely, but special), the 4, cat 2, sat 1.5, others 1.
    bias = {MASK_ID: math.log(8), ID["the"]: math.log(4), ID["cat"]: math.log(2),
            ID["sat"]: math.log(1.5)}
    model = logits_are_bias(export_model("mlm", seed=9), bias)
    z = 8 + 4 + 2 + 1.5 + (V - 4)
    got = fill_mask(model, TOK, "a [MASK] dog [MASK]", top_k=3)
    assert len(got) == 2
    for candidates in got:
        assert [c.token for c in candidates] == ["the", "cat", "sat"]
        assert [c.token_id for c in candidates] == [ID["the"], ID["cat"], ID["sat"]]
        np.testing.assert_allclose([c.probability for c in candidates],
                                   [4 / z, 2 / z, 1.5 / z], rtol=1e-5)
    top = fill_mask(model, TOK, "[MASK]", top_k=100)[0]  # capped at the 9 content tokens
    assert [c.token for c in top][3:] == WORDS[3:] and len(top) == V - NUM_SPECIAL


def test_fill_mask_answers_each_mask_in_order():
    # Position p holds one-hot(target[p]) and the decoder is the identity: a position's guess
    # is its target, so [MASK] at position 1 says "dog" and at position 4 says "mat".
    target = np.full(L, ID["a"])
    target[1], target[4] = ID["dog"], ID["mat"]
    model = one_hot_model("mlm", np.zeros((V, V)), np.eye(V)[target], {i: i for i in range(V)})
    first, second = fill_mask(model, TOK, "[MASK] cat sat [MASK]", top_k=4)
    assert first[0].token == "dog" and second[0].token == "mat"
    for candidates in (first, second):
        p = [c.probability for c in candidates]
        assert len(p) == 4 and all(0 < q <= 1 for q in p) and p == sorted(p, reverse=True)
        assert sum(p) <= 1 + 1e-9
        assert not {c.token for c in candidates} & set(SPECIAL_TOKENS)


def test_fill_mask_user_errors():
    mlm, clm = export_model("mlm", seed=10), export_model("clm", seed=10)
    with pytest.raises(UserError, match=r"no \[MASK\]"):
        fill_mask(mlm, TOK, "the cat sat")
    with pytest.raises(UserError, match="needs a masked-LM run; this run's objective is clm"):
        fill_mask(clm, TOK, "the [MASK] sat")
    with pytest.raises(UserError, match="selfsup fill-mask"):
        generate(mlm, TOK, "the cat")
    with pytest.raises(UserError, match="at most 8"):
        fill_mask(mlm, TOK, "the [MASK] " + "cat " * 7)  # 9 content tokens
    assert len(fill_mask(mlm, TOK, "the [MASK] " + "cat " * 6)) == 1  # 8 fit exactly
    with pytest.raises(ArtifactError, match="same run"):
        fill_mask(export_model("mlm", seed=10, vocab=V + 1), TOK, "the [MASK]")
    with pytest.raises(UserError, match="not a pretraining export model"):
        fill_mask(mlm.backbone, TOK, "the [MASK]")
