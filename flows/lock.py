"""One run per workdir at a time: an exclusive, non-blocking file lock."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from selfsup_model.errors import UserError

LOCK_NAME = ".selfsup.lock"


@contextlib.contextmanager
def workdir_lock(workdir: Path) -> Iterator[None]:
    """Hold the workdir's lock for the duration; refuse at once if another run holds it."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise UserError(
                f"workdir {workdir} is in use by another selfsup run (pid {holder}); "
                "wait for it to finish or choose another --workdir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the flock
