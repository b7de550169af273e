"""Orchestration: Prefect flows, MLflow parent runs and the `selfsup` CLI."""

import os

# Library loggers ("selfsup.*") show up in Prefect's run logs too.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "selfsup")
# No phoning home: CI and many users' machines have no internet.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_ENABLE_TELEMETRY", "false")
