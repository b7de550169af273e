"""Backbone masks, heads and save/load: the four-masks contract at tiny sizes."""

from __future__ import annotations

import random

import keras
import numpy as np
import pytest

from selfsup_model.config import ModelConfig
from selfsup_model.nn.layers import (
    FastDropout,
    PaddingMask,
    TokenAndPositionEmbedding,
    TransformerEncoderBlock,
    derive_seed,
)
from selfsup_model.nn.model import (
    MaskedLMHead,
    PretrainExportModel,
    PretrainingModel,
    build_backbone,
    build_pretrain_export_model,
    build_pretraining_model,
    token_embedding_of,
    with_dropout,
)
from selfsup_model.text.specials import CLS_ID, MASK_ID, PAD_ID, SEP_ID
from tests.nn.legacy_models import with_plain_keras_dropout

V, L = 24, 10


def _cfg(**kw) -> ModelConfig:
    return ModelConfig(**{"hidden": 8, "layers": 2, "heads": 2, "ff": 16, "dropout": 0.0, **kw})


def _ids(rows: list[list[int]], length: int = L) -> np.ndarray:
    out = np.full((len(rows), length), PAD_ID, dtype=np.int32)
    for i, row in enumerate(rows):
        full = [CLS_ID, *row, SEP_ID]
        out[i, : len(full)] = full
    return out


def _run(model, x) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(model(x, training=False)))


@pytest.fixture(scope="module", params=["post", "pre"])
def bidirectional(request):
    keras.utils.set_random_seed(1)
    return build_backbone(V, L, _cfg(norm=request.param))


@pytest.fixture(scope="module")
def causal():
    keras.utils.set_random_seed(2)
    return build_backbone(V, L, _cfg(), causal=True)


def test_causal_mask_future_tokens_do_not_change_earlier_states(causal):
    ids = _ids([[7, 8, 9, 10, 11, 12]])
    changed = ids.copy()
    changed[0, 5] = 20  # a token at position 5; positions 0..4 must not see it
    a, b = _run(causal, ids), _run(causal, changed)
    np.testing.assert_allclose(a[0, :5], b[0, :5], atol=1e-6)
    assert np.abs(a[0, 5:] - b[0, 5:]).max() > 1e-4


def test_bidirectional_states_do_see_later_tokens(bidirectional):
    ids = _ids([[7, 8, 9, 10, 11, 12]])
    changed = ids.copy()
    changed[0, 5] = 20
    assert np.abs(_run(bidirectional, ids)[0, :5]
                  - _run(bidirectional, changed)[0, :5]).max() > 1e-4


@pytest.mark.parametrize("norm,is_causal", [("post", False), ("pre", False), ("post", True)])
def test_real_positions_ignore_how_much_padding_follows(norm, is_causal):
    keras.utils.set_random_seed(6)
    backbone = build_backbone(V, L, _cfg(norm=norm), causal=is_causal)
    real = [7, 8, 9]  # [CLS] 7 8 9 [SEP] = 5 real tokens
    short, long = _ids([real], length=7), _ids([real], length=10)  # 2 vs 5 trailing [PAD]
    a, b = _run(backbone, short), _run(backbone, long)
    np.testing.assert_allclose(a[0, :5], b[0, :5], atol=1e-5)


def test_mask_token_is_a_visible_query_and_key(bidirectional):
    ids = _ids([[7, MASK_ID, 9, 10]])
    assert keras.ops.convert_to_numpy(PaddingMask()(ids))[0, :6].all()  # [MASK] is not padding
    embedding = token_embedding_of(bidirectional).token_embedding
    before = _run(bidirectional, ids)
    original = embedding.embeddings.numpy()
    try:  # other positions read the [MASK] position's content: it is an attended key
        moved = original.copy()
        # A random direction: a constant shift would be removed by LayerNorm's centring.
        moved[MASK_ID] += np.random.default_rng(0).normal(size=moved.shape[1]).astype(moved.dtype)
        embedding.embeddings.assign(moved)
        after = _run(bidirectional, ids)
    finally:
        embedding.embeddings.assign(original)
    others = [0, 1, 3, 4, 5]
    assert np.abs(before[0, others] - after[0, others]).max() > 1e-4
    assert np.isfinite(before).all()


