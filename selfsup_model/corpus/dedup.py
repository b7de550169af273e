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

Versions of a growing corpus (`versions`, `extend_duplicates`): first seen wins.
A document kept in an earlier version is never dropped. Version v's documents
are clustered among themselves and against the documents kept so far (not
against earlier dropped ones): a new document connected to a kept one joins
its cluster as a duplicate (the earliest such kept document when it reaches
several; those all stay kept), and one identical to any earlier document is
an exact duplicate of that document's kept one. New clusters follow the rule
above. `extend_duplicates` does this for one new version against the kept
index alone; `find_duplicates(versions=...)` does it over the whole corpus at
once, and both give the same fates (tests/corpus/test_versions.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from selfsup_model.config import DedupConfig
from selfsup_model.corpus.graph import components, first_seen_ids
from selfsup_model.corpus.lsh import (
    band_keys,
    lsh_params,
    pairs_in_runs,
    query_pairs,
    union_pairs,
)
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
    digests: np.ndarray | None = None  # (n, 2) uint64 digests of the folded texts


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


def _check_versions(versions: np.ndarray, n: int) -> np.ndarray:
    versions = np.asarray(versions, dtype=np.int64)
    if versions.shape != (n,) or (np.diff(versions) < 0).any():
        raise UserError("dedup: versions must give each document a version, non-decreasing "
                        "in input order (earlier versions first)")
    return versions


def version_step(old_kept: np.ndarray, new: np.ndarray, edges: np.ndarray,
                 cluster: np.ndarray, rep: np.ndarray, lengths: np.ndarray,
                 next_cluster: int) -> int:
    """Cluster one version's new nodes against the nodes kept so far; returns the next free
    cluster id.

    Nodes are distinct texts in input order. `old_kept`/`new` (u,) masks; `edges` (m, 2)
    verified pairs (those touching neither a new node nor only new/kept nodes are ignored).
    Fills `cluster` and `rep` (the kept node of each node's cluster) for the new nodes, in
    place: a new node connected to kept nodes joins the first of them; other new nodes form
    clusters numbered from `next_cluster` in input order, each kept by its longest node
    (then the first)."""
    u = len(new)
    a, b = edges[:, 0], edges[:, 1]
    live = (new[a] | new[b]) & (new[a] | old_kept[a]) & (new[b] | old_kept[b])
    comp = components(u, edges[live])
    anchor = np.full(u, u, dtype=np.int64)  # per component: first kept node in it
    kept_nodes = np.flatnonzero(old_kept)
    np.minimum.at(anchor, comp[kept_nodes], kept_nodes)
    new_nodes = np.flatnonzero(new)
    joined = new_nodes[anchor[comp[new_nodes]] < u]
    cluster[joined] = cluster[anchor[comp[joined]]]
    rep[joined] = anchor[comp[joined]]
    fresh = new_nodes[anchor[comp[new_nodes]] == u]
    if len(fresh):
        local = first_seen_ids(comp[fresh])  # input order, as in one version
        cluster[fresh] = next_cluster + local
        order = np.lexsort((fresh, -lengths[fresh], local))  # best node first per cluster
        head = np.r_[True, local[order][1:] != local[order][:-1]]
        best = np.empty(local.max() + 1, dtype=np.int64)
        best[local[order][head]] = fresh[order][head]
        rep[fresh] = best[local]
        next_cluster += int(local.max()) + 1
    return next_cluster


def _clusters_by_version(verified: np.ndarray, text_code: np.ndarray, first: np.ndarray,
                         lengths: np.ndarray, versions: np.ndarray) -> tuple[np.ndarray,
                                                                             np.ndarray]:
    """Cluster id and kept document of every document, (n,) each, one version at a time."""
    u = len(first)
    text_version, text_length = versions[first], lengths[first]
    cluster, rep = np.full(u, -1, dtype=np.int64), np.full(u, -1, dtype=np.int64)
    kept, next_cluster = np.zeros(u, dtype=bool), 0
    for version in np.unique(text_version):
        new = text_version == version
        next_cluster = version_step(kept, new, verified, cluster, rep, text_length,
                                    next_cluster)
        kept[rep[new]] = True
    return cluster[text_code], first[rep[text_code]]


def find_duplicates(
    ids: Sequence[str],
    texts: Sequence[str] | TextSource,
    cfg: DedupConfig,
    progress: Progress | None = None,
    mapper: Mapper = local_map,
    shards: int = 1,
    versions: np.ndarray | None = None,
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
    finished shards when they run elsewhere. `versions` (n,), non-decreasing in
    input order, gives earlier versions precedence (module docstring).
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
    if versions is None or len(np.unique(versions)) < 2:
        cluster = first_seen_ids(components(u, verified)[text_code])  # (n,)
        rep = _representatives(cluster, lengths)
    else:
        cluster, rep = _clusters_by_version(verified, text_code, first, lengths,
                                            _check_versions(versions, n))
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
    return DedupResult(frame, signatures, counts, pairs, digests)


def _digest_codes(digests: np.ndarray) -> np.ndarray:
    """(n, 2) uint64 digests as (n,) comparable void scalars."""
    return np.ascontiguousarray(digests).view(np.dtype((np.void, 16))).ravel()


def extend_duplicates(
    previous: DedupResult,
    prev_rows: np.ndarray,
    ids: Sequence[str],
    texts: Sequence[str],
    cfg: DedupConfig,
    progress: Progress | None = None,
) -> DedupResult:
    """The next version's dedup: only its new documents are signed and judged.

    `previous` is the last version's result (its clusters, signatures and digests, in its
    document order); `prev_rows` (n,) gives each current document's row there, or -1 for a
    new one (a changed text counts as new). Earlier documents keep their fates; new ones are
    judged against each other and against the kept documents only (module docstring), which
    `find_duplicates(versions=...)` over the whole corpus reproduces."""
    n = _check_inputs(ids, texts)
    prev_rows = np.asarray(prev_rows, dtype=np.int64)
    old, new = np.flatnonzero(prev_rows >= 0), np.flatnonzero(prev_rows < 0)
    prev = previous.clusters
    prev_digests = previous.digests
    if prev_digests is None:  # a version written before digests were kept
        raise UserError("the previous corpus version has no dedup digests; start a new "
                        "lineage (selfsup run --new-lineage)")
    # Where each current document's previous row lives, and which earlier ones are kept.
    position = np.full(len(prev), -1, dtype=np.int64)
    position[prev_rows[old]] = old
    prev_kept = prev["is_kept"].to_numpy()
    kept_pos = position[np.flatnonzero(prev_kept)]
    kept_pos = np.sort(kept_pos[kept_pos >= 0])  # active kept documents, input order
    rep_pos = pd.Index(pd.Series(list(ids), dtype=object)).get_indexer(
        prev["kept_id"].to_numpy(object)[prev_rows[old]])  # (o,) -1 where the kept one retired

    part = signature_shard(InMemoryTexts([texts[i] for i in new]), 0, len(new), cfg, progress)
    # An earlier document with the same folded text: the newcomer is its kept one's exact copy.
    known = _digest_codes(prev_digests[prev_rows[old]])[rep_pos >= 0]
    known_rep = rep_pos[rep_pos >= 0]
    order = np.argsort(known, kind="stable")
    hit = np.searchsorted(known[order], _digest_codes(part.digests)) if len(known) else None
    match = np.full(len(part.digests), -1, dtype=np.int64)  # per new distinct text
    if hit is not None:
        found = hit < len(known)
        found[found] &= known[order][hit[found]] == _digest_codes(part.digests)[found]
        match[found] = known_rep[order][hit[found]]
    fresh = np.flatnonzero(match < 0)  # new distinct texts no earlier document holds

    # Nodes: the kept earlier documents, then the fresh texts; candidates touch a fresh one.
    k = len(kept_pos)
    node_sig = np.concatenate([previous.signatures[prev_rows[kept_pos]],
                               part.signatures[fresh]])
    first_new = new[np.unique(part.code, return_index=True)[1]]  # first doc of each text
    node_doc = np.r_[kept_pos, first_new[fresh]]
    is_query = np.r_[np.zeros(k, dtype=bool), np.ones(len(fresh), dtype=bool)]
    bands, rows = lsh_params(cfg.threshold, cfg.num_perm)
    cand = union_pairs([p for keys in band_keys(node_sig, bands, rows)
                        for p in query_pairs(keys, is_query)], len(node_sig))
    plausible = plausible_pairs(node_sig, cand, cfg.threshold)
    checked = cand[plausible]
    jac = verify_pairs(_Rows(texts, node_doc), checked, cfg.shingle, cfg.shingle_size)
    verified, jac = checked[jac >= cfg.threshold], jac[jac >= cfg.threshold]

    u = len(node_sig)
    cluster, rep = np.full(u, -1, dtype=np.int64), np.arange(u, dtype=np.int64)
    cluster[:k] = prev["cluster_id"].to_numpy()[prev_rows[kept_pos]]
    lengths = np.r_[np.zeros(k, dtype=np.int64), part.lengths[fresh]]
    version_step(np.arange(u) < k, np.arange(u) >= k, verified, cluster, rep, lengths,
                 int(prev["cluster_id"].max()) + 1 if len(prev) else 0)

    # Every current document's cluster and kept document (positions), old ones unchanged.
    doc_cluster, doc_rep = np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64)
    doc_cluster[old] = prev["cluster_id"].to_numpy()[prev_rows[old]]
    doc_rep[old] = np.where(rep_pos >= 0, rep_pos, old)  # a retired kept one: itself, noted
    text_node = np.full(len(part.digests), -1, dtype=np.int64)
    text_node[fresh] = k + np.arange(len(fresh))
    code = part.code
    by_match = match[code] >= 0
    doc_rep[new[by_match]] = match[code[by_match]]
    doc_cluster[new[by_match]] = doc_cluster[match[code[by_match]]]
    node = text_node[code[~by_match]]
    doc_rep[new[~by_match]] = node_doc[rep[node]]
    doc_cluster[new[~by_match]] = cluster[node]

    digests = np.empty((n, 2), dtype=np.uint64)
    digests[old] = prev_digests[prev_rows[old]]
    digests[new] = part.digests[code]
    frame = _extended_frame(prev, prev_rows, ids, texts, doc_cluster, doc_rep, digests, cfg)
    signatures = np.empty((n, previous.signatures.shape[1]), dtype=previous.signatures.dtype)
    signatures[old] = previous.signatures[prev_rows[old]]
    signatures[new] = part.signatures[code]
    id_array = np.asarray(list(ids), dtype=object)
    active = pd.Index(id_array)  # unique (checked); a hash lookup, not pandas' per-value isin
    kept_pairs = previous.pairs[(active.get_indexer(previous.pairs["left_id"]) >= 0)
                                & (active.get_indexer(previous.pairs["right_id"]) >= 0)]
    new_pairs = pd.DataFrame({"left_id": pd.array(id_array[node_doc[verified[:, 0]]], "str"),
                              "right_id": pd.array(id_array[node_doc[verified[:, 1]]], "str"),
                              "jaccard": jac})
    pairs = pd.concat([kept_pairs, new_pairs], ignore_index=True)
    new_dropped = ~frame["is_kept"].to_numpy()[new]
    counts = {
        "documents": n,
        "new_documents": len(new),
        "distinct_texts": len(np.unique(_digest_codes(digests))),
        **_fate_counts(frame),
        "new_kept": int((~new_dropped).sum()),
        "new_duplicates_of_earlier": int((new_dropped & (prev_rows[doc_rep[new]] >= 0)).sum()),
        "candidate_pairs": len(cand),
        "skipped_by_signature": int((~plausible).sum()),
        "verified_pairs": len(verified),
        "lsh_bands": bands,
        "lsh_rows": rows,
    }
    return DedupResult(frame, signatures, counts, pairs, digests)


class _Rows:
    """texts[rows[i]] as a read-only sequence (what `verify_pairs` reads)."""

    def __init__(self, texts: Sequence[str], rows: np.ndarray):
        self.texts, self.rows = texts, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> str:
        return self.texts[int(self.rows[i])]


def _extended_frame(prev: pd.DataFrame, prev_rows: np.ndarray, ids: Sequence[str],
                    texts: Sequence[str], cluster: np.ndarray, rep: np.ndarray,
                    digests: np.ndarray, cfg: DedupConfig) -> pd.DataFrame:
    """The clusters table of a new version: earlier rows as they were, new rows judged now,
    and a kept document's max_jaccard raised by the newcomers that joined it."""
    n = len(cluster)
    old, new = np.flatnonzero(prev_rows >= 0), np.flatnonzero(prev_rows < 0)
    id_array = np.asarray(list(ids), dtype=object)
    is_kept = np.zeros(n, dtype=bool)
    is_kept[old] = prev["is_kept"].to_numpy()[prev_rows[old]]
    is_kept[new] = rep[new] == new
    codes = _digest_codes(digests)
    exact = np.zeros(n, dtype=bool)
    exact[new] = ~is_kept[new] & (codes[new] == codes[rep[new]])
    near = np.zeros(n, dtype=bool)
    near[new] = ~is_kept[new] & ~exact[new]
    max_jac = np.zeros(n, dtype=np.float64)
    max_jac[old] = prev["max_jaccard"].to_numpy()[prev_rows[old]]
    max_jac[exact] = 1.0
    near_rows = np.flatnonzero(near)
    max_jac[near_rows] = verify_pairs(texts, np.stack([near_rows, rep[near_rows]], axis=1),
                                      cfg.shingle, cfg.shingle_size)
    joined = new[~is_kept[new]]
    np.maximum.at(max_jac, rep[joined], max_jac[joined])
    kinds = np.full(n, "unique", dtype=object)
    kinds[old] = prev["kind"].to_numpy(object)[prev_rows[old]]
    kinds[exact], kinds[near] = "exact", "near"
    kept_id = np.empty(n, dtype=object)
    kept_id[old] = prev["kept_id"].to_numpy(object)[prev_rows[old]]
    kept_id[new] = id_array[rep[new]]
    return pd.DataFrame({
        "id": pd.array(id_array, dtype="str"),
        "cluster_id": cluster.astype(np.int64),
        "is_kept": is_kept,
        "kept_id": pd.array(kept_id, dtype="str"),
        "kind": pd.array(kinds, dtype="str"),
        "max_jaccard": max_jac,
    })


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
