"""Work that several training processes do together (Keras' ``KERAS_DISTRIBUTION_*`` launch
variables under JAX): pretraining and the neural methods of finetune and baseline.

Process 0 is the run: it takes the workdir lock, runs every stage and writes every file. At
the start of a stage's shared work it invites the other processes (`invite`), which then do
the same work on the same inputs, each feeding its share of every batch and writing nothing
(`serve`); at the end of the run it releases them (`release`). Everything else (ingest to
masks, the probe, TF-IDF, compare) process 0 does alone while the others wait.
"""

from __future__ import annotations

import importlib
import logging

from selfsup_model.pretraining.devices import broadcast_int, process_count, process_index
from tasks.stage import RunContext

log = logging.getLogger("selfsup.joined")

STAGES = ("pretrain", "finetune", "baseline")  # each has `follow(ctx)`
_OVER = 0


def invite(stage: str) -> None:
    """Process 0, about to start `stage`'s shared work: the other processes join in."""
    if process_count() > 1:
        broadcast_int(STAGES.index(stage) + 1)


def release() -> None:
    """Process 0, at the end of the run: the other processes may exit."""
    if process_count() > 1:
        broadcast_int(_OVER)


def serve(ctx: RunContext) -> list[str]:
    """Process k > 0: join each piece of shared work process 0 invites to, until the run ends;
    returns the stages joined, in order."""
    joined = []
    log.info("process %d: waiting for process 0's shared work", process_index())
    while (code := broadcast_int(_OVER)) != _OVER:
        stage = STAGES[code - 1]
        log.info("process %d: joining process 0 in %s", process_index(), stage)
        importlib.import_module(f"tasks.{stage}").follow(ctx)
        joined.append(stage)
    return joined
