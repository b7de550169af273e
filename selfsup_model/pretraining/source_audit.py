"""Continued pretraining's leak check: has the encoder we start from already read our test set?

A run that continues another run's pretraining (`pretrain.init_from`) inherits
everything that run's encoder read: its training split, and that of every run it
continued in turn (its lineage). The split stage keeps this run's val/test apart
from this run's train only; if the lineage pretrained on a near-copy of one of
this run's val/test documents, every pretrained method's score is inflated and
the comparison with the baselines is no longer fair. `source_leak_audit` runs
the split audit's own check (LSH candidates under the audit's banding, then exact
Jaccard >= `split.relatedness_threshold`) between this run's val/test documents
and the lineage's training documents, and fails or warns as
`split.audit_action` says. This run's own train documents are not checked: the
classifiers train on them anyway.

Imported by the tokenizer stage only: pandas stays off the training path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from selfsup_model.config import DedupConfig, SplitConfig
from selfsup_model.corpus.leakage import cross_split_leaks
from selfsup_model.corpus.lsh import PairJudge
from selfsup_model.corpus.minhash import Progress, minhash_signatures
from selfsup_model.corpus.splitting import documents_in_split
from selfsup_model.errors import UserError
from selfsup_model.pretraining.continued import lineage, recorded_file, recorded_manifest

_MAX_EXAMPLES = 10
# What a run's pretraining read, by stage and file: the documents and which are train.
_READ = (("ingest", "documents.parquet"), ("split", "assignments.parquet"))


@dataclasses.dataclass(frozen=True)
class SeenDocuments:
    """The training documents of a source's lineage, back to back (`run` indexes `runs`)."""

    runs: list[Path]  # nearest first: the source, the run it continued, ...
    run: np.ndarray  # (n,) int64
    ids: list[str]
    texts: list[str]
    unreadable: str | None = None  # why the lineage could not be followed further

    def __len__(self) -> int:
        return len(self.ids)


def lineage_hashes(source: Path) -> dict[str, str]:
    """{"<run>/<stage>/<file>": recorded sha256} of what each lineage run's pretraining read,
    from the manifests (cheap: nothing is hashed), so that a changed source reruns the check."""
    runs, unreadable = lineage(source)
    out = {f"{run}/{stage}/{name}": record.sha256 for run in runs for stage, name in _READ
           if (record := _recorded_output(run, stage, name)) is not None}
    if unreadable:
        out["unreadable"] = unreadable
    return out


def _recorded_output(run: Path, stage: str, name: str):
    try:
        return recorded_manifest(run, stage, "pretrain.init_from's lineage").outputs.get(name)
    except UserError:
        return None


def seen_documents(source: Path) -> SeenDocuments:
    """The training-split documents of every run in `source`'s lineage, each file read only
    while its bytes match the sha256 its run recorded."""
    runs, unreadable = lineage(source)
    frames = []
    for k, run in enumerate(runs):
        docs, assign = (recorded_file(run, stage, name, "the continued-pretraining leak check")[0]
                        for stage, name in _READ)
        train = documents_in_split(pd.read_parquet(docs, columns=["id", "text"]),
                                   pd.read_parquet(assign, columns=["id", "split"]), "train")
        frames.append(train.assign(run=k))
    # A corpus version's lineage holds its earlier versions, each with the documents before it:
    # one copy of each document is enough (the nearest run's).
    seen = pd.concat(frames, ignore_index=True).drop_duplicates(["id", "text"], keep="first")
    return SeenDocuments(runs, seen["run"].to_numpy(np.int64), seen["id"].astype(str).tolist(),
                         seen["text"].tolist(), unreadable)


def pretraining_leaks(
    texts: Sequence[str],
    seen_texts: Sequence[str],
    cfg: SplitConfig,
    dedup_cfg: DedupConfig,
    progress: Progress | None = None,
) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """(text index, seen index) pairs at exact Jaccard >= cfg.relatedness_threshold, (k, 2),
    their Jaccard (k,), and the judge's counts: the split audit's check between two sets.

    Signatures are computed here with the dedup settings, over both sets at once, so that a
    source run's other dedup settings cannot make the two sides incomparable."""
    both = [*texts, *seen_texts]
    signatures = minhash_signatures(both, num_perm=dedup_cfg.num_perm, seed=dedup_cfg.seed,
                                    kind=dedup_cfg.shingle, size=dedup_cfg.shingle_size,
                                    batch_size=dedup_cfg.batch_size)
    judge = PairJudge(both, signatures, cfg.relatedness_threshold, dedup_cfg.shingle,
                      dedup_cfg.shingle_size)
    is_seen = np.arange(len(both)) >= len(texts)
    leaks, jaccard, counts = cross_split_leaks(is_seen, judge, progress)
    return leaks - np.array([0, len(texts)]), jaccard, counts


def source_leak_audit(
    ids: Sequence[str],
    texts: Sequence[str],
    splits: Sequence[str],
    seen: SeenDocuments,
    cfg: SplitConfig,
    dedup_cfg: DedupConfig,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """This run's val/test documents against what the source lineage pretrained on.

    With audit_action 'fail' a leak - or a lineage that could not be followed to its end -
    raises UserError; with 'warn' the audit's `message` says what was found."""
    split = np.asarray(list(splits), dtype=object)
    held_out = np.flatnonzero(split != "train")
    pairs, jaccard, counts = pretraining_leaks([texts[i] for i in held_out], seen.texts, cfg,
                                               dedup_cfg, progress)
    worst = np.lexsort((pairs[:, 1], pairs[:, 0], -jaccard))[:_MAX_EXAMPLES]
    examples = [{"id": str(ids[held_out[q]]), "split": str(split[held_out[q]]),
                 "source_run": str(seen.runs[seen.run[s]]), "source_id": seen.ids[s],
                 "jaccard": round(float(j), 6)}
                for (q, s), j in zip(pairs[worst], jaccard[worst], strict=True)]
    leaking = len(np.unique(pairs[:, 0]))
    audit = {
        "threshold": cfg.relatedness_threshold,
        "lineage": [str(run) for run in seen.runs],
        "documents_checked": len(held_out),
        "source_train_documents": len(seen),
        **counts,
        "related_pairs": len(pairs),
        "leaking_documents": leaking,
        "examples": examples,
        "unreadable": seen.unreadable,
    }
    problems = []
    if leaking:
        shown = ", ".join(f"{e['id']} ({e['split']}) ~ {e['source_id']} of {e['source_run']} "
                          f"(J={e['jaccard']:.2f})" for e in examples[:3])
        problems.append(f"{leaking} val/test document(s) are near-copies (Jaccard >= "
                        f"{cfg.relatedness_threshold:g}) of documents the encoder this run "
                        f"continues was pretrained on, e.g. {shown}")
    if seen.unreadable:
        problems.append(f"the lineage could not be followed to its end: {seen.unreadable}")
    audit["passed"] = not problems
    audit["message"] = ("continued-pretraining leak check failed: " + "; ".join(problems)
                        if problems else None)
    if problems and cfg.audit_action == "fail":
        raise UserError(audit["message"] + "; split the corpus so that these documents are "
                        "in train, or set split.audit_action=warn to continue anyway")
    return audit
