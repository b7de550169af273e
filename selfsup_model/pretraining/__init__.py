"""Pretraining: batches, the training loop, validation, continued pretraining, devices."""
