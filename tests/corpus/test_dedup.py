"""Shingling, MinHash, LSH and find_duplicates on corpora whose Jaccard is countable by hand.

Word shingles of size 1 over made-up words make a document a plain word set,
so J(A, B) = |A & B| / |A | B| is a ratio of small integers.
"""

import io

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from selfsup_model.config import DedupConfig
from selfsup_model.corpus import dedup, lsh, minhash
from selfsup_model.corpus.dedup import find_duplicates
from selfsup_model.errors import UserError

WORDS = DedupConfig(shingle="word", shingle_size=1)


def words(start: int, stop: int, prefix: str = "w") -> str:
    return " ".join(f"{prefix}{i}" for i in range(start, stop))


def replace_tail(k: int, n: int = 100) -> str:
    """w0..w{n-1} with the last k words swapped for new ones: J to the original = (n-k)/(n+k)."""
    return " ".join([f"w{i}" for i in range(n - k)] + [f"x{i}" for i in range(k)])


def ids_for(texts):
    return [f"d{i}" for i in range(len(texts))]


def all_pairs(keys):
    """Stand-in for an LSH band that proposes every pair: verification alone must decide."""
    n = len(keys)
    i, j = np.triu_indices(n, k=1)
    return np.stack([i, j], axis=1).astype(np.int64)


# --- shingling and signatures -------------------------------------------------------------


def test_folding_lowercases_and_collapses_whitespace():
    assert minhash.fold_for_shingling("  Hello\n\tWORLD  again ") == "hello world again"


def test_shingle_counts_and_short_texts_yield_one_shingle():
    ids, offsets = minhash.shingle_ids(["abcdefg", "abc", "", "a b c"], "char", 5)
    assert np.diff(offsets).tolist() == [3, 1, 1, 1]
    ids, offsets = minhash.shingle_ids(["a b c d", "a b", ""], "word", 3)
    assert np.diff(offsets).tolist() == [2, 1, 1]
    assert ids.dtype == np.uint32


def reference_char_id(shingle: str) -> int:
    """The documented id, in plain Python: polynomial hash mod 2^64, then murmur3's finaliser."""
    mask = (1 << 64) - 1
    h = 0
    for ch in shingle:
        h = (h * 0x100000001B3 + ord(ch)) & mask
    for mult in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53):
        h = ((h ^ (h >> 33)) * mult) & mask
    return (h ^ (h >> 33)) & 0xFFFF_FFFF


def test_shingle_ids_are_a_fixed_function_of_the_text():
    # Unlike a salted hash(), the id is the same in every process and every batch.
    ids, _ = minhash.shingle_ids(["xx hello", "héllo"], "char", 5)
    assert ids.tolist()[-1] == reference_char_id("héllo")
    assert ids.tolist()[:4] == [reference_char_id(s) for s in ("xx he", "x hel", " hell", "hello")]


@pytest.mark.parametrize("budget", [1, 1 << 22])  # one pair / one document per pass, or all
def test_word_set_jaccard_is_exact(budget, monkeypatch):
    monkeypatch.setattr(minhash, "_GATHER_BUDGET", budget)
    texts = [words(0, 20), words(2, 22), words(100, 105), "w0 w0 w1"]
    pairs = np.array([[0, 1], [0, 2], [3, 0], [1, 1]])
    got = minhash.verify_pairs(texts, pairs, "word", 1)
    assert got.tolist() == [18 / 22, 0.0, 2 / 20, 1.0]


