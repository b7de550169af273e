"""The stages in pipeline order: one source of truth for names, specs and tasks."""

from __future__ import annotations

from tasks import ingest

# (spec, task) in the order the pipeline runs them; later stages append here.
PIPELINE = [
    (ingest.SPEC, ingest.ingest_task),
]
STAGE_NAMES: tuple[str, ...] = tuple(spec.name for spec, _ in PIPELINE)
SPECS = {spec.name: spec for spec, _ in PIPELINE}
TASKS = {spec.name: task for spec, task in PIPELINE}
