"""Stopping a run: SIGTERM (a Prefect cancellation, `timeout`, systemd, Kubernetes) and SIGINT
end it at a safe point and leave nothing behind.

Inside a flow run, Prefect's engine turns SIGTERM into `TerminationSignal`, raised where the run
is: the stage in flight unwinds (its manifest is written last, so its partial outputs are never
trusted), the MLflow runs end as KILLED (`tasks.stage.stopped`), the Dask cluster closes and the
workdir lock is released as their context managers exit. The engine then delivers the signal
again to the handler installed before the flow began. Left at Python's default, that kills the
process outright, skipping the interpreter's exit handlers, and the temporary Prefect server a
`selfsup run` started (stopped by one of them) outlives the run. `stop_signals` installs handlers
that end the process through a normal exit instead, with 128 + the signal number as its status;
a second signal while stopping ends it at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator

log = logging.getLogger("selfsup")
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class RunStopped(SystemExit):
    """The process was asked to stop; its exit status is 128 + the signal number."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """SIGTERM and SIGINT raise RunStopped (the first time; a second signal while stopping
    ends the process at once, as the default would)."""
    received: list[int] = []

    def handler(signum: int, frame) -> None:
        if received:  # already stopping: the default, at once
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        received.append(signum)
        log.warning("selfsup: %s received: stopping (a second one stops at once)",
                    signal.Signals(signum).name)
        raise RunStopped(signum)

    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only: nothing to install here
        return
    previous = {s: signal.signal(s, handler) for s in _SIGNALS}
    try:
        yield
    finally:
        for s, before in previous.items():
            signal.signal(s, before)
