"""Errors a user can cause. The CLI prints these as one line and exits 2."""


class UserError(Exception):
    """Bad input or configuration: the message names the input and the fix."""


class CorpusError(UserError):
    """The corpus cannot be read or yields no usable documents."""


class ArtifactError(UserError):
    """A stored artifact is missing, tampered with or from another run."""


class DiskFullError(UserError):
    """A file could not be written for lack of space (or quota); nothing half-written stays."""
