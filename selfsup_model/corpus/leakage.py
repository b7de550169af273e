"""Leakage audit of a split: train near-copies in val/test, and groups across splits.

Split units keep related documents together, but only the pairs LSH proposed.
The audit is an independent second look at the finished assignment (see
`leakage_audit`), so a related pair that slipped through is reported - or
fails the run, as `split.audit_action` says - instead of silently inflating
validation and test scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from selfsup_model.config import DedupConfig, SplitConfig
from selfsup_model.corpus.lsh import (
    CrossLabelPlan,
    PairJudge,
    band_buckets,
    query_candidates,
    relatedness_banding,
)
from selfsup_model.corpus.minhash import Progress
from selfsup_model.errors import UserError

_MAX_EXAMPLES = 10
_PAIR_BUDGET = 1 << 20  # candidate pairs per verification pass: a (budget, 2) int64 block
# The audit bands a seeded reordering of the signature columns, so its bands are different
# triples of permutations: a pair unit building missed gets an independent second chance.
AUDIT_COLUMN_SEED = 20240601


def _touching(pairs_of_keys, is_train: np.ndarray, audited: np.ndarray | None):
    """Of each chunk of pairs, those joining train to val/test (both ends `audited`)."""
    for pairs in pairs_of_keys:
        keep = is_train[pairs[:, 0]] != is_train[pairs[:, 1]]
        if audited is not None:
            keep &= audited[pairs[:, 0]] & audited[pairs[:, 1]]
        yield pairs[keep]


def cross_split_leaks(
    is_train: np.ndarray, judge: PairJudge, progress: Progress | None = None,
    new: np.ndarray | None = None, audited: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """(val/test, train) pairs at exact Jaccard >= the judge's threshold among the audit's
    LSH candidates: pairs (k, 2), jaccard (k,), and the judge's counts for this audit
    (`PairJudge`: candidate pairs once per bucket they share, what each test ruled out).

    The candidates are the train/non-train pairs of bucket-mates under the audit's
    own banding (`AUDIT_COLUMN_SEED`), cut a budget at a time (`CrossLabelPlan`), so
    memory stays bounded however large a bucket of templated text grows. Pairs the
    judge already found unrelated (unit building's verdicts) are not judged again.
    With `new` (n,) bool, only pairs with a new document are candidates (a grown corpus:
    earlier pairs were audited when their version was made). With `audited` (n,) bool, pairs
    with any other document (held out of every split) are no candidates."""
    signatures, bands_rows = relatedness_banding(judge.signatures, judge.threshold,
                                                 AUDIT_COLUMN_SEED)
    if new is None:
        members, bounds = band_buckets(signatures, bands_rows)
        plan = CrossLabelPlan(members, bounds, is_train.astype(np.int64))
        chunks, total = plan.chunks(_PAIR_BUDGET), plan.total
        if audited is not None:
            chunks = _touching(chunks, is_train, audited)
    else:
        chunks = _touching(query_candidates(signatures, bands_rows, new, _PAIR_BUDGET),
                           is_train, audited)
        total = 0  # not known before the pairs are cut
    found, done, before = [], 0, dict(judge.counts)
    for pairs in chunks:
        done += len(pairs)
        related, jac = judge.related(pairs)
        found.append(np.c_[related, jac])
        if progress is not None:
            progress(done, max(total, done))
    leaks = np.concatenate(found) if found else np.empty((0, 3))
    leaks = np.unique(leaks, axis=0)  # a related pair sharing several buckets: once
    pairs = leaks[:, :2].astype(np.int64)
    query = np.where(is_train[pairs[:, 0]], pairs[:, 1], pairs[:, 0])
    counts = {k: v - before[k] for k, v in judge.counts.items() if k != "related_pairs"}
    return np.stack([query, pairs.sum(axis=1) - query], axis=1), leaks[:, 2], counts


def leakage_audit(
    ids: Sequence[str],
    texts: Sequence[str],
    splits: Sequence[str | None],
    groups: Sequence[str | None],
    signatures: np.ndarray,
    cfg: SplitConfig,
    dedup_cfg: DedupConfig,
    progress: Progress | None = None,
    judge: PairJudge | None = None,
    new: np.ndarray | None = None,
) -> dict[str, Any]:
    """Near-duplicates of train documents in val/test, and groups split across sides.

    Every train/val-or-test pair of LSH bucket-mates at `relatedness_threshold`
    is verified with its exact Jaccard (`cross_split_leaks`). Its bands group the
    signature columns differently from unit building's (AUDIT_COLUMN_SEED), so a
    related pair that unit building's LSH happened to miss is still likely to be
    caught: a second look, not the same look twice. With audit_action 'fail' any
    finding raises UserError; with 'warn' the audit's `message` says what was
    found. Groups count only with use_groups. `judge` may be unit building's (same
    texts, signatures and threshold), so its "unrelated" verdicts are reused. `new`: only
    pairs with a new document (`cross_split_leaks`). A split of None is a document held out
    of every split (quarantined): it takes part in no pair and no group.
    """
    split = np.asarray(list(splits), dtype=object)
    audited = pd.notna(split)
    judge = judge or PairJudge(
        texts, signatures, cfg.relatedness_threshold, dedup_cfg.shingle, dedup_cfg.shingle_size
    )
    leaks, jac, counts = cross_split_leaks(split == "train", judge, progress, new,
                                           None if audited.all() else audited)
    worst = np.lexsort((leaks[:, 1], leaks[:, 0], -jac))[:_MAX_EXAMPLES]
    examples = [
        {
            "id": str(ids[q]),
            "train_id": str(ids[t]),
            "split": str(split[q]),
            "jaccard": round(float(j), 6),
        }
        for (q, t), j in zip(leaks[worst], jac[worst], strict=True)
    ]
    spread = pd.DataFrame({"group": pd.Series(list(groups), dtype=object), "split": split}).dropna()
    per_group = spread.groupby("group")["split"].unique()
    crossing = per_group[per_group.map(len) > 1].sort_index()
    group_examples = [
        {"group": str(g), "splits": sorted(s)} for g, s in crossing[:_MAX_EXAMPLES].items()
    ]
    audit = {
        "threshold": cfg.relatedness_threshold,
        **counts,
        "related_pairs": len(leaks),
        "related_examples": examples,
        "groups_checked": cfg.use_groups,
        "groups_across_splits": len(crossing),
        "group_examples": group_examples,
    }
    found = len(leaks) > 0 or (cfg.use_groups and len(crossing) > 0)
    audit["passed"] = not found
    audit["message"] = _audit_message(audit) if found else None
    if found and cfg.audit_action == "fail":
        raise UserError(audit["message"] + "; set split.audit_action=warn to continue anyway")
    return audit


def _audit_message(audit: dict[str, Any]) -> str:
    parts = []
    if audit["related_pairs"]:
        shown = ", ".join(
            f"{e['id']} ~ {e['train_id']} (J={e['jaccard']:.2f})"
            for e in audit["related_examples"][:3]
        )
        parts.append(
            f"{audit['related_pairs']} val/test-train pair(s) at Jaccard >= "
            f"{audit['threshold']:g}, e.g. {shown}"
        )
    if audit["groups_checked"] and audit["groups_across_splits"]:
        shown = ", ".join(
            f"{e['group']} in {'+'.join(e['splits'])}" for e in audit["group_examples"][:3]
        )
        parts.append(f"{audit['groups_across_splits']} group(s) span several splits, e.g. {shown}")
    return "leakage audit failed: " + "; ".join(parts)
