"""A corpus that grows in versions: first seen wins in dedup, and no document changes split."""

from __future__ import annotations

import numpy as np
import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from selfsup_model.config import DedupConfig
from selfsup_model.corpus.dedup import extend_duplicates, find_duplicates
from selfsup_model.corpus.lsh import query_pairs

CFG = DedupConfig()  # char 5-shingles at J >= 0.8, as the pipeline


def grown_corpus(seed: int, sizes: list[int]) -> tuple[list[str], np.ndarray]:
    """Texts of several versions, earlier versions first: templated sentences, and in every
    version near copies (a word changed or appended), case-folded copies and verbatim copies
    of texts of the same or any earlier version, so that newcomers meet kept and dropped
    documents alike."""
    rng = np.random.default_rng(seed)
    words = [f"w{k}" for k in range(60)]
    texts, versions = [], []
    for version, size in enumerate(sizes):
        for _ in range(size):
            roll = rng.random()
            if texts and roll < 0.45:
                base = texts[rng.integers(len(texts))].split()
                if roll < 0.1:
                    text = " ".join(base).upper()
                elif roll < 0.15:
                    text = " ".join(base)
                elif roll < 0.3:
                    base[rng.integers(len(base))] = str(rng.choice(words))
                    text = " ".join(base)
                else:
                    text = " ".join([*base, str(rng.choice(words))])
            else:
                text = " ".join(rng.choice(words, size=int(rng.integers(8, 16))))
            texts.append(text)
            versions.append(version)
    return texts, np.asarray(versions)


def incremental(texts: list[str], versions: np.ndarray):
    """Dedup version by version: the first in one go, each later one against the last."""
    ids = [f"d{i}" for i in range(len(texts))]
    end = int((versions == 0).sum())
    result, history = find_duplicates(ids[:end], texts[:end], CFG), []
    for version in range(1, int(versions.max()) + 1):
        history.append(result)
        start, end = end, end + int((versions == version).sum())
        prev_rows = np.r_[np.arange(start), np.full(end - start, -1)]
        result = extend_duplicates(result, prev_rows, ids[:end], texts[:end], CFG)
    return result, history


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), sizes=st.lists(st.integers(1, 40), min_size=2, max_size=5))
def test_growing_dedup_keeps_what_one_dedup_with_precedence_keeps(seed, sizes):
    texts, versions = grown_corpus(seed, sizes)
    got, history = incremental(texts, versions)
    ids = [f"d{i}" for i in range(len(texts))]
    once = find_duplicates(ids, texts, CFG, versions=versions)
    pd.testing.assert_frame_equal(got.clusters.drop(columns="max_jaccard"),
                                  once.clusters.drop(columns="max_jaccard"))
    np.testing.assert_allclose(got.clusters["max_jaccard"], once.clusters["max_jaccard"])
    assert np.array_equal(got.signatures, once.signatures)
    assert np.array_equal(got.digests, once.digests)
    # First seen wins: a document's fate, once decided, never changes.
    for earlier in history:
        n = len(earlier.clusters)
        then, now = earlier.clusters, got.clusters.iloc[:n]
        for column in ("cluster_id", "is_kept", "kept_id", "kind"):
            assert then[column].tolist() == now[column].tolist(), column


def test_a_newcomer_near_a_kept_document_is_its_duplicate_even_when_longer():
    old = "alpha beta gamma delta epsilon zeta eta theta iota kappa"
    texts = [old, old + " lambda", "something else entirely different here"]
    ids = ["a", "b", "c"]
    first = find_duplicates(ids[:1], texts[:1], CFG)
    grown = extend_duplicates(first, np.array([0, -1, -1]), ids, texts, CFG)
    frame = grown.clusters.set_index("id")
    assert frame.loc["a", "is_kept"] and not frame.loc["b", "is_kept"]
    assert frame.loc["b", "kept_id"] == "a" and frame.loc["b", "kind"] == "near"
    assert frame.loc["c", "is_kept"] and frame.loc["c", "cluster_id"] == 1
    # In one version the longer text would have won (the representative rule).
    assert find_duplicates(ids[:2], texts[:2], CFG).clusters["kept_id"].tolist() == ["b", "b"]
    assert grown.counts["new_documents"] == 2 and grown.counts["new_duplicates_of_earlier"] == 1


def test_a_newcomer_bridging_two_kept_documents_joins_the_first_and_both_stay_kept():
    left = "one two three four five six seven eight nine ten"
    right = left + " eleven twelve thirteen"  # J(left, right) < 0.8: both kept in version 0
    bridge = left + " eleven"  # near both
    ids, texts = ["l", "r", "x"], [left, right, bridge]
    first = find_duplicates(ids[:2], texts[:2], CFG)
    assert first.clusters["is_kept"].all()
    grown = extend_duplicates(first, np.array([0, 1, -1]), ids, texts, CFG).clusters
    assert grown["is_kept"].tolist() == [True, True, False]
    assert grown["kept_id"].tolist() == ["l", "r", "l"]


def test_query_pairs_are_every_pair_with_a_query_once():
    rng = np.random.default_rng(0)
    for _ in range(100):
        n = int(rng.integers(1, 30))
        keys = rng.integers(0, 4, n).astype(np.uint64)
        query = rng.random(n) < 0.3
        found = [p for chunk in query_pairs(keys, query, budget=int(rng.integers(1, 9)))
                 for p in map(tuple, np.sort(chunk, axis=1).tolist())]
        expected = [(i, j) for i in range(n) for j in range(i + 1, n)
                    if keys[i] == keys[j] and (query[i] or query[j])]
        assert sorted(found) == expected
