"""LSH banding over MinHash signatures: which pairs are worth an exact Jaccard check.

A signature's columns are cut into `bands` bands of `rows` columns; two
documents become a candidate pair when any band hashes to the same 64-bit key.
(bands, rows) come from datasketch's optimiser, weighting a missed pair above
a false candidate: every candidate is verified exactly afterwards
(`minhash.verify_candidates`), so an extra candidate costs one check while a
miss loses a duplicate or lets a near-copy leak across splits. Everything is
numpy over all documents: keys are sorted per band and equal keys paired.

For the split stage, whose 0.5 threshold makes buckets of templated text large,
buckets are kept as buckets (`band_buckets`) and their pairs cut lazily
(`CrossLabelPlan`), and pairs are judged cheapest test first (`PairJudge`:
signature low bytes, full signatures, an exact occupancy bound, exact Jaccard
from shingle sets cut once per document in a `ShingleCache`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
from datasketch.lsh import _optimal_param

from selfsup_model.corpus.minhash import (
    SortedCodes,
    agreement_at_least,
    agreement_floor,
    budget_chunks,
    byte_agreement_at_least,
    pair_jaccard,
    ragged_arange,
    shingle_rows,
    sorted_unique,
)

# Every candidate is verified exactly, so a false positive costs one Jaccard
# computation while a false negative silently loses a duplicate (or lets a
# near-copy leak across splits): misses are weighted 19 to 1.
MISS_WEIGHT = 0.95
# Related pairs decide the split, so unit building and the leakage audit weigh LSH misses 99:1
# against extra candidates (verification removes those): at a 0.5 threshold and 128
# permutations that is 39 bands of 3 rows, and a J=0.5 pair becomes a candidate with
# probability 0.995.
UNIT_MISS_WEIGHT = 0.99


@lru_cache(maxsize=64)
def lsh_params(
    threshold: float, num_perm: int, miss_weight: float = MISS_WEIGHT
) -> tuple[int, int]:
    """(bands, rows) minimising the weighted false-positive + false-negative areas (datasketch)."""
    return _optimal_param(threshold, num_perm, 1.0 - miss_weight, miss_weight)


def band_keys(signatures: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """One 64-bit key per (band, document): (bands, n) uint64.

    Key collisions only add candidates, and every candidate is verified."""
    sig = signatures[:, : bands * rows].reshape(len(signatures), bands, rows)  # a view
    keys = np.zeros((bands, len(signatures)), dtype=np.uint64)
    for r in range(rows):
        row = sig[:, :, r].T.astype(np.uint64)  # (bands, n): one row at a time keeps memory small
        keys = (keys ^ row) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(r + 1)
    return keys ^ (keys >> np.uint64(29))


def pairs_in_runs(keys: np.ndarray) -> np.ndarray:
    """All (i, j) pairs of positions whose keys are equal: (m, 2) int64."""
    order = np.argsort(keys, kind="stable")
    k = keys[order]
    new_run = np.r_[True, k[1:] != k[:-1]]
    run_end = np.r_[np.flatnonzero(new_run)[1:], len(k)][np.cumsum(new_run) - 1]
    after = run_end - np.arange(len(k)) - 1  # members of the run after this position
    idx = np.flatnonzero(after > 0)
    out, step = [], 1
    while len(idx):  # step d pairs every member with the one d places later in its run
        out.append(np.stack([order[idx], order[idx + step]], axis=1))
        step += 1
        idx = idx[after[idx] >= step]
    return np.concatenate(out) if out else np.empty((0, 2), dtype=np.int64)


def query_pairs(keys: np.ndarray, is_query: np.ndarray, budget: int = 1 << 20):
    """Pairs of positions with equal `keys` of which at least one `is_query`, in (k, 2) int64
    chunks of about `budget` pairs: (query, other), each such pair once per band.

    Members of a run are ordered non-queries first, so each query pairs with everything
    before it in its run: every index pair (old x new, new x new) and never old x old -
    the cost follows the queries, however many indexed items share their bucket."""
    order = np.lexsort((np.arange(len(keys)), is_query, keys))
    k = keys[order]
    run_start = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
    start = run_start[np.cumsum(np.r_[True, k[1:] != k[:-1]]) - 1]  # (n,) run start per position
    pos = np.flatnonzero(is_query[order])
    count = pos - start[pos]  # items before each query in its run
    pos, count = pos[count > 0], count[count > 0]
    for lo, hi in budget_chunks(count, budget):
        left = np.repeat(order[pos[lo:hi]], count[lo:hi])
        yield np.stack([left, order[ragged_arange(start[pos[lo:hi]], count[lo:hi])]], axis=1)


def relatedness_banding(signatures: np.ndarray, threshold: float,
                        column_seed: int | None = None) -> tuple[np.ndarray, tuple[int, int]]:
    """The signatures to band for relatedness (columns in a seeded order when `column_seed`
    is given, so the same hashes form other bands) and their (bands, rows) at
    UNIT_MISS_WEIGHT."""
    if column_seed is not None:
        columns = np.random.default_rng(column_seed).permutation(signatures.shape[1])
        signatures = signatures[:, columns]
    return signatures, lsh_params(threshold, signatures.shape[1], UNIT_MISS_WEIGHT)


def query_candidates(signatures: np.ndarray, bands_rows: tuple[int, int], is_query: np.ndarray,
                     budget: int = 1 << 20):
    """Every band's bucket-mate pairs with a query document (`query_pairs`), in chunks."""
    for keys in band_keys(signatures, *bands_rows):
        yield from query_pairs(keys, is_query, budget)