def test_signatures_match_brute_force_across_chunks_and_batches(monkeypatch):
    monkeypatch.setattr(minhash, "_CHUNK_ELEMENTS", 16 * 7)  # 7 shingles a chunk: docs span chunks
    texts = ["alpha beta gamma delta", "x", "the same text the same text", ""]
    sig = minhash.minhash_signatures(texts, num_perm=16, seed=3, batch_size=3)
    ids, offsets = minhash.shingle_ids([minhash.fold_for_shingling(t) for t in texts], "char", 5)
    a, b = minhash.permutations(16, 3)
    for d in range(len(texts)):
        x = ids[offsets[d] : offsets[d + 1]]
        ref = (a[:, None] * x[None, :] + b[:, None]).min(axis=1)  # uint32 wraps: mod 2^32
        np.testing.assert_array_equal(sig[d], ref)
    assert sig.dtype == np.uint32 and sig.shape == (4, 16)


def test_signature_agreement_estimates_jaccard():
    a, b = words(0, 200), words(67, 267)  # J = 133 / 267 ~ 0.498
    sig = minhash.minhash_signatures([a, b], num_perm=512, kind="word", size=1)
    assert abs((sig[0] == sig[1]).mean() - 133 / 267) < 0.07  # ~3 standard errors


def test_lsh_params_weight_misses_over_false_candidates():
    assert lsh.lsh_params(0.8, 128, miss_weight=0.5) == (9, 13)  # datasketch's default
    bands, rows = lsh.lsh_params(0.8, 128)
    assert bands * rows <= 128
    assert (
        1 - (1 - 0.8**rows) ** bands > 0.9
    )  # a pair right at the threshold is usually a candidate


def test_signature_prefilter_only_drops_hopeless_pairs():
    texts = [words(0, 100), words(5, 105), words(50, 150), words(500, 600)]  # J: 0.905, 0.333, 0
    sig = minhash.minhash_signatures(texts, num_perm=128, kind="word", size=1)
    pairs = np.array([[0, 1], [0, 2], [0, 3]])
    assert minhash.plausible_pairs(sig, pairs, 0.8).tolist() == [True, False, False]
    kept, jac, skipped = minhash.verify_candidates(texts, sig, pairs, 0.8, "word", 1)
    assert kept.tolist() == [[0, 1]] and jac.tolist() == [95 / 105] and skipped == 2


word_sets = st.lists(st.lists(st.integers(0, 60), min_size=1, max_size=40), min_size=2, max_size=12)


@settings(max_examples=40, deadline=None)
@given(sets=word_sets, threshold=st.sampled_from([0.3, 0.5, 0.8]))
def test_cheap_pair_tests_never_drop_a_related_pair(sets, threshold):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lsh, "_SKETCH_BITS", 64)  # a tiny sketch: buckets collide, the bound holds
        check_cheap_pair_tests(sets, threshold)


def check_cheap_pair_tests(sets, threshold):
    texts = [" ".join(f"w{i}" for i in s) for s in sets]
    sig = minhash.minhash_signatures(texts, num_perm=32, kind="word", size=1)
    i, j = np.triu_indices(len(texts), k=1)
    pairs = np.stack([i, j], axis=1)
    exact = np.array(
        [len(set(sets[a]) & set(sets[b])) / len(set(sets[a]) | set(sets[b])) for a, b in pairs]
    )
    cache = lsh.ShingleCache(texts, "word", 1)
    assert np.array_equal(cache.jaccard(pairs), exact)
    assert cache.may_reach(pairs, threshold)[exact >= threshold].all()  # an upper bound
    low = np.ascontiguousarray(sig.astype(np.uint8)).view(np.uint64)
    for floor in (4.0, 9.5, 16.0):
        full = minhash.agreement_at_least(sig, pairs, floor)
        assert np.array_equal(
            minhash.byte_agreement_at_least(low, pairs, floor),
            minhash.agreement_at_least(sig.astype(np.uint8), pairs, floor),
        )
        assert minhash.byte_agreement_at_least(low, pairs, floor)[full].all()  # never stricter
    judge = lsh.PairJudge(texts, sig, threshold, "word", 1)
    related, jac = judge.related(np.r_[pairs, pairs[::-1]])  # repeats are judged once
    plausible = minhash.plausible_pairs(sig, pairs, threshold)
    want = pairs[plausible & (exact >= threshold)]
    assert related.tolist() == want.tolist()
    assert jac.tolist() == exact[plausible & (exact >= threshold)].tolist()


