"""Leak-safe train/val/test assignment of the kept documents (audited by `leakage`).

A split unit is a connected component of: documents sharing a dedup cluster,
documents whose exact shingle Jaccard is >= `relatedness_threshold` (LSH
candidates on the dedup signatures, two bandings, each verified), and - when
`use_groups` - documents sharing a non-null group. Whole units go to one split.
`build_units` finds those components without verifying every candidate pair:
a pair already inside one unit cannot change them, so its work follows the
pairs across units, not the square of a bucket of templated near-copies.

Allocation, stratified by label: each split's target is its fraction of every
label's doc count (unlabelled docs count as one more label). Units are
shuffled with the seed, then ordered largest first. First, for each label that
is the majority label (ties: alphabetically first) of at least three units,
its three smallest units are dealt one to each split, so the label appears
everywhere; then every other unit goes to the split whose per-label deficits
it fills most - so a big mixed unit's minority labels are accounted for too.
A label still absent from a split gets a warning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from selfsup_model.config import SPLITS, DedupConfig, SplitConfig
from selfsup_model.corpus.graph import components, first_seen_ids, same_code_pairs, value_codes
from selfsup_model.corpus.leakage import leakage_audit
from selfsup_model.corpus.lsh import (
    CrossLabelPlan,
    PairJudge,
    band_buckets,
    query_candidates,
    relatedness_banding,
)
from selfsup_model.corpus.minhash import Progress
from selfsup_model.errors import ArtifactError, UserError

ASSIGNMENT_COLUMNS = ("id", "split", "cluster_id", "unit_id", "group")


@dataclass(frozen=True, eq=False)
class SplitCorpus:
    """The kept documents a split is made of, aligned row for row.

    signatures: (n, num_perm) uint32 from dedup; cluster_ids: each document's dedup cluster."""

    ids: Sequence[str]
    texts: Sequence[str]
    labels: Sequence[str | None]
    groups: Sequence[str | None]
    signatures: np.ndarray
    cluster_ids: Sequence[int]

    def __len__(self) -> int:
        return len(self.ids)

    def check(self, dedup_cfg: DedupConfig) -> int:
        """The document count; UserError for misaligned or malformed inputs."""
        n = len(self.ids)
        lengths = {name: len(getattr(self, name))
                   for name in ("texts", "labels", "groups", "signatures", "cluster_ids")}
        bad = {k: v for k, v in lengths.items() if v != n}
        if bad:
            raise UserError(f"split inputs must align with {n} ids; got {bad}")
        if self.signatures.ndim != 2 or self.signatures.shape[1] != dedup_cfg.num_perm:
            raise UserError(
                f"signatures have shape {self.signatures.shape}, expected "
                f"(n, {dedup_cfg.num_perm}) from dedup; "
                "rerun the dedup stage with the same dedup config"
            )
        if pd.Index(list(self.ids)).has_duplicates:
            raise UserError("split: document ids must be unique")
        return n

    def judge(self, cfg: SplitConfig, dedup_cfg: DedupConfig) -> PairJudge:
        """A pair judge over these documents at the relatedness threshold."""
        return PairJudge(self.texts, self.signatures, cfg.relatedness_threshold,
                         dedup_cfg.shingle, dedup_cfg.shingle_size)


@dataclass(frozen=True, eq=False)
class SplitResult:
    """assignments: one row per input document, input order, ASSIGNMENT_COLUMNS."""

    assignments: pd.DataFrame
    counts: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    audit: dict[str, Any] = field(default_factory=dict)


# Planned pairs per verification pass: a (budget, 2) int64 block of ~16 MiB.
_PAIR_BUDGET = 1 << 20
# Unit building bands the signature columns twice: in their own order and in this seeded
# order (the audit uses a third). A pair at exactly J = 0.5 escapes one banding of 39 x 3
# rows with probability 0.0055, both with ~3e-5: a miss is what leaks across splits.
UNIT_COLUMN_SEED = 20240602
# Chain passes through the buckets before the exhaustive one: each joins most of what
# is left of a bucket of near-copies, so a few leave only genuinely mixed buckets.
_CHAIN_ROUNDS = 3


