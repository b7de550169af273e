"""A corpus that grows in versions: first seen wins in dedup, and no document changes split."""

from __future__ import annotations

import numpy as np
import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from selfsup_model.config import DedupConfig, SplitConfig
from selfsup_model.corpus.dedup import extend_duplicates, find_duplicates
from selfsup_model.corpus.lsh import query_pairs
from selfsup_model.corpus.minhash import verify_pairs
from selfsup_model.corpus.splitting import (
    QUARANTINE_COLUMNS,
    SplitCorpus,
    assign_splits,
    extend_splits,
)

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


WORDS = DedupConfig(shingle="word", shingle_size=1)
SPLIT = SplitConfig()


def grow_splits(batches: list[list[str]], labels: list[list[str]] | None = None, cfg=SPLIT):
    """Dedup and split version by version, as the pipeline does: ([assignments], [quarantine],
    every id, every text)."""
    ids, texts, labs = [], [], []
    result = None
    out_assign, out_held = [], []
    for v, batch in enumerate(batches):
        start = len(ids)
        ids += [f"v{v}d{i}" for i in range(len(batch))]
        texts += batch
        labs += labels[v] if labels else [None] * len(batch)
        if result is None:
            result = find_duplicates(ids, texts, WORDS)
        else:
            prev_rows = np.r_[np.arange(start), np.full(len(batch), -1)]
            result = extend_duplicates(result, prev_rows, ids, texts, WORDS)
        kept = result.clusters["is_kept"].to_numpy()
        rows = np.flatnonzero(kept)
        clusters = result.clusters["cluster_id"].to_numpy()
        corpus = SplitCorpus([ids[i] for i in rows], [texts[i] for i in rows],
                             [labs[i] for i in rows], [None] * len(rows),
                             result.signatures[rows], clusters[rows])
        if not out_assign:
            split = assign_splits(corpus, cfg, WORDS)
            held = pd.DataFrame(columns=list(QUARANTINE_COLUMNS)).astype("string")
        else:
            split, held = extend_splits(corpus, out_assign[-1], out_held[-1], cfg, WORDS)
        out_assign.append(split.assignments)
        out_held.append(held)
    return out_assign, out_held, ids, texts


def topic_batch(rng, start: int, size: int, earlier: list[str]) -> list[str]:
    """Fresh word-set documents, plus near copies (one word swapped) of earlier ones."""
    out = []
    for i in range(size):
        if earlier and rng.random() < 0.3:
            words = earlier[rng.integers(len(earlier))].split()
            words[rng.integers(len(words))] = f"x{start}_{i}"
            out.append(" ".join(words))
        else:
            out.append(" ".join(f"t{start + i}_{j}" for j in range(10)))
    return out


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_no_document_ever_changes_split_and_no_split_leaks(seed):
    rng = np.random.default_rng(seed)
    batches, every = [], []
    for v in range(6):
        batch = topic_batch(rng, 1000 * v, 40 if v == 0 else int(rng.integers(2, 12)), every)
        batches.append(batch)
        every += batch
    assigns, helds, ids, texts = grow_splits(batches)
    first_split: dict[str, str] = {}
    for assign, held in zip(assigns, helds, strict=True):
        for doc, split in zip(assign["id"], assign["split"], strict=True):
            assert first_split.setdefault(doc, split) == split, doc
        assert not set(held["id"]) & set(assign["id"])
    # Recomputed independently: every pair of documents, exact word-set Jaccard.
    final = assigns[-1].set_index("id")["split"]
    rows = [ids.index(i) for i in final.index]
    pairs = np.array([(a, b) for a in range(len(rows)) for b in range(a + 1, len(rows))])
    jac = verify_pairs([texts[r] for r in rows], pairs, "word", 1)
    sides = (final.to_numpy() == "train")
    leaks = pairs[(jac >= SPLIT.relatedness_threshold) & (sides[pairs[:, 0]] != sides[pairs[:, 1]])]
    assert not len(leaks)


def test_a_newcomer_bridging_train_and_test_is_quarantined_and_stays_out():
    base = [" ".join(f"t{i}_{j}" for j in range(10)) for i in range(30)]
    first, _, ids, _ = grow_splits([base])
    split = first[0].set_index("id")["split"]
    a, b = base[ids.index(split[split == "train"].index[0])], base[ids.index(
        split[split == "test"].index[0])]
    # J = 0.5 with both; two words of a changed: J = 8/12, related but no duplicate
    bridge, near_a = a + " " + b, a.replace("_9", "_99").replace("_8", "_88")
    # related to the bridge (J = 14/26) and to a (J = 10/20), a duplicate of neither
    near_bridge = " ".join(bridge.split()[:14] + [f"n{k}" for k in range(6)])
    assigns, helds, ids, _ = grow_splits([base, [bridge, near_a], [near_bridge]])
    held = helds[1].set_index("id")
    assert list(held.index) == ["v1d0"]
    assert held.loc["v1d0", "reason"] == "related to earlier documents in test and train"
    assert assigns[1].set_index("id").loc["v1d1", "split"] == "train"  # joins its original
    # a later near copy of the quarantined document is quarantined too, for that reason
    assert helds[2].set_index("id").loc["v2d0", "reason"] == "related to a quarantined document"
    assert "v1d0" not in set(assigns[2]["id"]) and "v2d0" not in set(assigns[2]["id"])


def test_new_units_keep_per_label_proportions_near_the_target():
    rng = np.random.default_rng(3)
    batches, labels = [], []
    for v in range(10):
        size = 400 if v == 0 else 40
        batches.append([" ".join(f"t{v}_{i}_{j}" for j in range(10)) for i in range(size)])
        labels.append([str(rng.choice(["a", "b", "c"], p=[0.6, 0.3, 0.1])) for _ in range(size)])
    assigns, _, ids, _ = grow_splits(batches, labels)
    label_of = dict(zip(ids, [lab for batch in labels for lab in batch], strict=True))
    final = assigns[-1].assign(label=lambda f: f["id"].map(label_of))
    for label, part in final.groupby("label"):
        shares = part["split"].value_counts(normalize=True)
        for split, target in (("train", 0.8), ("val", 0.1), ("test", 0.1)):
            assert abs(shares.get(split, 0.0) - target) <= 0.02, (label, split, shares)