@pytest.mark.parametrize("tie", [True, False])
def test_gathered_mlm_logits_equal_full_logits_at_those_positions(tie):
    keras.utils.set_random_seed(3)
    cfg = _cfg(tie_embeddings=tie)
    backbone = build_backbone(V, L, cfg)
    train = build_pretraining_model(backbone, "mlm", cfg)
    export = build_pretrain_export_model(backbone, train.head, "mlm")
    ids = _ids([[7, MASK_ID, 9, 10], [11, 12, MASK_ID, 14, 15, 16]])
    positions = np.array([[2, 0, 0], [3, 5, 0]], dtype=np.int32)  # padded slots point at 0
    gathered = _run(train, {"input_ids": ids, "mask_positions": positions})  # (B, P, V)
    full = _run(export, ids)  # (B, L, V)
    assert gathered.shape == (2, 3, V) and full.shape == (2, L, V)
    assert gathered.dtype == np.float32
    np.testing.assert_allclose(gathered, np.take_along_axis(full, positions[..., None], axis=1),
                               atol=1e-5)
    # Shared layers, not copies: the export model owns no variable the training model lacks.
    assert {id(v) for v in export.weights} <= {id(v) for v in train.weights}
    assert len({id(v) for v in train.trainable_weights}) == len(train.trainable_weights)
    if tie:
        assert not any("decoder" in v.path for v in train.weights)


def test_layer_configs_round_trip():
    block = TransformerEncoderBlock(8, 2, 16, dropout=0.1, norm="pre", causal=True, seed=5,
                                    name="b")
    assert (TransformerEncoderBlock.from_config(block.get_config()).get_config()
            == block.get_config())
    emb = TokenAndPositionEmbedding(V, L, 8, name="e")
    assert TokenAndPositionEmbedding.from_config(emb.get_config()).get_config() == emb.get_config()
    head = MaskedLMHead(V, 8, tie_embeddings=False, name="h")
    assert MaskedLMHead.from_config(head.get_config()).get_config() == head.get_config()
    with pytest.raises(ValueError, match="divisible"):
        TransformerEncoderBlock(9, 2, 16)


def test_derived_seeds_are_fixed_distinct_31_bit_and_none_stays_none():
    assert derive_seed(None, "qkv") is None
    seeds = [derive_seed(s, name) for s in (0, 1) for name in ("qkv", "ff_in", "block_0")]
    assert seeds == [derive_seed(s, name) for s in (0, 1) for name in ("qkv", "ff_in", "block_0")]
    assert len(set(seeds)) == len(seeds) and all(0 <= x < 2**31 for x in seeds)


def _state(model: keras.Model) -> list[np.ndarray]:
    """Every variable: weights, and dropout seed-generator states."""
    return [keras.ops.convert_to_numpy(v) for v in model.variables]


