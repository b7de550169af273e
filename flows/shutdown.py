"""Stopping a run: SIGTERM (a Prefect cancellation, `timeout`, systemd, Kubernetes) and SIGINT
end it at a safe point and leave nothing behind.

Inside a flow run, Prefect's engine turns SIGTERM into `TerminationSignal`, raised where the run
is: the stage in flight unwinds (its manifest is written last, so its partial outputs are never
trusted), the MLflow runs end as KILLED (`tasks.stopping.stopped`), the Dask cluster closes and the
workdir lock is released as their context managers exit. The engine then delivers the signal
again to the handler installed before the flow began. Left at Python's default, that kills the
process outright, skipping the interpreter's exit handlers, and the temporary Prefect server a
`selfsup run` started (stopped by one of them) outlives the run. `stop_signals` installs handlers
that end the process through a normal exit instead, with 128 + the signal number as its status;
a second signal while stopping ends it at once, its child processes with it (`tasks.stopping`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from tasks.stopping import STOP_SIGNALS, is_stopping, stop_now, stopping


class RunStopped(SystemExit):
    """The process was asked to stop; its exit status is 128 + the signal number."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


@contextlib.contextmanager
def stop_signals(doing: str = "stopping at a safe point") -> Iterator[None]:
    """SIGTERM and SIGINT raise RunStopped (the first time: also when Prefect's engine delivers
    a SIGTERM again after its flow run unwound; a second signal while stopping ends the process
    and its children at once, `tasks.stopping.stop_now`). `doing` is what the first signal's
    warning says happens next (`tasks.stopping.stopping`)."""
    received: list[int] = []

    def handler(signum: int, frame) -> None:
        if received:  # already stopping
            stop_now(signum)
        received.append(signum)
        stopping(signum, doing)  # from here the next signal stops at once
        raise RunStopped(signum)

    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only: nothing to install here
        return
    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        if not is_stopping():  # a stopping run keeps stopping at once until it is gone: its
            for s, before in previous.items():  # exit handlers stop a temporary server
                signal.signal(s, before)
