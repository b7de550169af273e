"""Exact and near-duplicate detection: which documents to keep, and why each other one goes.

Order of work: texts are folded (`minhash.fold_for_shingling`: lowercase,
whitespace collapsed); identical folded texts are exact duplicates (found by a
128-bit digest of the folded text); one MinHash signature per distinct text
feeds LSH banding at `cfg.threshold`; every LSH candidate pair is verified with
its exact shingle Jaccard before it counts (candidates whose signatures put the
threshold 6 standard errors away are skipped as certain misses - see
`minhash.plausible_pairs`); verified pairs and exact groups are joined into
clusters (`graph.components`, so a chain A~B~C is one cluster). The per-document
steps run as shards (`find_duplicates`), in this process or on a cluster.

Representative rule: each cluster keeps the member with the longest
folded text; ties go to the member that comes first in the input. Every
other member is dropped as a duplicate of that kept document.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from selfsup_model.config import DedupConfig
from selfsup_model.corpus.graph import components, first_seen_ids
from selfsup_model.corpus.lsh import band_keys, lsh_params, pairs_in_runs, union_pairs
from selfsup_model.corpus.minhash import (
    Progress,
    fold_for_shingling,
    minhash_signatures,
    plausible_pairs,
    sorted_unique,
    verify_pairs,
)
from selfsup_model.corpus.sharding import (
    InMemoryTexts,
    Mapper,
    TextSource,
    local_map,
    pair_chunks,
    shard_bounds,
)
from selfsup_model.errors import UserError

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
    texts: Sequence[str] | TextSource,
    cfg: DedupConfig,
    progress: Progress | None = None,
    mapper: Mapper = local_map,
    shards: int = 1,
) -> DedupResult:
    """Cluster exact and verified near-duplicates; keep one document per cluster.

    The work is cut the way large-scale dedup is: per-shard signatures and band
    keys (`signature_shard`), the global exact-duplicate pass in first-occurrence
    order (here), one task per band pairing equal keys (`band_candidates`),
    verification in chunks (`jaccard_shard`) and connected components (here).
    `mapper` decides where shard work runs (`selfsup_model.corpus.sharding`); every
    combination of mapper and shard count gives the same result, bit for bit.
    `texts` is the texts themselves (in-process mappers only) or a `TextSource`
    the shards read from. `progress(done, total)` counts the distinct texts of a
    shard signed so far when shards run in this process, and documents of
    finished shards when they run elsewhere.
    """
    source = InMemoryTexts(texts) if not hasattr(texts, "take") else texts
    if isinstance(source, InMemoryTexts) and not mapper.in_process:
        raise ValueError("texts held in memory can only be sharded in this process; pass a "
                         "TextSource (e.g. ParquetTexts) for other mappers")
    n = _check_inputs(ids, source)
    bands, rows = lsh_params(cfg.threshold, cfg.num_perm)
    items = [{"source": source, "lo": lo, "hi": hi, "cfg": cfg}
             for lo, hi in shard_bounds(n, shards)]
    if mapper.in_process and progress is not None:
        for item in items:  # distinct texts signed, shard by shard
            item["progress"] = progress
    parts = mapper("dedup-signatures", signature_shard, items,
                   progress=None if mapper.in_process else _shard_progress(progress, items, n))
    signatures = np.concatenate([p.signatures[p.code] for p in parts])  # (n, num_perm)
    digests = np.concatenate([p.digests[p.code] for p in parts])  # (n, 2)
    lengths = np.concatenate([p.lengths[p.code] for p in parts])  # (n,) folded lengths
    text_code, first = first_occurrence(digests)  # (n,), (u,): the global exact pass
    keys = np.concatenate([p.band_keys[:, p.code] for p in parts], axis=1)[:, first]  # (bands, u)
    sig_u, u = signatures[first], len(first)
    cand = union_pairs(mapper("dedup-bands", band_candidates, [{"keys": k} for k in keys]),
                       u)  # (c, 2) over distinct texts, sorted
    plausible = plausible_pairs(sig_u, cand, cfg.threshold)
    checked = cand[plausible]
    jac = _jaccard(mapper, "dedup-verify", source, first[checked], cfg, shards)
    verified, jac = checked[jac >= cfg.threshold], jac[jac >= cfg.threshold]
    cluster = first_seen_ids(components(u, verified)[text_code])  # (n,)
    rep = _representatives(cluster, lengths)
    frame = _cluster_frame(ids, cluster, rep, text_code,
                           lambda pairs: _jaccard(mapper, "dedup-kept-jaccard", source, pairs,
                                                  cfg, shards))
    counts = {
        "documents": n,
        "distinct_texts": u,
        **_fate_counts(frame),
        "candidate_pairs": len(cand),
        "skipped_by_signature": int((~plausible).sum()),
        "verified_pairs": len(verified),
        "lsh_bands": bands,
        "lsh_rows": rows,
    }
    pairs = _pairs_frame(ids, first, verified, jac)
    return DedupResult(frame, signatures, counts, pairs)


@dataclass(frozen=True, eq=False)
class ShardSignatures:
    """One shard's distinct folded texts: their MinHash signatures (u, num_perm) uint32, LSH
    band keys (bands, u) uint64, 128-bit digests (u, 2) uint64 and folded lengths (u,) int64;
    `code` (k,) maps each of the shard's documents to its distinct text."""

    code: np.ndarray
    signatures: np.ndarray
    band_keys: np.ndarray
    digests: np.ndarray
    lengths: np.ndarray


