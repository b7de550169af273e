"""selfsup_model: the library. No Prefect or MLflow imports anywhere in here."""

__version__ = "0.1.0"