@settings(max_examples=60, deadline=None)
@given(batches=st.lists(st.sets(st.integers(0, 400), max_size=60), max_size=25),
       probes=st.lists(st.integers(-5, 405), max_size=50))
def test_sorted_codes_hold_exactly_what_was_added(batches, probes):
    """The pair judge's memory of "unrelated" verdicts, grown by many batches: a code is held
    once added and never otherwise, whichever run it sits in."""
    held, seen = minhash.SortedCodes(), set()
    for batch in batches:
        fresh = np.array(sorted(batch - seen), dtype=np.int64)
        held.add(fresh)
        seen |= batch
        query = np.array(sorted(seen) + probes, dtype=np.int64)
        assert held.contains(query).tolist() == [q in seen for q in query.tolist()]
    assert len(held) == len(seen)


def test_occupancy_bound_rules_out_unrelated_pairs():
    a, b, c = words(0, 300), words(150, 450), words(0, 270) + " " + words(1000, 1030)
    cache = lsh.ShingleCache([a, b, c], "word", 1)  # J(a, b) = 1/3, J(a, c) = 0.9
    assert cache.may_reach(np.array([[0, 1], [0, 2]]), 0.5).tolist() == [False, True]


# --- find_duplicates ------------------------------------------------------------------------


def test_exact_duplicates_after_normalisation_keep_the_first():
    texts = ["Hello   World foo bar", "unrelated words here", "hello world FOO\nbar"]
    calls = []
    res = find_duplicates(
        ids_for(texts),
        texts,
        DedupConfig(num_perm=16, batch_size=1),
        progress=lambda *a: calls.append(a),
    )
    assert calls == [(1, 2), (2, 2)]  # one call per batch of distinct texts
    c = res.clusters
    assert c["is_kept"].tolist() == [True, True, False]
    assert c["kept_id"].tolist() == ["d0", "d1", "d0"]
    assert c["kind"].tolist() == ["unique", "unique", "exact"]
    assert c["max_jaccard"].tolist() == [1.0, 0.0, 1.0]
    assert c["cluster_id"].tolist() == [0, 1, 0]
    np.testing.assert_array_equal(res.signatures[0], res.signatures[2])
    assert res.counts["exact_duplicates"] == 1 and res.counts["near_duplicates"] == 0


def test_near_duplicates_found_by_lsh_and_longest_text_is_kept():
    # J = 99/100 and 97/103: LSH at 0.8 with 9 bands x 13 rows misses these with p < 0.01.
    texts = [words(0, 99), words(500, 560), words(0, 100), replace_tail(3)]
    res = find_duplicates(ids_for(texts), texts, WORDS)
    c = res.clusters.set_index("id")
    assert c.loc["d2", "is_kept"]  # the longest member, although it comes after d0
    assert c.loc[["d0", "d3"], "kept_id"].tolist() == ["d2", "d2"]
    assert c.loc[["d0", "d3"], "kind"].tolist() == ["near", "near"]
    assert c.loc["d0", "max_jaccard"] == pytest.approx(99 / 100)
    assert c.loc["d3", "max_jaccard"] == pytest.approx(97 / 103)
    assert c.loc["d2", "max_jaccard"] == pytest.approx(99 / 100)
    assert res.counts["duplicates_removed"] == 2 and res.counts["kept"] == 2
    assert res.counts["verified_pairs"] <= res.counts["candidate_pairs"]