def _equal(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("objective", ["mlm", "clm"])
def test_a_seed_fixes_every_draw_whatever_pythons_global_random_holds(objective):
    """Keras draws a missing seed from Python's global `random`, which other threads of the
    process (MLflow's, Prefect's) draw from too; a seeded model must not read it at all."""
    cfg = _cfg(dropout=0.1, tie_embeddings=False)

    def build(global_state: int, seed: int | None) -> keras.Model:
        random.seed(global_state)
        backbone = build_backbone(V, L, cfg, causal=objective == "clm", seed=seed)
        return build_pretraining_model(backbone, objective, cfg, seed=seed)

    assert _equal(_state(build(1, seed=7)), _state(build(2, seed=7)))
    assert not _equal(_state(build(1, seed=7)), _state(build(1, seed=8)))
    assert not _equal(_state(build(1, seed=None)), _state(build(2, seed=None)))  # what it was
    # Parts never share a seed: no two kernels of one shape start alike.
    kernels = [keras.ops.convert_to_numpy(v) for v in build(1, seed=7).weights
               if v.path.endswith("kernel")]
    firsts = [k.reshape(-1)[:8].tobytes() for k in kernels]
    assert len(set(firsts)) == len(firsts)
    # A seeded re-initialisation of the same architecture (random_init) is fixed the same way.
    fresh = [with_dropout(build(g, seed=None).backbone, 0.1, keep_weights=False, seed=3)
             for g in (1, 2)]
    assert _equal(_state(fresh[0]), _state(fresh[1]))


@pytest.mark.parametrize("objective,tie", [("mlm", True), ("mlm", False), ("clm", True)])
def test_keras_save_load_safe_mode_round_trip_is_exact(tmp_path, objective, tie):
    keras.utils.set_random_seed(4)
    cfg = _cfg(tie_embeddings=tie)
    backbone = build_backbone(V, L, cfg, causal=objective == "clm")
    train = build_pretraining_model(backbone, objective, cfg)
    export = build_pretrain_export_model(backbone, train.head, objective)
    ids = _ids([[7, 8, MASK_ID, 10], [11, 12, 13]])
    x = {"input_ids": ids}
    if objective == "mlm":
        x["mask_positions"] = np.array([[3, 1], [2, 0]], dtype=np.int32)
    for model, inputs, cls in ((train, x, PretrainingModel), (export, ids, PretrainExportModel),
                               (backbone, ids, keras.Model)):
        path = tmp_path / f"{model.name}.keras"
        model.save(path)
        loaded = keras.saving.load_model(path, safe_mode=True)
        assert isinstance(loaded, cls)
        np.testing.assert_array_equal(_run(loaded, inputs), _run(model, inputs))
    reloaded = keras.saving.load_model(tmp_path / f"{export.name}.keras", safe_mode=True)
    # After reload the tie still holds: the head projects with the reloaded embedding matrix.
    assert (reloaded.head.token_embedding is token_embedding_of(reloaded.backbone)) == tie


def test_mixed_precision_backbone_still_returns_float32_logits():
    keras.utils.set_random_seed(5)
    cfg = _cfg()
    backbone = build_backbone(V, L, cfg, dtype="mixed_bfloat16")
    train = build_pretraining_model(backbone, "mlm", cfg)
    out = train({"input_ids": _ids([[7, 8, 9]]), "mask_positions": np.array([[1, 2]], np.int32)})
    assert keras.backend.standardize_dtype(out.dtype) == "float32"
    assert keras.backend.standardize_dtype(backbone.output.dtype) == "bfloat16"


def _dropped(layer, x, training=True) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(layer(x, training=training)))


@pytest.mark.parametrize("shape", [(64, 4, 32, 32), (97, 45, 61)])  # packed / flat draws
def test_fast_dropout_keeps_the_rate_and_the_expectation(shape):
    layer = FastDropout(0.1, seed=3)
    y = _dropped(layer, np.ones(shape, np.float32))
    n = y.size
    kept = y != 0
    # On TensorFlow the rate is rounded to 1/256 (26/256); keras' own draws elsewhere.
    rate = 26 / 256 if keras.backend.backend() == "tensorflow" else 0.1
    sd = np.sqrt(rate * (1 - rate) / n)
    assert abs(kept.mean() - (1 - rate)) < 5 * sd
    # Kept values are scaled so that E[y] = x exactly: scale * keep probability == 1.
    np.testing.assert_allclose(np.unique(y[kept]) * (1 - rate), 1.0, rtol=1e-6)
    assert abs(y.mean() - 1.0) < 5 * sd / (1 - rate)
    # Neighbours (bytes of one 32-bit draw) are independent: both dropped ~ rate^2.
    flat = ~kept.reshape(-1)[: n - n % 2].reshape(-1, 2)
    both = np.mean(flat[:, 0] & flat[:, 1])
    assert abs(both - rate**2) < 5 * np.sqrt(rate**2 * (1 - rate**2) / len(flat))


def test_fast_dropout_draws_fresh_masks_and_is_off_in_inference():
    layer = FastDropout(0.1, seed=3)
    x = np.random.default_rng(0).normal(size=(8, 16, 32)).astype(np.float32)
    first, second = _dropped(layer, x), _dropped(layer, x)
    assert not np.array_equal(first != 0, second != 0)
    np.testing.assert_array_equal(_dropped(layer, x, training=False), x)
    np.testing.assert_array_equal(_dropped(FastDropout(0.0), x), x)


