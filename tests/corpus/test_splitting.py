"""Leak-safe splitting on hand-built corpora of word sets (word shingles of size 1)."""

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from selfsup_model.config import DedupConfig, SplitConfig
from selfsup_model.corpus import lsh, minhash
from selfsup_model.corpus.graph import components, first_seen_ids
from selfsup_model.corpus.leakage import leakage_audit
from selfsup_model.corpus.splitting import (
    UNIT_COLUMN_SEED,
    SplitCorpus,
    assign_splits,
    build_units,
    documents_in_split,
)
from selfsup_model.errors import ArtifactError, UserError

WORDS = DedupConfig(shingle="word", shingle_size=1, num_perm=128)
SPLIT = SplitConfig()


def lone(i: int, size: int = 12) -> str:
    """A document sharing no word with any other."""
    return " ".join(f"t{i}_{j}" for j in range(size))


def words(start: int, stop: int) -> str:
    return " ".join(f"w{i}" for i in range(start, stop))


def split_corpus(texts, labels=None, groups=None, cfg=SPLIT, dedup_cfg=WORDS):
    n = len(texts)
    sig = minhash.minhash_signatures(
        texts,
        num_perm=dedup_cfg.num_perm,
        seed=dedup_cfg.seed,
        kind=dedup_cfg.shingle,
        size=dedup_cfg.shingle_size,
    )
    corpus = SplitCorpus([f"d{i}" for i in range(n)], texts, labels or [None] * n,
                         groups or [None] * n, sig, np.arange(n))
    return assign_splits(corpus, cfg, dedup_cfg)


def split_of(result, doc_ids):
    frame = result.assignments.set_index("id")
    return frame.loc[doc_ids, "split"].tolist()


def test_stratified_split_matches_fractions_and_label_mix():
    texts = [lone(i) for i in range(100)]
    labels = ["a" if i % 2 else "b" for i in range(100)]
    res = split_corpus(texts, labels)
    assert res.counts["docs_per_split"] == {"train": 80, "val": 10, "test": 10}
    assert res.counts["labels_per_split"] == {
        "train": {"a": 40, "b": 40},
        "val": {"a": 5, "b": 5},
        "test": {"a": 5, "b": 5},
    }
    assert res.counts["units"] == 100 and res.warnings == []
    assert res.audit["passed"] and res.audit["related_pairs"] == 0
    assert list(res.assignments.columns) == ["id", "split", "cluster_id", "unit_id", "group"]
    assert res.assignments["id"].tolist() == [f"d{i}" for i in range(100)]


def test_chain_of_related_documents_is_one_unit():
    # J(A,B) = J(B,C) = 49/71 >= 0.5 but J(A,C) = 38/82 < 0.5: only the chain joins A and C.
    chain = [words(0, 60), words(11, 71), words(22, 82)]
    values, offsets = minhash.shingle_sets(chain, "word", 1)
    assert minhash.pair_jaccard(values, offsets, np.array([0]), np.array([2]))[0] < 0.5
    res = split_corpus(chain + [lone(i) for i in range(30)])
    units = res.assignments["unit_id"].tolist()
    assert units[0] == units[1] == units[2]
    assert len(set(split_of(res, ["d0", "d1", "d2"]))) == 1
    assert res.counts["related_pairs"] >= 2 and res.counts["units"] == 31


def test_mixed_unit_counts_toward_each_of_its_labels():
    # One group of 30 'a' + 10 'b' docs, then singletons: 50 'a' and 70 'b' (80 of each).
    labels = ["a"] * 30 + ["b"] * 10 + ["a"] * 50 + ["b"] * 70
    groups = ["big"] * 40 + [None] * 120
    res = split_corpus([lone(i) for i in range(160)], labels, groups)
    assert res.counts["labels_per_split"] == {
        "train": {"a": 64, "b": 64},
        "val": {"a": 8, "b": 8},
        "test": {"a": 8, "b": 8},
    }


def test_group_spanning_dissimilar_documents_stays_in_one_split():
    texts = [lone(i) for i in range(40)]
    groups = ["pkg/a.py" if i % 8 == 0 else None for i in range(40)]  # 5 unrelated docs
    res = split_corpus(texts, groups=groups)
    members = [f"d{i}" for i in range(0, 40, 8)]
    assert len(set(split_of(res, members))) == 1
    assert res.counts["units"] == 36 and res.audit["groups_across_splits"] == 0


def test_label_with_a_single_unit_warns():
    texts = [lone(i) for i in range(31)]
    labels = ["common"] * 30 + ["rare"]
    res = split_corpus(texts, labels)
    assert res.warnings == [
        "label 'rare' is missing from val, test: its 1 docs sit in only 1 split unit(s)"
    ]
    assert sum(res.counts["docs_per_split"].values()) == 31


