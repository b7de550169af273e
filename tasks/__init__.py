"""Prefect tasks: one per stage. Thin: resolve paths, call selfsup_model, write artifacts."""