def signature_shard(source: TextSource, lo: int, hi: int, cfg: DedupConfig,
                    progress: Progress | None = None) -> ShardSignatures:
    """Signatures, band keys, digests and lengths of documents [lo, hi) of `source`; a text
    repeated inside the shard is signed once."""
    folded = [fold_for_shingling(t) for t in source.slice(lo, hi)]
    code, distinct = pd.factorize(pd.Series(folded, dtype=object), sort=False)
    distinct = list(distinct)
    sig = minhash_signatures(distinct, num_perm=cfg.num_perm, seed=cfg.seed, kind=cfg.shingle,
                             size=cfg.shingle_size, batch_size=cfg.batch_size, folded=True,
                             progress=progress)
    digests = np.frombuffer(b"".join(
        hashlib.blake2b(t.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        for t in distinct), dtype=np.uint64).reshape(len(distinct), 2)
    return ShardSignatures(code.astype(np.int64), sig,
                           band_keys(sig, *lsh_params(cfg.threshold, cfg.num_perm)), digests,
                           np.array([len(t) for t in distinct], dtype=np.int64))


def first_occurrence(digests: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact-duplicate pass over (n, 2) uint64 text digests: each document's distinct-text
    code (n,) int64, codes numbered in order of first occurrence, and the first document
    holding each distinct text (u,) int64 (ascending)."""
    rows = np.ascontiguousarray(digests).view(np.dtype((np.void, 16))).ravel()
    _, first, inverse = np.unique(rows, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return rank[inverse.ravel()].astype(np.int64), first[order].astype(np.int64)


def band_candidates(keys: np.ndarray) -> np.ndarray:
    """Every pair of documents sharing this band's key: (m, 2) int64 (one band's LSH task)."""
    return pairs_in_runs(keys)


def jaccard_shard(source: TextSource, pairs: np.ndarray, kind: str, size: int) -> np.ndarray:
    """Exact shingle Jaccard of (m, 2) document-row pairs of `source`: (m,) float64; only the
    documents the pairs name are read and shingled."""
    involved = sorted_unique(pairs.ravel())
    # verify_pairs reads texts[i] only for the rows the pairs name: a dict of those suffices
    return verify_pairs(dict(zip(involved.tolist(), source.take(involved), strict=True)), pairs,
                        kind, size)


def _jaccard(mapper: Mapper, name: str, source: TextSource, pairs: np.ndarray,
             cfg: DedupConfig, shards: int) -> np.ndarray:
    chunks = pair_chunks(pairs, shards)
    out = mapper(name, jaccard_shard, [{"source": source, "pairs": c, "kind": cfg.shingle,
                                             "size": cfg.shingle_size} for c in chunks])
    return np.concatenate(out) if out else np.empty(0, dtype=np.float64)


def _shard_progress(progress: Progress | None, items: list[dict], n: int) -> Progress | None:
    """Documents signed so far, as shards come back."""
    if progress is None:
        return None
    return lambda done, _total: progress(items[done - 1]["hi"] if done else 0, n)


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
    ids: Sequence[str], first: np.ndarray, verified: np.ndarray, jac: np.ndarray
) -> pd.DataFrame:
    """Verified pairs of distinct texts, each named by its first document (`first`)."""
    first_doc = np.asarray(list(ids), dtype=object)[first]
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
    jaccard: Callable[[np.ndarray], np.ndarray],
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
    max_jac[near] = jaccard(np.stack([np.flatnonzero(near), rep[near]], axis=1))
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