def test_same_inputs_give_identical_assignments_and_seed_matters():
    texts = [lone(i) for i in range(50)]
    labels = ["x", "y"] * 25
    first, second = split_corpus(texts, labels), split_corpus(texts, labels)
    assert first.assignments.equals(second.assignments)
    assert first.counts == second.counts and first.audit == second.audit
    other = split_corpus(texts, labels, cfg=SplitConfig(seed=8))
    assert not other.assignments["split"].equals(first.assignments["split"])


def test_too_few_units_is_a_user_error():
    # Three related documents are one unit: nothing to put in val or test.
    with pytest.raises(UserError, match="only 2 split unit"):
        split_corpus([words(0, 50), words(1, 51), lone(1)])


def test_split_left_empty_is_a_user_error():
    # Three labels with one unit each: every stratum's single unit goes to train.
    with pytest.raises(UserError, match="'val' ended up empty"):
        split_corpus([lone(i) for i in range(3)], ["a", "b", "c"])


def leaky_corpus():
    texts = [words(0, 40), words(1, 41)] + [lone(i) for i in range(8)]  # d0 ~ d1: J = 39/41
    splits = ["train", "val"] + ["train"] * 6 + ["test"] * 2
    groups = [None] * 8 + ["g", "g"]
    sig = minhash.minhash_signatures(texts, num_perm=128, kind="word", size=1)
    return [f"d{i}" for i in range(10)], texts, splits, groups, sig


def test_audit_raises_on_a_forced_leak_and_names_it():
    ids, texts, splits, groups, sig = leaky_corpus()
    with pytest.raises(UserError, match=r"d1 ~ d0 \(J=0.95\)"):
        leakage_audit(ids, texts, splits, groups, sig, SplitConfig(), WORDS)


def test_audit_warn_mode_reports_pairs_and_groups():
    ids, texts, splits, groups, sig = leaky_corpus()
    groups[1] = "g"  # the val leak also shares group g with the test docs
    audit = leakage_audit(ids, texts, splits, groups, sig, SplitConfig(audit_action="warn"), WORDS)
    assert audit["related_pairs"] == 1 and not audit["passed"]
    assert audit["related_examples"] == [
        {"id": "d1", "train_id": "d0", "split": "val", "jaccard": round(39 / 41, 6)}
    ]
    assert audit["groups_across_splits"] == 1
    assert audit["group_examples"] == [{"group": "g", "splits": ["test", "val"]}]
    assert "leakage audit failed" in audit["message"]


@pytest.mark.parametrize("new", [None, np.array([False, True] + [False] * 8)])
def test_audit_leaves_out_documents_held_out_of_every_split(new):
    """A quarantined document (split None) is in no pair and no group: d1, d0's near-copy,
    and d9, which shares group g with test's d8, are held out; the audit then passes, on the
    whole corpus as on a grown one's new documents."""
    ids, texts, splits, groups, sig = leaky_corpus()
    splits[1], splits[9], groups[1] = None, None, "g"
    audit = leakage_audit(ids, texts, splits, groups, sig, SplitConfig(), WORDS, new=new)
    assert audit["passed"] and audit["related_pairs"] == 0
    assert audit["groups_across_splits"] == 0
    splits[1] = "val"  # back in a split: the same pair is a leak again
    with pytest.raises(UserError, match=r"d1 ~ d0"):
        leakage_audit(ids, texts, splits, groups, sig, SplitConfig(), WORDS, new=new)


def test_documents_in_split_follow_assignment_order():
    docs = pd.DataFrame({"text": ["a", "b", "c", "d"], "id": ["d0", "d1", "d2", "d3"]})
    assign = pd.DataFrame(
        {"id": ["d3", "d1", "d0", "d2"], "split": ["val", "test", "val", "train"]}
    )
    val = documents_in_split(docs, assign, "val")
    assert list(val.columns) == ["text", "id"] and val.index.tolist() == [0, 1]
    assert val["id"].tolist() == ["d3", "d0"] and val["text"].tolist() == ["d", "a"]
    assert documents_in_split(docs, assign, "test")["id"].tolist() == ["d1"]
    unknown = documents_in_split(docs, assign, "holdout")
    assert unknown.empty and list(unknown.columns) == ["text", "id"]
    with pytest.raises(ArtifactError, match="'d9'"):
        documents_in_split(docs.iloc[:3], assign.assign(id=["d9", "d1", "d0", "d2"]), "val")


# --- templated text: big buckets, bounded work, no leaks ----------------------------------

CHARS = DedupConfig()  # the pipeline's default: character 5-grams


