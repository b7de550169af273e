"""Stage tasks: the stage table (registry), the runner (stage) and one thin module per stage.

A stage module only reads its inputs, calls `selfsup_model`, writes its artifacts
and returns a `StageOutput`; skipping, hashing, manifests and tracking are the
runner's job.
"""
