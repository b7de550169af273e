"""The continued-pretraining leak check: this run's val/test against what the init_from lineage
pretrained on, by hand-computed Jaccard (word shingles of size 1: Jaccard = shared words / all
words)."""

from pathlib import Path

import numpy as np
import pytest

from selfsup_model.config import DedupConfig, SplitConfig
from selfsup_model.errors import UserError
from selfsup_model.pretraining.source_audit import (
    SeenDocuments,
    pretraining_leaks,
    source_leak_audit,
)
from tasks.compare import _source_check

WORDS = DedupConfig(shingle="word", shingle_size=1, num_perm=128)


def words(start: int, stop: int) -> str:
    return " ".join(f"w{i}" for i in range(start, stop))


def lone(i: int) -> str:
    return " ".join(f"t{i}_{j}" for j in range(12))


def jaccard(a: str, b: str) -> float:
    x, y = set(a.split()), set(b.split())
    return len(x & y) / len(x | y)


SEEN = SeenDocuments(runs=[Path("/runs/b"), Path("/runs/a")], run=np.array([0, 0, 1, 1]),
                     ids=["sa", "sb", "sc", "sd"],
                     texts=[words(0, 20), words(100, 120), lone(1), lone(2)])
# id, split, text, and its hand-computed Jaccard with the seen documents it overlaps
MINE = [
    ("q1", "val", words(2, 20), {"sa": 18 / 20}),  # a near-copy: leaks
    ("q2", "test", words(110, 130), {"sb": 10 / 30}),  # related below 0.5: does not
    ("q3", "test", words(100, 118), {"sb": 18 / 20}),  # leaks
    ("q4", "train", words(0, 20), {"sa": 1.0}),  # identical, but train: never checked
    ("q5", "val", lone(3), {}),
    ("q6", "test", lone(2), {"sd": 1.0}),  # an exact copy from the older run of the lineage
]


def _audit(action="fail", seen=SEEN):
    ids, splits, texts, _ = zip(*MINE, strict=True)
    return source_leak_audit(ids, texts, splits, seen, SplitConfig(audit_action=action), WORDS)


def test_hand_computed_jaccards_hold():
    index = dict(zip(SEEN.ids, SEEN.texts, strict=True))
    for _, _, text, overlaps in MINE:
        for seen_id, seen_text in index.items():
            assert jaccard(text, seen_text) == pytest.approx(overlaps.get(seen_id, 0.0))


def test_near_copies_of_the_lineage_fail_the_run_by_name():
    with pytest.raises(UserError, match=r"3 val/test document\(s\) are near-copies") as err:
        _audit("fail")
    assert "q6 (test) ~ sd of /runs/a (J=1.00)" in str(err.value)


def test_under_warn_the_audit_lists_exactly_the_leaking_pairs():
    audit = _audit("warn")
    found = {(e["id"], e["source_id"], e["source_run"]): e["jaccard"] for e in audit["examples"]}
    assert found == {("q6", "sd", "/runs/a"): 1.0, ("q1", "sa", "/runs/b"): 0.9,
                     ("q3", "sb", "/runs/b"): 0.9}
    assert (audit["documents_checked"], audit["source_train_documents"],
            audit["leaking_documents"], audit["related_pairs"]) == (5, 4, 3, 3)
    assert not audit["passed"] and audit["message"].startswith("continued-pretraining leak")


def test_a_lineage_that_cannot_be_followed_fails_unless_warned():
    clean = SeenDocuments(runs=[Path("/runs/b")], run=np.zeros(1, np.int64), ids=["x"],
                          texts=[lone(9)], unreadable="/runs/b continued pretraining from /gone")
    with pytest.raises(UserError, match="could not be followed to its end: /runs/b continued"):
        _audit("fail", clean)
    audit = _audit("warn", clean)
    assert audit["leaking_documents"] == 0 and not audit["passed"]


def test_every_pair_found_is_above_the_threshold_and_none_clearly_above_is_missed():
    rng = np.random.default_rng(3)
    # Documents drawn from a small vocabulary, some edited copies of others: every range of
    # Jaccard appears.
    base = [rng.choice(60, size=rng.integers(8, 25), replace=False) for _ in range(40)]
    edited = [np.r_[b[rng.integers(0, 3):], rng.integers(60, 80, size=rng.integers(0, 4))]
              for b in base]
    texts = [" ".join(f"w{i}" for i in doc) for doc in base]
    seen = [" ".join(f"w{i}" for i in doc) for doc in edited[::-1]]
    pairs, jac, _ = pretraining_leaks(texts, seen, SplitConfig(), WORDS)
    exact = np.array([[jaccard(t, s) for s in seen] for t in texts])
    np.testing.assert_allclose(jac, exact[pairs[:, 0], pairs[:, 1]], rtol=0, atol=1e-12)
    assert (jac >= 0.5).all()
    found = set(map(tuple, pairs.tolist()))
    clearly = set(zip(*np.nonzero(exact >= 0.7), strict=True))
    assert clearly and clearly <= found


def test_the_report_says_what_the_check_found():
    assert _source_check({"reused_from": ""}) == {}
    counts = {"reused_from": "/runs/b", "source_documents_checked": 5,
              "source_train_documents": 4, "source_leaking_documents": 0,
              "source_audit_passed": True}
    assert _source_check(counts) == {"continued-pretraining leak check": (
        "passed (5 val/test documents against the 4 documents the continued encoder's "
        "lineage pretrained on: no near-copies)")}
    line = _source_check({**counts, "source_leaking_documents": 2, "source_audit_passed": False})
    assert line["continued-pretraining leak check"].startswith("FAILED (5 val/test")
