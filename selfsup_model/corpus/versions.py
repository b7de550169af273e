"""Versions of a corpus that grows: what changed since the last version, and the policy.

A workdir's corpus is a lineage of versions (`flows.versions` keeps them). Between two
versions, by document id:
- unchanged: same id, same normalised text. It keeps everything: its dedup fate, its split.
- new: an id the last version did not hold. Dedup judges it against the documents kept so far
  (`dedup.extend_duplicates`: first seen wins) and the split places it without moving anyone
  (`splitting.extend_splits`).
- changed: same id, other text. The old text is retired and the new one judged as new; it
  keeps its earlier split unless its new text ties it to another (then it is quarantined).
- retired: an id the last version held and this one does not. It is counted, and never comes
  back into any split; its dedup cluster keeps its other members as they were.
A version that keeps less than `MIN_SHARED` of the last one's documents is not a new version
of the same corpus: the run starts a new lineage and says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

MIN_SHARED = 0.5  # unchanged documents / the last version's documents, below: a new lineage


@dataclass(frozen=True)
class VersionDiff:
    """How this version's documents relate to the last version's.

    prev_rows: (n,) each document's row in the last version when unchanged, else -1."""

    prev_rows: np.ndarray
    changed: list[str]
    retired: list[str]

    @property
    def unchanged(self) -> int:
        return int((self.prev_rows >= 0).sum())

    @property
    def new(self) -> int:
        return int((self.prev_rows < 0).sum()) - len(self.changed)

    def shared(self, previous: int) -> float:
        """The share of the last version's `previous` documents still here, unchanged."""
        return self.unchanged / previous if previous else 0.0

    def counts(self) -> dict[str, int]:
        return {"unchanged": self.unchanged, "new": self.new, "changed": len(self.changed),
                "retired": len(self.retired)}


def diff_versions(previous: pd.DataFrame, current: pd.DataFrame) -> VersionDiff:
    """Compare two versions' documents (columns id and text; ids unique in each)."""
    prev_ids = pd.Index(previous["id"].astype(object))
    rows = prev_ids.get_indexer(current["id"].astype(object))  # (n,) -1 for an unknown id
    known = rows >= 0
    same = np.zeros(len(current), dtype=bool)
    same[known] = (previous["text"].to_numpy(object)[rows[known]]
                   == current["text"].to_numpy(object)[known])
    changed = current["id"].to_numpy(object)[known & ~same].tolist()
    present = np.zeros(len(previous), dtype=bool)
    present[rows[known]] = True
    retired = previous["id"].to_numpy(object)[~present].tolist()
    return VersionDiff(np.where(same, rows, -1).astype(np.int64), [str(i) for i in changed],
                       [str(i) for i in retired])