def _link(judge: PairJudge, pairs: np.ndarray, unit: np.ndarray) -> np.ndarray:
    """The units after joining every related pair among `pairs`: (n,) int64 labels.

    Pairs already in one unit are dropped before any work."""
    related, _ = judge.related(pairs[unit[pairs[:, 0]] != unit[pairs[:, 1]]])
    joined = components(int(unit.max()) + 1, unit[related])
    return joined[unit]


def _unit_buckets(signatures: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """Buckets of both of unit building's bandings: members (e,) and bounds (b + 1,)."""
    plain, bands_rows = relatedness_banding(signatures, threshold)
    reordered, _ = relatedness_banding(signatures, threshold, UNIT_COLUMN_SEED)
    first, first_bounds = band_buckets(plain, bands_rows)
    second, second_bounds = band_buckets(reordered, bands_rows)
    bounds = np.r_[first_bounds, first_bounds[-1] + second_bounds[1:]]
    return np.r_[first, second], bounds


def build_units(corpus: SplitCorpus, cfg: SplitConfig, dedup_cfg: DedupConfig,
                progress: Progress | None = None,
                judge: PairJudge | None = None) -> tuple[np.ndarray, dict[str, int]]:
    """Split unit per document, numbered in first-seen order (n,) int64, and link counts.

    Units start as dedup clusters (joined by shared groups with `use_groups`);
    bucket-mates of unit building's LSH whose exact Jaccard is >= the threshold
    are then joined. Only connectivity matters, so no pair inside one unit is
    ever verified: each bucket is first chained (`CrossLabelPlan.adjacent`), a few
    rounds, which joins a bucket of templated near-copies with about one check
    per member; then every pair of bucket-mates still in different units is
    judged, a budget at a time, re-reading the units between passes. The result
    is the partition that verifying every candidate pair would give, at a cost
    that follows the pairs across units, not the square of the bucket sizes.
    Link counts are the judge's (`PairJudge`): related_pairs counts the links
    found on the way (a spanning set), not every related pair.
    `progress(done, total)` counts the planned pairs of that last pass; `judge` (over
    these texts, at `relatedness_threshold`) keeps its verdicts and shingles for the audit.
    """
    edges = [same_code_pairs(np.asarray(corpus.cluster_ids, dtype=np.int64))]
    if cfg.use_groups:
        edges.append(same_code_pairs(value_codes(corpus.groups)))
    unit = components(len(corpus), np.concatenate(edges))
    members, bounds = _unit_buckets(corpus.signatures, cfg.relatedness_threshold)
    judge = judge or corpus.judge(cfg, dedup_cfg)
    for _ in range(_CHAIN_ROUNDS):
        chain = CrossLabelPlan(members, bounds, unit).adjacent()
        if not len(chain):
            break
        unit = _link(judge, chain, unit)
    plan = CrossLabelPlan(members, bounds, unit)
    done = 0
    for pairs in plan.chunks(_PAIR_BUDGET):
        unit = _link(judge, pairs, unit)
        done += len(pairs)
        if progress is not None:
            progress(done, plan.total)
    if progress is not None and not plan.total:
        progress(0, 0)
    # A fresh judge, or one that has judged nothing else yet: its counts are ours.
    return first_seen_ids(unit), {"lsh_buckets": len(bounds) - 1, **judge.counts}


def _label_counts(
    unit: np.ndarray, labels: Sequence[str | None], stratify: bool
) -> tuple[np.ndarray, list[str | None]]:
    """Docs per (unit, label): (units, L) int64 and the L column names.

    Labels are sorted; unlabelled documents (all of them when not stratifying)
    share a last column named None."""
    codes, names = _label_codes(labels, stratify)
    counts = np.zeros((unit.max() + 1, len(names)), dtype=np.int64)
    np.add.at(counts, (unit, codes), 1)
    return counts, names


def _label_codes(labels: Sequence[str | None], stratify: bool) -> tuple[np.ndarray,
                                                                         list[str | None]]:
    """Label column per document (n,) int64 and the column names: sorted labels, then None
    for unlabelled documents (all of them when not stratifying)."""
    raw = [None if (not stratify or pd.isna(lab)) else str(lab) for lab in labels]
    codes, names = pd.factorize(pd.Series(raw, dtype=object), sort=True)  # None -> -1
    return np.where(codes < 0, len(names), codes), [str(name) for name in names] + [None]


def _deal_for_coverage(
    order: np.ndarray, counts: np.ndarray, target: np.ndarray, split_of_unit: np.ndarray
) -> None:
    """Per label with >= 3 units whose majority it is: its 3 smallest, one to each split."""
    labelled = counts[:, :-1]  # the last column holds unlabelled docs
    majority = np.full(len(counts), counts.shape[1] - 1, dtype=np.int64)  # (units,)
    if labelled.shape[1]:
        has_label = labelled.sum(axis=1) > 0
        majority[has_label] = labelled[has_label].argmax(axis=1)  # ties: alphabetical first
    for col in range(counts.shape[1]):
        mine = order[majority[order] == col][::-1][: len(SPLITS)]  # smallest first
        if len(mine) == len(SPLITS):
            split_of_unit[mine] = np.argsort(target[:, col], kind="stable")  # smallest target first


def _allocate(counts: np.ndarray, cfg: SplitConfig) -> np.ndarray:
    """Split index (0 train, 1 val, 2 test) per unit: (units,) int64.

    Units go largest first (seeded shuffle among equal sizes) to the split
    whose per-label deficits they fill most; ties go to the split furthest
    below its target overall, then train, val, test.
    """
    fractions = np.array([cfg.train, cfg.val, cfg.test], dtype=np.float64)
    target = fractions[:, None] * counts.sum(axis=0)[None, :]  # (3, L) docs per split and label
    sizes = counts.sum(axis=1)
    order = _largest_first(sizes, cfg.seed)
    split_of_unit = np.full(len(sizes), -1, dtype=np.int64)
    _deal_for_coverage(order, counts, target, split_of_unit)
    filled = np.zeros_like(target)
    for u in np.flatnonzero(split_of_unit >= 0):
        filled[split_of_unit[u]] += counts[u]
    _fill_deficits(order[split_of_unit[order] < 0], counts, target, filled, split_of_unit)
    return split_of_unit


def _largest_first(sizes: np.ndarray, seed: int) -> np.ndarray:
    """Unit order: largest first, a seeded shuffle among equal sizes."""
    shuffled = np.random.default_rng(seed).permutation(len(sizes))
    return shuffled[np.argsort(-sizes[shuffled], kind="stable")]


def _fill_deficits(order: np.ndarray, counts: np.ndarray, target: np.ndarray,
                   filled: np.ndarray, split_of_unit: np.ndarray) -> None:
    """Each unit of `order` in turn to the split whose per-label deficits it fills most (ties:
    the split furthest below its target overall, then train, val, test); updates `filled` and
    `split_of_unit` in place."""
    for u in order:
        deficit = target - filled  # (3, L)
        gain = np.minimum(counts[u], np.maximum(deficit, 0.0)).sum(axis=1)
        best = np.flatnonzero(gain >= gain.max() - 1e-9)
        split = best[np.argmax(deficit[best].sum(axis=1))]
        split_of_unit[u] = split
        filled[split] += counts[u]


def _missing_label_warnings(
    counts: np.ndarray, names: list[str | None], split_of_unit: np.ndarray
) -> list[str]:
    """One warning per label absent from some split, with how many units hold it."""
    warnings = []
    for col, name in enumerate(names):
        holders = np.flatnonzero(counts[:, col] > 0)
        missing = [s for i, s in enumerate(SPLITS) if not (split_of_unit[holders] == i).any()]
        if name is not None and len(holders) and missing:
            warnings.append(
                f"label {name!r} is missing from {', '.join(missing)}: its "
                f"{int(counts[holders, col].sum())} docs sit in only {len(holders)} split unit(s)"
            )
    return warnings


def assign_splits(
    corpus: SplitCorpus,
    cfg: SplitConfig,
    dedup_cfg: DedupConfig,
    progress: Progress | None = None,
    audit_progress: Progress | None = None,
) -> SplitResult:
    """Assign every (kept) document to train/val/test by whole units; audit the result.

    `progress(done, total)` follows unit building's pairs, `audit_progress` the audit's."""
    n = corpus.check(dedup_cfg)
    judge = corpus.judge(cfg, dedup_cfg)  # shared: the audit skips pairs units found unrelated
    unit, links = build_units(corpus, cfg, dedup_cfg, progress, judge)
    unit_sizes = np.bincount(unit)  # (units,)
    if len(unit_sizes) < len(SPLITS):
        raise UserError(
            f"split: the {n} documents form only {len(unit_sizes)} split unit(s) (related "
            "documents and shared groups stay together), but train/val/test needs at least 3; "
            "add documents, set split.use_groups=false or raise split.relatedness_threshold"
        )
    counts, names = _label_counts(unit, corpus.labels, cfg.stratify)
    split_of_unit = _allocate(counts, cfg)
    warnings = _missing_label_warnings(counts, names, split_of_unit)
    split = np.array(SPLITS, dtype=object)[split_of_unit[unit]]  # (n,)
    for name in SPLITS:
        if not (split == name).any():
            raise UserError(
                f"split {name!r} ended up empty ({len(unit_sizes)} units for fractions "
                f"{cfg.train:g}/{cfg.val:g}/{cfg.test:g}); add documents or change the fractions"
            )
    audit = leakage_audit(corpus.ids, corpus.texts, split, corpus.groups, corpus.signatures,
                          cfg, dedup_cfg, audit_progress, judge)
    if audit["message"]:
        warnings.append(audit["message"])
    frame = pd.DataFrame(
        {
            "id": pd.array(list(corpus.ids), dtype="str"),
            "split": pd.array(split, dtype="str"),
            "cluster_id": np.asarray(corpus.cluster_ids, dtype=np.int64),
            "unit_id": unit,
            "group": pd.array(pd.Series(list(corpus.groups), dtype=object), dtype="str"),
        }
    )
    summary = _counts(frame, corpus.labels, split_of_unit, links, audit)
    return SplitResult(assignments=frame, counts=summary, warnings=warnings, audit=audit)


def _counts(frame, labels, split_of_unit, links, audit) -> dict[str, Any]:
    by_split = frame.assign(label=pd.Series(list(labels), dtype=object))
    label_counts = {
        name: {str(k): int(v) for k, v in sorted(part["label"].dropna().value_counts().items())}
        for name, part in by_split.groupby("split", sort=False)
    }
    return {
        "documents": len(frame),
        "units": len(split_of_unit),
        "largest_unit": int(np.bincount(frame["unit_id"].to_numpy()).max()),
        "docs_per_split": {s: int((frame["split"] == s).sum()) for s in SPLITS},
        "units_per_split": {s: int((split_of_unit == i).sum()) for i, s in enumerate(SPLITS)},
        "labels_per_split": {s: label_counts.get(s, {}) for s in SPLITS},
        **links,
        "leakage_pairs": audit["related_pairs"],
        "groups_across_splits": audit["groups_across_splits"],
    }


def documents_in_split(
    documents: pd.DataFrame, assignments: pd.DataFrame, split: str
) -> pd.DataFrame:
    """The rows of `documents` (an "id" column) that `assignments` puts in `split`.

    Same columns as `documents`, rows in assignment order (so deterministic), index reset;
    a split with no documents (or an unknown name) gives an empty frame."""
    ids = assignments.loc[assignments["split"] == split, "id"]
    rows = pd.Index(documents["id"]).get_indexer(ids)
    if (rows < 0).any():
        raise ArtifactError(
            f"{int((rows < 0).sum())} {split} id(s) of the split assignments are not among the "
            f"documents, e.g. {ids[rows < 0].iloc[0]!r}: they come from another corpus; "
            "rerun the split stage"
        )
    return documents.iloc[rows].reset_index(drop=True)


QUARANTINE_COLUMNS = ("id", "reason", "splits", "related_ids")


# A new document's candidates among one split's earlier documents are judged in rounds of
# these ranks ([0, 8), the rest), and no longer once one of them is related.
_ROUNDS = (0, 8)


def _new_unit_edges(corpus: SplitCorpus, new: np.ndarray, split_idx: np.ndarray,
                    cfg: SplitConfig, judge: PairJudge) -> tuple[np.ndarray, dict[str, int]]:
    """Edges of a grown corpus' unit graph that touch a new document, (m, 2): shared dedup
    clusters and groups, and related pairs among both of unit building's bandings'
    bucket-mates (`_reaching_edges`). `split_idx` is each earlier document's split (0-2, 3:
    quarantined; -1 for a new one)."""
    edges = [same_code_pairs(np.asarray(corpus.cluster_ids, dtype=np.int64))]
    if cfg.use_groups:
        edges.append(same_code_pairs(value_codes(corpus.groups)))
    shared = np.concatenate(edges)
    shared = shared[new[shared[:, 0]] | new[shared[:, 1]]]
    reached = np.zeros((len(new), len(SPLITS) + 1), dtype=bool)
    to_old = shared[new[shared[:, 0]] != new[shared[:, 1]]]
    newer = np.where(new[to_old[:, 0]], to_old[:, 0], to_old[:, 1])
    reached[newer, split_idx[to_old.sum(axis=1) - newer]] = True
    related = [_reaching_edges(judge, pairs, new, split_idx, reached)
               for seed in (None, UNIT_COLUMN_SEED)
               for pairs in query_candidates(*relatedness_banding(
                   corpus.signatures, cfg.relatedness_threshold, seed), new, _PAIR_BUDGET)]
    return np.concatenate([shared, *related]), dict(judge.counts)


def _reaching_edges(judge: PairJudge, pairs: np.ndarray, new: np.ndarray,
                    split_idx: np.ndarray, reached: np.ndarray) -> np.ndarray:
    """The related pairs among candidates with a new document that placement needs.

    Every pair of two new documents is judged: they make the components that move together.
    A new document's pairs with earlier documents only say which splits it reaches, so once
    one pair relates it to a split (`reached`, (n, 4), updated here, kept across calls) its
    other candidates in that split are skipped: they are judged in rounds by rank within
    (new document, split) (`_ROUNDS`). What a new document does not reach is still judged
    whole, so no relation that changes a placement is missed; the audit then judges every
    cross-split pair of the result."""
    both = new[pairs[:, 0]] & new[pairs[:, 1]]
    out = [judge.related(pairs[both])[0]]
    newer = np.where(new[pairs[:, 0]], pairs[:, 0], pairs[:, 1])[~both]
    older = (pairs[:, 0] + pairs[:, 1])[~both] - newer
    live = ~reached[newer, split_idx[older]]  # most candidates: a split already reached
    newer, older = newer[live], older[live]
    key = newer * reached.shape[1] + split_idx[older]
    order = np.argsort(key, kind="stable")
    newer, older, key = newer[order], older[order], key[order]
    starts = np.zeros(len(key), dtype=np.int64)  # where each row's (document, split) run starts
    cut = np.flatnonzero(key[1:] != key[:-1]) + 1
    starts[cut] = cut
    rank = np.arange(len(key)) - np.maximum.accumulate(starts)
    for lo, hi in zip(_ROUNDS, (*_ROUNDS[1:], len(key) + 1), strict=True):
        take = np.flatnonzero((rank >= lo) & (rank < hi))
        take = take[~reached[newer[take], split_idx[older[take]]]]
        if not len(take):
            continue
        found = judge.related(np.stack([newer[take], older[take]], axis=1))[0]
        to_new = np.where(new[found[:, 0]], found[:, 0], found[:, 1])
        reached[to_new, split_idx[found[:, 0] + found[:, 1] - to_new]] = True
        out.append(found)
    return np.concatenate(out)


def extend_splits(
    corpus: SplitCorpus,
    previous: pd.DataFrame,
    quarantined: pd.DataFrame,
    cfg: SplitConfig,
    dedup_cfg: DedupConfig,
    changed: Sequence[str] = (),
    audit_progress: Progress | None = None,
) -> tuple[SplitResult, pd.DataFrame]:
    """The next version's split: every earlier document keeps its split, new ones follow.

    `corpus` is this version's kept documents; `previous` the last version's assignments
    (ASSIGNMENT_COLUMNS) and `quarantined` its quarantine list (QUARANTINE_COLUMNS). A new
    document is new if neither holds its id. New documents related to earlier ones (the
    relatedness rule, a shared group, a shared dedup cluster; through other new documents too)
    join their split and unit; a connected set of new documents that reaches two splits, or a
    quarantined document, is quarantined whole: in no split, listed with its reason. The rest
    form new units, allocated by the per-label deficits of the whole corpus against the split
    fractions. An id in `changed` (its text changed since the last version) is judged as
    new, and its earlier split counts as one it reaches. The audit looks at every pair with
    a new document. Returns the result (this version's assignments, corpus order) and the
    quarantine list."""
    n = corpus.check(dedup_cfg)
    ids = pd.Index(pd.Series(list(corpus.ids), dtype=object))
    prev_pos = ids.get_indexer(previous["id"].astype(object))
    active = prev_pos >= 0  # earlier assignments whose document is still here
    held = np.zeros(n, dtype=bool)
    held_pos = ids.get_indexer(quarantined["id"].astype(object))
    held[held_pos[held_pos >= 0]] = True
    split_idx = np.full(n, -1, dtype=np.int64)  # 0/1/2, 3 quarantined, -1 new
    split_idx[prev_pos[active]] = pd.Index(SPLITS).get_indexer(previous["split"][active])
    split_idx[held] = len(SPLITS)
    unit = np.full(n, -1, dtype=np.int64)
    unit[prev_pos[active]] = previous["unit_id"].to_numpy()[active]
    was_split = split_idx.copy()  # changed documents: their earlier split, reached
    changed_pos = ids.get_indexer(pd.Index(list(changed), dtype=object))
    changed_pos = changed_pos[changed_pos >= 0]
    split_idx[changed_pos] = -1
    new = split_idx < 0

    judge = corpus.judge(cfg, dedup_cfg)
    edges, links = _new_unit_edges(corpus, new, split_idx, cfg, judge)
    # New documents connected among themselves move together; the earlier documents they
    # touch directly say where: a (components, 4) table of the splits each one reaches.
    both_new = new[edges[:, 0]] & new[edges[:, 1]]
    comp = components(n, edges[both_new])
    to_old = edges[~both_new]
    newer, older = np.where(new[to_old[:, 0]], to_old.T, to_old[:, ::-1].T)
    reach = np.zeros((int(comp.max(initial=-1)) + 1, len(SPLITS) + 1), dtype=bool)
    reach[comp[newer], split_idx[older]] = True
    reach[comp[changed_pos], was_split[changed_pos]] = was_split[changed_pos] >= 0
    first_unit = np.full(len(reach), np.iinfo(np.int64).max)
    placed = split_idx[older] < len(SPLITS)
    np.minimum.at(first_unit, comp[newer[placed]], unit[older[placed]])
    was_placed = changed_pos[(was_split[changed_pos] >= 0)
                             & (was_split[changed_pos] < len(SPLITS))]
    np.minimum.at(first_unit, comp[was_placed], unit[was_placed])  # a changed text's unit
    newcomers = np.flatnonzero(new)
    reached = reach[comp[newcomers]]  # (k, 4)
    joins = (reached.sum(axis=1) == 1) & ~reached[:, len(SPLITS)]
    conflict = (reached.sum(axis=1) > 1) | reached[:, len(SPLITS)]
    joiners, held_now = newcomers[joins], newcomers[conflict]
    split_idx[joiners] = reached[joins].argmax(axis=1)
    unit[joiners] = first_unit[comp[joiners]]
    split_idx[held_now] = len(SPLITS)
    fresh = newcomers[~joins & ~conflict]

    # New units: allocated against what the whole corpus needs per split and label.
    in_split = (split_idx >= 0) & (split_idx < len(SPLITS))
    if len(fresh):
        local = first_seen_ids(comp[fresh])
        unit[fresh] = max(int(unit.max(initial=-1)),
                          int(previous["unit_id"].max()) if len(previous) else -1) + 1 + local
        codes, names = _label_codes(corpus.labels, cfg.stratify)
        counts = np.zeros((int(local.max()) + 1, len(names)), dtype=np.int64)
        np.add.at(counts, (local, codes[fresh]), 1)
        placed = np.flatnonzero(in_split)  # fresh documents are not placed yet
        filled = np.zeros((len(SPLITS), len(names)), dtype=np.float64)
        np.add.at(filled, (split_idx[placed], codes[placed]), 1.0)
        split_idx[fresh] = _allocate_more(counts, filled, cfg)[local]
        in_split = split_idx < len(SPLITS)
    kept_rows = np.setdiff1d(prev_pos[active], changed_pos)
    moved = split_idx[kept_rows] != was_split[kept_rows]
    if moved.any():  # by construction never; a broken invariant must not pass silently
        raise ArtifactError(f"split: {int(moved.sum())} earlier document(s) would change split")

    keep = np.flatnonzero(in_split)
    split = np.array(SPLITS, dtype=object)[split_idx[keep]]
    # The audit shares the judge (its shingles and "unrelated" verdicts); the quarantined
    # documents are held out of it (a split of None).
    audit = leakage_audit(corpus.ids, corpus.texts,
                          np.array([*SPLITS, None], dtype=object)[split_idx], corpus.groups,
                          corpus.signatures, cfg, dedup_cfg, audit_progress, judge, new=new)
    frame = pd.DataFrame({
        "id": pd.array(_take(corpus.ids, keep), dtype="str"),
        "split": pd.array(split, dtype="str"),
        "cluster_id": np.asarray(corpus.cluster_ids, dtype=np.int64)[keep],
        "unit_id": unit[keep],
        "group": pd.array(pd.Series(_take(corpus.groups, keep), dtype=object), dtype="str"),
    })
    quarantine = pd.concat([quarantined, _quarantine_rows(corpus, held_now, comp, reach,
                                                          np.stack([newer, older], axis=1))],
                           ignore_index=True)
    warnings = [audit["message"]] if audit["message"] else []
    units = np.unique(unit[keep])
    split_of_unit = np.zeros(len(units), dtype=np.int64)
    split_of_unit[np.searchsorted(units, unit[keep])] = split_idx[keep]
    summary = _counts(frame.assign(unit_id=np.searchsorted(units, unit[keep])),
                      _take(corpus.labels, keep), split_of_unit, links, audit)
    summary.update({"new_documents": int(new.sum()), "joined_earlier_units": len(joiners),
                    "new_units": len(np.unique(unit[fresh])),
                    "new_in_split": {s: int((split_idx[fresh] == i).sum()
                                            + (split_idx[joiners] == i).sum())
                                     for i, s in enumerate(SPLITS)},
                    "quarantined_new": len(held_now), "quarantined": len(quarantine),
                    "no_longer_present": int((~active).sum()),
                    "changed_kept_split": int((split_idx[changed_pos]
                                               == was_split[changed_pos]).sum()),
                    "moved": 0})
    return SplitResult(frame, summary, warnings, audit), quarantine


def _take(values: Sequence, rows: np.ndarray) -> list:
    return [values[i] for i in rows]


def _allocate_more(counts: np.ndarray, filled: np.ndarray, cfg: SplitConfig) -> np.ndarray:
    """Split per new unit, given what the splits already hold: (units,) int64.

    As `_allocate` without the coverage deal: largest units first (seeded shuffle among
    equal sizes) to the split whose per-label deficits against the whole corpus' targets
    they fill most."""
    fractions = np.array([cfg.train, cfg.val, cfg.test], dtype=np.float64)
    target = fractions[:, None] * (filled.sum(axis=0) + counts.sum(axis=0))[None, :]
    split_of_unit = np.full(len(counts), -1, dtype=np.int64)
    _fill_deficits(_largest_first(counts.sum(axis=1), cfg.seed), counts, target, filled.copy(),
                   split_of_unit)
    return split_of_unit


def _quarantine_rows(corpus: SplitCorpus, rows: np.ndarray, comp: np.ndarray,
                     reach: np.ndarray, links: np.ndarray) -> pd.DataFrame:
    """Why each newly quarantined document is held out: the earlier splits its connected new
    documents reach (`reach`, per component), and a few of the earlier documents they touch
    (`links`: (new, earlier) pairs)."""
    link_comp = comp[links[:, 0]]
    order = np.lexsort((links[:, 1], link_comp))  # by component, then earlier document
    link_comp, earlier = link_comp[order], links[order, 1]
    out = []
    for i in rows:
        reached = [s for s, hit in zip(SPLITS, reach[comp[i]], strict=False) if hit]
        reason = ("related to earlier documents in " + " and ".join(sorted(reached))
                  if len(reached) > 1 else "related to a quarantined document")
        lo, hi = np.searchsorted(link_comp, [comp[i], comp[i] + 1])
        touched = np.unique(earlier[lo:hi])[:5].tolist()
        out.append((str(corpus.ids[i]), reason, ",".join(sorted(reached)),
                    ",".join(str(corpus.ids[m]) for m in touched)))
    return pd.DataFrame(out, columns=list(QUARANTINE_COLUMNS)).astype("string")