def _lowbias32(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint32)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow's draw")
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("shape", [(3, 2, 8, 8), (5, 7, 3)])  # a multiple of 4 elements / not
def test_fast_dropout_mask_is_the_counter_hash_with_or_without_xla(jit, shape):
    import tensorflow as tf

    layer = FastDropout(0.25, seed=11)
    x = np.arange(1, np.prod(shape) + 1, dtype=np.float32).reshape(shape)
    layer(x, training=True)  # builds the seed state, advances it once
    state = np.asarray(layer.seed_generator.state.value, np.uint32)
    y = tf.function(lambda t: layer(t, training=True), jit_compile=jit)(x).numpy()
    # By hand: keys from the state's words, word j = mix(mix(j ^ k0) + k1), byte i of the
    # little-endian words belongs to flat element i; kept when the byte is >= 0.25 * 256.
    with np.errstate(over="ignore"):
        k0 = _lowbias32(state[:1] ^ np.uint32(0x9E3779B9))
        k1 = _lowbias32(state[1:] ^ np.uint32(0x85EBCA6B))
        words = _lowbias32(_lowbias32(np.arange((x.size + 3) // 4, dtype=np.uint32) ^ k0) + k1)
    keep = (words.astype("<u4").view(np.uint8)[: x.size] >= 64).reshape(shape)
    np.testing.assert_array_equal(y, np.where(keep, x * np.float32(256 / 192), 0))
    assert 0 < keep.mean() < 1
    assert np.array_equal(np.asarray(layer.seed_generator.state.value), state + [0, 1])


def test_fast_dropout_falls_back_where_bytes_cannot_resolve_the_rate():
    # 0.001 * 256 rounds to 0: bytes would drop nothing, so keras' own draws take over.
    y = _dropped(FastDropout(0.001, seed=1), np.ones((256, 1024), np.float32))
    assert 0.0005 < (y == 0).mean() < 0.002


def test_block_dropout_is_active_in_training_only():
    keras.utils.set_random_seed(2)
    block = TransformerEncoderBlock(8, 2, 16, dropout=0.3, name="b")
    x = np.random.default_rng(1).normal(size=(2, 6, 8)).astype(np.float32)
    mask = np.ones((2, 6), bool)
    infer = [np.asarray(block(x, padding_mask=mask, training=False)) for _ in range(2)]
    train = [np.asarray(block(x, padding_mask=mask, training=True)) for _ in range(2)]
    np.testing.assert_array_equal(infer[0], infer[1])
    assert not np.allclose(train[0], train[1])
    assert all(isinstance(layer, keras.layers.Dropout)
               for layer in (block.probs_dropout, block.attention_dropout, block.ff_dropout))


def test_with_dropout_turns_a_saved_plain_keras_dropout_into_fast_dropout(tmp_path):
    """A backbone saved before FastDropout existed (keras' Dropout after the embeddings) comes
    back from `with_dropout` with FastDropout at the new rate and its weights unchanged."""
    keras.utils.set_random_seed(6)
    source = build_backbone(V, L, _cfg(dropout=0.1))
    old = with_plain_keras_dropout(source)
    old.save(tmp_path / "old.keras")
    old = keras.saving.load_model(tmp_path / "old.keras", safe_mode=True)
    assert type(old.get_layer("embeddings_dropout")) is keras.layers.Dropout
    rebuilt = with_dropout(old, 0.25)
    dropouts = [layer for layer in rebuilt._flatten_layers()
                if isinstance(layer, keras.layers.Dropout)]
    assert len(dropouts) == 1 + 3 * 2  # embeddings, then three sites in each of two blocks
    assert all(type(d) is FastDropout and d.rate == 0.25 for d in dropouts)
    ids = _ids([[7, 8, 9, 10], [11, 12]])
    np.testing.assert_allclose(_dropped(rebuilt, ids, training=False),
                               _dropped(source, ids, training=False), rtol=1e-6, atol=1e-6)
    rebuilt.save(tmp_path / "new.keras")  # FastDropout is registered: a safe load finds it
    loaded = keras.saving.load_model(tmp_path / "new.keras", safe_mode=True)
    assert type(loaded.get_layer("embeddings_dropout")) is FastDropout
