"""Orchestration: Prefect flows, MLflow parent runs and the `selfsup` CLI."""

import os

# Library loggers ("selfsup.*") show up in Prefect's run logs too.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "selfsup")