def candidate_pairs(
    signatures: np.ndarray, threshold: float, bands_rows: tuple[int, int] | None = None
) -> np.ndarray:
    """LSH candidate pairs within one set: (m, 2) int64, i < j, sorted, unique."""
    bands, rows = bands_rows or lsh_params(threshold, signatures.shape[1])
    return union_pairs([pairs_in_runs(keys) for keys in band_keys(signatures, bands, rows)],
                       len(signatures))


def union_pairs(found: list[np.ndarray], n: int) -> np.ndarray:
    """The distinct unordered pairs among several (m, 2) arrays over n items: (c, 2) int64,
    i < j, sorted."""
    pairs = np.concatenate(found) if found else np.empty((0, 2), dtype=np.int64)
    code = sorted_unique(
        np.minimum(pairs[:, 0], pairs[:, 1]) * n + np.maximum(pairs[:, 0], pairs[:, 1])
    )
    return np.stack([code // n, code % n], axis=1) if n else np.empty((0, 2), dtype=np.int64)


def band_buckets(
    signatures: np.ndarray, bands_rows: tuple[int, int], columns: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Every LSH bucket of >= 2 documents, over all bands: members (e,) and bounds (b + 1,).

    Bucket k holds members[bounds[k]:bounds[k + 1]] (document indices, ascending).
    `columns` reorders the signature columns first, so the same hashes form other bands.
    Memory is one entry per (band, bucketed document): bands * n at most."""
    bands, rows = bands_rows
    sig = signatures if columns is None else signatures[:, columns]
    members, sizes = [], []
    for keys in band_keys(sig, bands, rows):
        order = np.argsort(keys, kind="stable")
        k = keys[order]
        start = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
        size = np.diff(np.r_[start, len(k)])
        big = size >= 2
        members.append(order[ragged_arange(start[big], size[big])])
        sizes.append(size[big])
    sizes_all = np.concatenate(sizes) if sizes else np.empty(0, dtype=np.int64)
    bounds = np.r_[0, np.cumsum(sizes_all)].astype(np.int64)
    return (np.concatenate(members) if members else np.empty(0, dtype=np.int64)), bounds


class CrossLabelPlan:
    """The pairs of bucket-mates whose labels differ, laid out so they can be cut lazily.

    Members of each bucket are ordered by label (then document), so a member's
    partners with a different, later label are one contiguous range: pairs can be
    generated a budget at a time (`chunks`) instead of all at once, and a bucket
    whose members share one label - a big bucket of near-copies already joined -
    costs nothing. `adjacent` gives one pair per boundary between label runs: a
    cheap chain through each bucket that joins near-copies in one pass."""

    def __init__(self, members: np.ndarray, bounds: np.ndarray, label: np.ndarray):
        bucket = np.repeat(np.arange(len(bounds) - 1), np.diff(bounds))  # (e,) sorted
        lab = label[members]
        # Members are ascending within a bucket, so a stable sort keeps document order.
        order = np.argsort(bucket * (int(lab.max(initial=0)) + 1) + lab, kind="stable")
        self.doc, lab = members[order], lab[order]  # (e,) by (bucket, label, document)
        new_run = np.r_[True, (bucket[1:] != bucket[:-1]) | (lab[1:] != lab[:-1])]
        run_start = np.flatnonzero(new_run)
        self.run_end = np.r_[run_start[1:], len(lab)][np.cumsum(new_run) - 1]  # (e,)
        self.partners = bounds[bucket + 1] - self.run_end  # (e,) later members, other label

    @property
    def total(self) -> int:
        """Pairs in the plan (a pair sharing several buckets counts once per bucket)."""
        return int(self.partners.sum())

    def adjacent(self) -> np.ndarray:
        """(last of a label run, first of the next run in its bucket): (k, 2) int64."""
        last = np.flatnonzero((self.partners > 0) & (self.run_end == np.arange(len(self.doc)) + 1))
        return np.stack([self.doc[last], self.doc[last + 1]], axis=1)

    def chunks(self, budget: int):
        """Every planned pair, about `budget` at a time: (k, 2) int64 arrays."""
        active = np.flatnonzero(self.partners > 0)
        for lo, hi in budget_chunks(self.partners[active], budget):
            pos, count = active[lo:hi], self.partners[active[lo:hi]]
            right = self.doc[ragged_arange(self.run_end[pos], count)]
            yield np.stack([np.repeat(self.doc[pos], count), right], axis=1)


# Buckets of the occupancy bound (`ShingleCache.may_reach`): 512 bytes per document.
_SKETCH_BITS = 4096
_SKETCH_ROWS = 4096  # documents per pass when building sketches: a 16 MiB bool scratch
_BOUND_CHUNK = 1 << 14  # pairs per pass of the bound: two (chunk, 64) uint64 gathers, 16 MiB


def occupancy_sketch(values: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Which of _SKETCH_BITS buckets (shingle id mod _SKETCH_BITS) each of some back-to-back
    shingle sets occupies, (k, _SKETCH_BITS // 64) uint64 bitsets, and its spill (k,) int64:
    shingles beyond one per occupied bucket."""
    k, sizes = len(offsets) - 1, np.diff(offsets)
    bits = np.empty((k, _SKETCH_BITS // 64), dtype=np.uint64)
    for lo in range(0, k, _SKETCH_ROWS):
        hi = min(lo + _SKETCH_ROWS, k)
        ids = values[offsets[lo] : offsets[hi]]
        row = np.repeat(np.arange(hi - lo), sizes[lo:hi])
        occupied = np.zeros((hi - lo, _SKETCH_BITS), dtype=bool)
        occupied[row, ids & (_SKETCH_BITS - 1)] = True
        bits[lo:hi] = np.packbits(occupied, axis=1, bitorder="little").view(np.uint64)
    return bits, sizes - np.bitwise_count(bits).sum(axis=1, dtype=np.int64)


class ShingleCache:
    """Shingle sets of documents on demand, each document shingled at most once.

    Unit building and the leakage audit verify many overlapping batches of pairs
    over the same documents; this keeps the sets already cut (`shingle_rows`,
    uint32, 4 bytes a shingle) and their occupancy sketches (`may_reach`). Sets
    are appended to a buffer that grows by half when full, so many small
    additions cost about what one large one does."""

    def __init__(
        self, texts: Sequence[str], kind: str = "char", size: int = 5, folded: bool = False
    ):
        self.texts, self.kind, self.size, self.folded = texts, kind, size, folded
        self.row = np.full(len(texts), -1, dtype=np.int64)  # (n,) set index of each doc
        self._values = np.empty(1 << 16, dtype=np.uint32)  # every set held, then room
        self.offsets = np.zeros(1, dtype=np.int64)  # (sets + 1,) into the values
        # sketches of the first `sketched` sets, grown by `may_reach` (by half when full)
        self._bits = np.empty((0, _SKETCH_BITS // 64), dtype=np.uint64)
        self._spill = np.empty(0, dtype=np.int64)
        self.sketched = 0

    @property
    def values(self) -> np.ndarray:
        """The sets held, back to back: (offsets[-1],) uint32."""
        return self._values[: self.offsets[-1]]

    def add(self, docs: np.ndarray) -> None:
        """Shingle the documents among `docs` that are not held yet."""
        new = sorted_unique(np.asarray(docs, dtype=np.int64).ravel())
        new = new[self.row[new] < 0]
        if not len(new):
            return
        self.row[new] = len(self.offsets) - 1 + np.arange(len(new))
        values, counts = shingle_rows(self.texts, new, self.kind, self.size, self.folded)
        held, more = int(self.offsets[-1]), len(values)
        if held + more > len(self._values):  # grow by half at least: amortised appends
            capacity = max(len(self._values) * 3 // 2, held + more)
            self._values = np.r_[self._values[:held], np.empty(capacity - held, np.uint32)]
        self._values[held : held + more] = values
        self.offsets = np.r_[self.offsets, held + np.cumsum(counts)]

    def may_reach(self, pairs: np.ndarray, threshold: float) -> np.ndarray:
        """Mask (m,): pairs whose Jaccard an exact upper bound leaves >= threshold.

        Shared shingles sit in buckets both documents occupy, at most one per such
        bucket plus the smaller spill: |A & B| <= shared buckets + min(spills).
        The bound is a proof, not an estimate, so it drops no related pair; at
        ~370 shingles a document it rules out pairs up to J ~ 0.45 for the cost
        of a 1 KiB gather instead of a merge of both shingle lists."""
        self.add(pairs)
        done, held = self.sketched, len(self.offsets) - 1
        if done < held:
            if held > len(self._bits):  # grow by half at least: amortised, as the values
                capacity = max(len(self._bits) * 3 // 2, held)
                self._bits = np.r_[self._bits[:done],
                                   np.empty((capacity - done, _SKETCH_BITS // 64), np.uint64)]
                self._spill = np.r_[self._spill[:done], np.empty(capacity - done, np.int64)]
            self._bits[done:held], self._spill[done:held] = occupancy_sketch(
                self.values, self.offsets[done:])
            self.sketched = held
        bits, spill = self._bits, self._spill
        left, right = self.row[pairs[:, 0]], self.row[pairs[:, 1]]
        sizes = np.diff(self.offsets)
        out = np.empty(len(pairs), dtype=bool)
        for lo in range(0, len(pairs), _BOUND_CHUNK):
            lft, rgt = left[lo : lo + _BOUND_CHUNK], right[lo : lo + _BOUND_CHUNK]
            shared = np.bitwise_count(bits[lft] & bits[rgt]).sum(axis=1, dtype=np.int64)
            inter = shared + np.minimum(spill[lft], spill[rgt])  # >= |A & B|
            out[lo : lo + len(lft)] = inter / (sizes[lft] + sizes[rgt] - inter) >= threshold
        return out

    def jaccard(self, pairs: np.ndarray) -> np.ndarray:
        """Exact Jaccard of each (i, j) row of `pairs`: (m,) float64."""
        self.add(pairs)
        return pair_jaccard(self.values, self.offsets, self.row[pairs[:, 0]], self.row[pairs[:, 1]])


class PairJudge:
    """Judges document pairs against a Jaccard threshold, remembering every "unrelated".

    Unit building and the leakage audit ask about many overlapping batches of
    pairs over the same documents. Cheapest test first: the low bytes of the
    signatures (they agree wherever the full values do, so they never reject a
    pair the full test keeps), the full signatures (`plausible_pairs`: 6 standard
    errors), the occupancy bound (`ShingleCache.may_reach`: exact), and only then
    the exact Jaccard. Pairs found unrelated are remembered (codes i * n + j,
    i < j) and not judged again - a pair shares several LSH buckets, or unit
    building judged it before the audit meets it; a related pair is judged again
    whenever asked, so the audit re-checks it rather than trusts it. `counts` add
    up every call: candidate_pairs as given (a pair once per bucket it shares),
    how many of them each cheap test ruled out, how many were verified exactly,
    and how many distinct related pairs came out.
    """

    def __init__(
        self,
        texts: Sequence[str],
        signatures: np.ndarray,
        threshold: float,
        kind: str = "char",
        size: int = 5,
    ):
        self.signatures, self.threshold, self.n = signatures, threshold, len(texts)
        # (n, num_perm / 8) uint64: each signature's low bytes, a quarter of the gather
        self.low_bytes = np.ascontiguousarray(signatures.astype(np.uint8)).view(np.uint64)
        self.floor = agreement_floor(threshold, signatures.shape[1])
        self.shingles = ShingleCache(texts, kind, size)
        self.unrelated = SortedCodes()  # codes of the pairs judged unrelated
        self.counts = dict.fromkeys(
            (
                "candidate_pairs",
                "skipped_by_signature",
                "skipped_by_bound",
                "verified_pairs",
                "related_pairs",
            ),
            0,
        )

    def related(self, pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The distinct pairs among `pairs` (repeats allowed) at exact Jaccard >= threshold,
        (k, 2) with i < j, and their Jaccard (k,) float64."""
        n, count = self.n, len(pairs)
        # Most LSH candidates fail the low bytes already: test them before any sort.
        pairs = pairs[byte_agreement_at_least(self.low_bytes, pairs, self.floor)]
        low_byte_fails = count - len(pairs)
        code = sorted_unique(pairs.min(axis=1) * n + pairs.max(axis=1))
        code = code[~self.unrelated.contains(code)]  # repeats and known verdicts go
        pairs = np.stack([code // n, code % n], axis=1)
        plausible = np.flatnonzero(agreement_at_least(self.signatures, pairs, self.floor))
        alive = plausible[self.shingles.may_reach(pairs[plausible], self.threshold)]
        jac = np.zeros(len(pairs))
        jac[alive] = self.shingles.jaccard(pairs[alive])
        related = jac >= self.threshold
        self.unrelated.add(code[~related])
        for key, value in (
            ("candidate_pairs", count),
            ("skipped_by_signature", low_byte_fails + len(pairs) - len(plausible)),
            ("skipped_by_bound", len(plausible) - len(alive)),
            ("verified_pairs", len(alive)),
            ("related_pairs", int(related.sum())),
        ):
            self.counts[key] += value
        return pairs[related], jac[related]
