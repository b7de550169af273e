"""Sharded dedup: any shard count, and shards whose arguments travel by pickle, give the same
result as one in-process shard, bit for bit."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

from selfsup_model.config import DedupConfig
from selfsup_model.corpus.dedup import find_duplicates, first_occurrence
from selfsup_model.corpus.sharding import ParquetTexts, pair_chunks, shard_bounds


@given(st.integers(0, 500), st.integers(1, 40))
def test_shard_bounds_cut_every_row_once_in_order(n, shards):
    bounds = shard_bounds(n, shards)
    rows = [i for lo, hi in bounds for i in range(lo, hi)]
    assert rows == list(range(n))
    assert all(hi > lo for lo, hi in bounds) and len(bounds) <= shards
    if n:
        sizes = [hi - lo for lo, hi in bounds]
        assert max(sizes) - min(sizes) <= 1


def test_shard_bounds_by_hand_and_bad_count():
    assert shard_bounds(10, 3) == [(0, 3), (3, 7), (7, 10)]
    assert shard_bounds(2, 5) == [(0, 1), (1, 2)]
    with pytest.raises(ValueError, match="shards"):
        shard_bounds(10, 0)


def test_pair_chunks_keep_order_and_respect_the_budget():
    pairs = np.arange(20).reshape(10, 2)
    chunks = pair_chunks(pairs, shards=3, budget=2)
    assert len(chunks) == 5 and all(len(c) <= 2 for c in chunks)
    np.testing.assert_array_equal(np.concatenate(chunks), pairs)
    assert len(pair_chunks(pairs, shards=4)) == 4
    assert pair_chunks(pairs[:0], shards=4) == []


def test_first_occurrence_numbers_texts_in_order_of_first_appearance():
    digests = np.array([[5, 1], [2, 2], [5, 1], [0, 9], [2, 2]], dtype=np.uint64)
    code, first = first_occurrence(digests)
    assert code.tolist() == [0, 1, 0, 2, 1]
    assert first.tolist() == [0, 1, 3]


class PicklingMapper:
    """Runs shards here, but only after a pickle round trip of every argument and result, as
    a Dask worker would; records what it was asked to run."""

    in_process = False

    def __init__(self):
        self.calls = []

    def __call__(self, name, fn, items, progress=None):
        self.calls.append((name, len(items)))
        return [pickle.loads(pickle.dumps(fn(**pickle.loads(pickle.dumps(item)))))
                for item in items]


def _corpus(n=400, seed=0):
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(200)]
    bases = [[rng.choice(vocab) for _ in range(40)] for _ in range(60)]
    texts = []
    for _ in range(n):
        words = list(rng.choice(bases))
        for _ in range(rng.choice([0, 0, 1, 2, 15])):  # exact, near and unrelated variants
            words[rng.randrange(len(words))] = rng.choice(vocab)
        text = " ".join(words)
        texts.append(text.upper() if rng.random() < 0.1 else text)
    return [f"d{i}" for i in range(n)], texts


@pytest.mark.parametrize("cfg", [DedupConfig(num_perm=64),
                                 DedupConfig(num_perm=64, threshold=0.5, shingle="word",
                                             shingle_size=2)])
def test_any_shard_count_and_a_pickling_mapper_give_identical_results(cfg, tmp_path):
    ids, texts = _corpus()
    path = tmp_path / "docs.parquet"
    pd.DataFrame({"id": ids, "text": texts}).to_parquet(path)
    base = find_duplicates(ids, texts, cfg)
    assert base.counts["exact_duplicates"] > 0 and base.counts["near_duplicates"] > 0
    for shards in (2, 7):
        mapper = PicklingMapper()
        got = find_duplicates(ids, ParquetTexts(str(path)), cfg, mapper=mapper, shards=shards)
        pd.testing.assert_frame_equal(got.clusters, base.clusters)
        pd.testing.assert_frame_equal(got.pairs, base.pairs)
        np.testing.assert_array_equal(got.signatures, base.signatures)
        assert got.counts == base.counts
        calls = dict(mapper.calls)
        assert calls["dedup-signatures"] == shards
        assert calls["dedup-bands"] == base.counts["lsh_bands"]
        assert calls["dedup-verify"] >= min(shards, base.counts["candidate_pairs"])


def test_texts_in_memory_are_not_shipped_to_other_processes():
    ids, texts = _corpus(20)
    with pytest.raises(ValueError, match="TextSource"):
        find_duplicates(ids, texts, DedupConfig(num_perm=16), mapper=PicklingMapper(), shards=2)
