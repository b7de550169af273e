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
from selfsup_model.errors import UserError
from selfsup_model.lsh import UNIT_MISS_WEIGHT, cross_candidate_pairs
from selfsup_model.minhash import verify_candidates

_MAX_EXAMPLES = 10
# The audit bands a seeded reordering of the signature columns, so its bands are different
# triples of permutations: a pair unit building missed gets an independent second chance.
AUDIT_COLUMN_SEED = 20240601


def leakage_audit(
    ids: Sequence[str],
    texts: Sequence[str],
    splits: Sequence[str],
    groups: Sequence[str | None],
    signatures: np.ndarray,
    cfg: SplitConfig,
    dedup_cfg: DedupConfig,
) -> dict[str, Any]:
    """Near-duplicates of train documents in val/test, and groups split across sides.

    Train signatures are indexed by LSH at `relatedness_threshold`; every
    val/test document queries it and each candidate is verified with its exact
    Jaccard. Its bands group the signature columns differently from unit
    building's (AUDIT_COLUMN_SEED), so a related pair that unit building's LSH
    happened to miss is still likely to be caught: a second look, not the same
    look twice. With audit_action 'fail' any finding raises UserError; with 'warn'
    the audit's `message` says what was found. Groups count only with use_groups.
    """
    split = np.asarray(list(splits), dtype=object)
    train, query = np.flatnonzero(split == "train"), np.flatnonzero(split != "train")
    columns = np.random.default_rng(AUDIT_COLUMN_SEED).permutation(signatures.shape[1])
    regrouped = signatures[:, columns]  # (n, num_perm): same hashes, different band triples
    cand = cross_candidate_pairs(
        regrouped[train], regrouped[query], cfg.relatedness_threshold, miss_weight=UNIT_MISS_WEIGHT
    )
    pairs = np.stack([query[cand[:, 0]], train[cand[:, 1]]], axis=1)  # (m, 2) query, train
    kind, size = dedup_cfg.shingle, dedup_cfg.shingle_size
    leaks, jac, _ = verify_candidates(
        texts, signatures, pairs, cfg.relatedness_threshold, kind, size
    )
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
        "candidate_pairs": len(cand),
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
