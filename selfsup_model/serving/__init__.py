"""Serving a trained run: prediction, scoring and generation on new text."""