def templated(n: int, seed: int) -> list[str]:
    """Package-description boilerplate with slot fillers: large LSH buckets at J ~ 0.3-0.9."""
    rng = np.random.default_rng(seed)
    stems = [
        "{n} is a Python library to {v} {d}. Install it with pip install {n}.",
        "A Python wrapper for the {s} API. It lets you {v} {d} in a few lines of code.",
        "{n}: {v} {d} with type hints and zero dependencies. Released under the MIT license.",
    ]
    slot = {
        "n": [f"pkg{k}" for k in range(40)],
        "v": ["parse", "render", "index", "stream", "sync", "export"],
        "d": ["time series", "PDF files", "web pages", "audio", "spreadsheets"],
        "s": ["Slack", "GitHub", "Stripe", "Notion"],
    }
    texts = []
    for _ in range(n):
        fill = {k: str(rng.choice(v)) for k, v in slot.items()}
        tail = " ".join(f"x{int(w)}" for w in rng.integers(0, 300, int(rng.integers(0, 12))))
        texts.append(f"{stems[int(rng.integers(0, 3))].format(**fill)} {tail}".strip())
    return texts


def test_big_bucket_of_templated_near_copies_is_one_unit_at_linear_cost():
    # 300 near-copies (J ~ 0.9 pairwise, each its own dedup cluster) share every LSH bucket:
    # 44,850 candidate pairs, of which a chain of ~300 checks joins them all.
    stem = "this package provides a simple api for parsing configuration files quickly"
    copies = [f"{stem} variant number {i}" for i in range(300)]
    res = split_corpus(copies + [lone(i) for i in range(30)], dedup_cfg=CHARS)
    units = res.assignments["unit_id"].to_numpy()
    assert len(set(units[:300])) == 1 and len(set(units[300:])) == 30
    assert res.counts["largest_unit"] == 300 and res.counts["units"] == 31
    assert res.counts["verified_pairs"] < 3 * 300  # not 44,850
    assert res.audit["passed"]


def cross_split_jaccards(texts, splits, size=5):
    """Exact char-shingle Jaccard of every (train, val/test) pair, by Python sets."""
    sets = []
    for t in texts:
        s = " ".join(t.lower().split())
        sets.append({s[k : k + size] for k in range(max(len(s) - size + 1, 1))})
    train = [i for i, s in enumerate(splits) if s == "train"]
    other = [i for i, s in enumerate(splits) if s != "train"]
    return [len(sets[a] & sets[b]) / len(sets[a] | sets[b]) for a in other for b in train]


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_no_cross_split_pair_reaches_the_threshold_on_templated_text(seed):
    texts = templated(300, seed)
    res = split_corpus(texts, dedup_cfg=CHARS, cfg=SplitConfig(audit_action="warn"))
    splits = res.assignments["split"].tolist()
    assert max(cross_split_jaccards(texts, splits)) < SPLIT.relatedness_threshold
    assert res.audit["passed"] and res.counts["related_pairs"] > 0


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_units_equal_verifying_every_candidate_pair(seed):
    # Skipping pairs already in one unit changes the work, never the partition.
    texts = templated(200, seed)
    n = len(texts)
    sig = minhash.minhash_signatures(texts, num_perm=CHARS.num_perm, seed=CHARS.seed)
    unit, _ = build_units(SplitCorpus([f"d{i}" for i in range(n)], texts, [None] * n,
                                      [None] * n, sig, np.arange(n)), SPLIT, CHARS)
    bands_rows = lsh.lsh_params(0.5, CHARS.num_perm, lsh.UNIT_MISS_WEIGHT)
    columns = np.random.default_rng(UNIT_COLUMN_SEED).permutation(CHARS.num_perm)
    cand = np.unique(
        np.r_[
            lsh.candidate_pairs(sig, 0.5, bands_rows),
            lsh.candidate_pairs(sig[:, columns], 0.5, bands_rows),
        ],
        axis=0,
    )
    related, _, _ = minhash.verify_candidates(texts, sig, cand, 0.5)
    assert np.array_equal(unit, first_seen_ids(components(n, related)))


def test_progress_reports_unit_building_and_audit_to_the_end():
    texts = templated(120, 1)
    sig = minhash.minhash_signatures(texts)
    seen = {"units": [], "audit": []}
    assign_splits(
        SplitCorpus([f"d{i}" for i in range(120)], texts, [None] * 120, [None] * 120, sig,
                    np.arange(120)),
        SplitConfig(audit_action="warn"),
        CHARS,
        progress=lambda d, t: seen["units"].append((d, t)),
        audit_progress=lambda d, t: seen["audit"].append((d, t)),
    )
    for calls in seen.values():
        assert calls and calls[-1][0] == calls[-1][1]
        assert [d for d, _ in calls] == sorted(d for d, _ in calls)
