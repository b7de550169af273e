"""Leak-safe splitting on hand-built corpora of word sets (word shingles of size 1)."""

import numpy as np
import pandas as pd
import pytest

from selfsup_model import minhash
from selfsup_model.config import DedupConfig, SplitConfig
from selfsup_model.errors import ArtifactError, UserError
from selfsup_model.leakage import leakage_audit
from selfsup_model.splitting import assign_splits, documents_in_split

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
    return assign_splits(
        [f"d{i}" for i in range(n)],
        texts,
        labels or [None] * n,
        groups or [None] * n,
        sig,
        np.arange(n),
        cfg,
        dedup_cfg,
    )


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