def test_every_candidate_is_verified_on_both_sides_of_the_threshold(monkeypatch):
    monkeypatch.setattr(dedup, "band_candidates", all_pairs)
    above = [words(0, 100), replace_tail(11)]  # J = 89/111 = 0.802
    res = find_duplicates(ids_for(above), above, WORDS)
    assert res.clusters["is_kept"].tolist() == [True, False]
    assert res.pairs["jaccard"].tolist() == [pytest.approx(89 / 111)]
    below = [words(0, 100), replace_tail(12)]  # J = 88/112 = 0.786
    res = find_duplicates(ids_for(below), below, WORDS)
    assert res.clusters["is_kept"].tolist() == [True, True]
    assert res.counts["candidate_pairs"] == 1 and res.counts["verified_pairs"] == 0


def test_chain_forms_one_cluster_scored_against_the_representative(monkeypatch):
    monkeypatch.setattr(dedup, "band_candidates", all_pairs)
    # J(A,B) = J(B,C) = 36/44 >= 0.8 but J(A,C) = 32/48: one cluster through B.
    texts = [words(0, 40), words(4, 44), words(8, 48)]
    res = find_duplicates(ids_for(texts), texts, WORDS)
    c = res.clusters
    assert c["cluster_id"].tolist() == [0, 0, 0]
    assert c["kept_id"].tolist() == ["d2"] * 3  # C has the longest text (fewest 2-char words)
    assert c["max_jaccard"].tolist() == pytest.approx([32 / 48, 36 / 44, 36 / 44])


def test_output_is_deterministic():
    texts = [words(0, 30), words(0, 30).upper(), words(1, 31), "short", words(40, 90)]
    first = find_duplicates(ids_for(texts), texts, DedupConfig(num_perm=32))
    second = find_duplicates(ids_for(texts), texts, DedupConfig(num_perm=32))

    def parquet(df):
        buf = io.BytesIO()
        df.to_parquet(buf)
        return buf.getvalue()

    assert parquet(first.clusters) == parquet(second.clusters)
    np.testing.assert_array_equal(first.signatures, second.signatures)
    assert first.counts == second.counts
    reseeded = find_duplicates(ids_for(texts), texts, DedupConfig(num_perm=32, seed=2))
    assert not np.array_equal(first.signatures, reseeded.signatures)


def test_bad_inputs_are_user_errors():
    with pytest.raises(UserError, match="unique"):
        find_duplicates(["a", "a"], ["x", "y"], WORDS)
    with pytest.raises(UserError, match="no documents"):
        find_duplicates([], [], WORDS)
    with pytest.raises(UserError, match="align"):
        find_duplicates(["a"], ["x", "y"], WORDS)


# --- the laws that hold for every corpus ----------------------------------------------------

corpus = st.lists(
    st.lists(st.sampled_from(["a", "b", "c", "d", "e", "f"]), min_size=0, max_size=8).map(" ".join),
    min_size=1,
    max_size=25,
)


@settings(max_examples=40, deadline=None)
@given(texts=corpus, shingle=st.sampled_from(["char", "word"]))
def test_every_document_lands_in_exactly_one_cluster(texts, shingle):
    cfg = DedupConfig(shingle=shingle, shingle_size=2, num_perm=16, threshold=0.5)
    res = find_duplicates(ids_for(texts), texts, cfg)
    c = res.clusters
    assert c["id"].tolist() == ids_for(texts)
    assert res.counts["kept"] + res.counts["duplicates_removed"] == res.counts["documents"]
    assert res.counts["kept"] == c["is_kept"].sum() == c["cluster_id"].nunique()
    kept = c[c["is_kept"]].set_index("id")
    assert (kept.index == kept["kept_id"]).all()
    assert kept["cluster_id"].is_unique
    dropped = c[~c["is_kept"]]
    assert dropped["kept_id"].isin(kept.index).all()
    assert (kept.loc[dropped["kept_id"], "cluster_id"].to_numpy() == dropped["cluster_id"]).all()
    exact = dropped["kind"] == "exact"
    norm = pd.Series([minhash.fold_for_shingling(t) for t in texts], index=c["id"])
    assert (
        norm[dropped["id"][exact]].to_numpy() == norm[dropped["kept_id"][exact]].to_numpy()
    ).all()
