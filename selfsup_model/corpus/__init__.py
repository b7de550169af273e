"""Corpus: ingest, near-duplicate removal and leak-safe splitting."""
