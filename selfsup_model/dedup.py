"""Exact and near-duplicate detection: which documents to keep, and why each other one goes.

Order of work: texts are folded (`minhash.fold_for_shingling`: lowercase,
whitespace collapsed); identical folded texts are exact duplicates; one MinHash
signature per distinct text feeds LSH (`lsh.candidate_pairs`) at
`cfg.threshold`; every LSH candidate pair is verified with its exact shingle
Jaccard before it counts (candidates whose signatures put the threshold 6
standard errors away are skipped as certain misses - see
`minhash.plausible_pairs`); verified pairs and exact groups are joined into
clusters (`graph.components`, so a chain A~B~C is one cluster).

Representative rule: each cluster keeps the member with the longest
folded text; ties go to the member that comes first in the input. Every
other member is dropped as a duplicate of that kept document.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from selfsup_model.config import DedupConfig
from selfsup_model.errors import UserError
from selfsup_model.graph import components, first_seen_ids
from selfsup_model.lsh import ShingleCache, candidate_pairs, lsh_params
from selfsup_model.minhash import (
    Progress,
    fold_for_shingling,
    minhash_signatures,
    plausible_pairs,
)

CLUSTER_COLUMNS = ("id", "cluster_id", "is_kept", "kept_id", "kind", "max_jaccard")


@dataclass(frozen=True, eq=False)
class DedupResult:
    """Per-document fate, the signatures the split stage reuses, and counts.

    clusters: one row per input document, input order, columns CLUSTER_COLUMNS.
      kind is 'unique' for every kept document, 'exact' for a dropped document
      whose folded text equals its representative's, 'near' otherwise.
      max_jaccard: dropped -> exact Jaccard to its representative (1.0 for
      exact; below the threshold is possible for the far end of a chain);
      kept -> the largest of those over its cluster (0.0 for a singleton).
    signatures: (n_docs, num_perm) uint32 MinHash signatures, input order.
    pairs: the verified near-duplicate pairs (left_id, right_id, jaccard) between
      distinct folded texts, each text named by the first document holding it.
    """

    clusters: pd.DataFrame
    signatures: np.ndarray
    counts: dict[str, int] = field(default_factory=dict)
    pairs: pd.DataFrame = field(default_factory=pd.DataFrame)


def _check_inputs(ids: Sequence[str], texts: Sequence[str]) -> int:
    if len(ids) != len(texts):
        raise UserError(f"dedup got {len(ids)} ids but {len(texts)} texts; they must align")
    if not len(ids):
        raise UserError("dedup got no documents: check the ingest stage's kept count")
    dup = pd.Index(ids)[pd.Index(ids).duplicated()]
    if len(dup):
        raise UserError(f"document ids must be unique; {len(dup)} repeat, e.g. {dup[0]!r}")
    return len(ids)


def _representatives(cluster: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Kept document index for each document: longest text, then first in input (n,) int64."""
    n = len(cluster)
    order = np.lexsort((np.arange(n), -lengths, cluster))  # best member first within a cluster
    head = np.r_[True, cluster[order][1:] != cluster[order][:-1]]
    rep_of_cluster = np.empty(cluster.max() + 1, dtype=np.int64)
    rep_of_cluster[cluster[order][head]] = order[head]
    return rep_of_cluster[cluster]


