"""Grouping documents: integer codes, edges between equal codes, connected components.

Dedup clusters and split units are both connected components of a document
graph; these helpers build such graphs from shared values and label the
components, all in numpy/scipy over whole arrays, with deterministic numbering
(first appearance in input order) so the same input always gives the same ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components


def components(n: int, pairs: np.ndarray) -> np.ndarray:
    """Connected-component label of each of n nodes joined by (m, 2) pairs: (n,) int64."""
    edges = coo_matrix((np.ones(len(pairs)), (pairs[:, 0], pairs[:, 1])), shape=(n, n))
    return connected_components(edges, directed=False)[1].astype(np.int64)


def first_seen_ids(labels: np.ndarray) -> np.ndarray:
    """Renumber labels 0, 1, ... in order of first appearance: (n,) int64."""
    _, first, inverse = np.unique(labels, return_index=True, return_inverse=True)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    return rank[inverse]


def value_codes(values: Sequence[Any]) -> np.ndarray:
    """Integer code per value, -1 for None/NaN: (n,) int64."""
    return pd.factorize(pd.Series(list(values), dtype=object), sort=False)[0].astype(np.int64)


def same_code_pairs(codes: np.ndarray) -> np.ndarray:
    """Star edges joining every node to the first one with its code (codes >= 0): (m, 2)."""
    idx = np.flatnonzero(codes >= 0)
    _, first = np.unique(codes[idx], return_index=True)
    head = np.full(codes.max(initial=-1) + 1, -1, dtype=np.int64)
    head[codes[idx[first]]] = idx[first]
    return np.stack([idx, head[codes[idx]]], axis=1)