def find_duplicates(
    ids: Sequence[str],
    texts: Sequence[str],
    cfg: DedupConfig,
    progress: Progress | None = None,
) -> DedupResult:
    """Cluster exact and verified near-duplicates; keep one document per cluster.

    `progress(done, total)` is called after each signature batch (over distinct texts).
    """
    n = _check_inputs(ids, texts)
    norm = [fold_for_shingling(t) for t in texts]
    text_code, distinct = pd.factorize(pd.Series(norm, dtype=object), sort=False)  # (n,), (u,)
    text_code = text_code.astype(np.int64)
    distinct = list(distinct)  # folded already
    sig_u = minhash_signatures(
        distinct,
        num_perm=cfg.num_perm,
        seed=cfg.seed,
        kind=cfg.shingle,
        size=cfg.shingle_size,
        batch_size=cfg.batch_size,
        progress=progress,
        folded=True,
    )  # (u, num_perm)
    cand = candidate_pairs(sig_u, cfg.threshold)  # (c, 2) over distinct texts
    plausible = plausible_pairs(sig_u, cand, cfg.threshold)
    shingles = ShingleCache(distinct, cfg.shingle, cfg.shingle_size, folded=True)
    jac = shingles.jaccard(cand[plausible])  # each text shingled once, here and below
    verified, jac = cand[plausible][jac >= cfg.threshold], jac[jac >= cfg.threshold]
    skipped = int((~plausible).sum())
    cluster = first_seen_ids(components(len(distinct), verified)[text_code])  # (n,)
    rep = _representatives(cluster, np.array([len(t) for t in norm], dtype=np.int64))
    frame = _cluster_frame(ids, cluster, rep, text_code, shingles)
    counts = {
        "documents": n,
        "distinct_texts": len(distinct),
        **_fate_counts(frame),
        "candidate_pairs": len(cand),
        "skipped_by_signature": skipped,
        "verified_pairs": len(verified),
    }
    counts["lsh_bands"], counts["lsh_rows"] = lsh_params(cfg.threshold, cfg.num_perm)
    pairs = _pairs_frame(ids, text_code, verified, jac)
    return DedupResult(frame, sig_u[text_code], counts, pairs)


def _fate_counts(frame: pd.DataFrame) -> dict[str, int]:
    kept = int(frame["is_kept"].sum())
    return {
        "clusters": int(frame["cluster_id"].max()) + 1,
        "kept": kept,
        "duplicates_removed": len(frame) - kept,
        "exact_duplicates": int((frame["kind"] == "exact").sum()),
        "near_duplicates": int((frame["kind"] == "near").sum()),
    }


def _pairs_frame(
    ids: Sequence[str], text_code: np.ndarray, verified: np.ndarray, jac: np.ndarray
) -> pd.DataFrame:
    """Verified pairs of distinct texts, each named by its first document."""
    first_doc = np.asarray(list(ids), dtype=object)[np.unique(text_code, return_index=True)[1]]
    return pd.DataFrame(
        {
            "left_id": pd.array(first_doc[verified[:, 0]], dtype="str"),
            "right_id": pd.array(first_doc[verified[:, 1]], dtype="str"),
            "jaccard": jac,
        }
    )


def _cluster_frame(
    ids: Sequence[str],
    cluster: np.ndarray,
    rep: np.ndarray,
    text_code: np.ndarray,
    shingles: ShingleCache,
) -> pd.DataFrame:
    """The clusters table (CLUSTER_COLUMNS), input order."""
    n = len(cluster)
    is_kept = rep == np.arange(n)
    exact = ~is_kept & (text_code == text_code[rep])
    near = ~is_kept & ~exact
    kinds = np.where(is_kept, "unique", np.where(exact, "exact", "near"))
    max_jac = np.where(exact, 1.0, 0.0)
    # A near member's score is measured against its representative itself, not
    # against whichever neighbour linked it into the cluster.
    pairs = np.stack([text_code[near], text_code[rep[near]]], axis=1)
    max_jac[near] = shingles.jaccard(pairs)
    best = np.zeros(n, dtype=np.float64)
    np.maximum.at(best, rep[~is_kept], max_jac[~is_kept])
    max_jac[is_kept] = best[is_kept]
    id_array = np.asarray(list(ids), dtype=object)
    frame = pd.DataFrame(
        {
            "id": pd.array(id_array, dtype="str"),
            "cluster_id": cluster.astype(np.int64),
            "is_kept": is_kept,
            "kept_id": pd.array(id_array[rep], dtype="str"),
            "kind": pd.array(kinds, dtype="str"),
            "max_jaccard": max_jac.astype(np.float64),
        }
    )
    return frame
