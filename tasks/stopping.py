"""A run being stopped: telling a stop from a failure, and the second signal that stops at once.

The first SIGTERM or SIGINT stops a run at a safe point (`flows.shutdown`): inside a flow run,
Prefect's engine raises `TerminationSignal` where the run is, the stage in flight and the
pipeline unwind (MLflow runs end as KILLED, the workdir lock and the Dask cluster are released),
and the process exits normally. That takes a few seconds. An operator who does not want to wait
sends a second signal: from the moment the run knows it is stopping (`stopping`), a second
SIGTERM or SIGINT kills every process the run started and ends the run at once (`stop_now`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("selfsup")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _State:
    stopping = False  # the run knows it is stopping: the next signal stops at once
    signalled: int | None = None  # a stop signal that reached the run (`stop_signals_noted`)
    wakeup: int | None = None  # where the interpreter writes each signal's number as it arrives


_state = _State()


def _is_stop(exc: BaseException) -> bool:
    from prefect.exceptions import TerminationSignal

    return isinstance(exc, (KeyboardInterrupt, TerminationSignal)) or (
        isinstance(exc, SystemExit) and getattr(exc, "signum", None) is not None)


def stopped(exc: BaseException) -> bool:
    """Whether `exc` is a run being stopped (SIGTERM or SIGINT: Prefect's TerminationSignal, a
    KeyboardInterrupt, `flows.shutdown.RunStopped`, or any error raised once a stop signal
    reached the run, `stop_signals_noted`) rather than failing."""
    return _is_stop(exc) or _noted() is not None


def stop_behind(exc: BaseException) -> BaseException | None:
    """The stop that `exc` stands for, when a noted stop signal came out as another error: a
    TerminationSignal to raise from it (Prefect's engine then ends the flow run as stopped and
    delivers the signal again); None when `exc` is a stop itself or no signal was noted."""
    from prefect.exceptions import TerminationSignal

    if _is_stop(exc) or (signum := _noted()) is None:
        return None
    return TerminationSignal(signum)


@contextlib.contextmanager
def stop_signals_noted() -> Iterator[None]:
    """Note every SIGTERM or SIGINT that reaches the block, whatever its handler does.

    Prefect's engine raises a stop where the run is. Raised inside a C extension's call back
    into Python, it can come out as that library's own error: TensorFlow, checking a dataset's
    structure as `fit` starts, reported one as "The two structures don't have the same nested
    structure" (a ValueError), and the stopped run failed with status 1. Once a signal is
    noted, whatever unwinds the run is its stop (`stopped`, `stop_behind`).

    The signals are noted through the interpreter's wakeup fd (each signal's number is
    written to a pipe as it arrives), not by a handler of ours: Prefect checks that its own
    SIGTERM handler is in place before it accepts a cancellation from its runner. Where
    another wakeup fd is set already, that one is left alone and nothing is noted."""
    _state.signalled = None
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    os.set_blocking(write_end, False)
    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    if previous != -1:  # someone else's
        signal.set_wakeup_fd(previous)
    else:
        _state.wakeup = read_end
    try:
        yield
    finally:
        if previous == -1:
            _noted()
            _state.wakeup = None
            if (current := signal.set_wakeup_fd(-1)) != write_end:  # replaced meanwhile:
                signal.set_wakeup_fd(current)  # that one stays
        os.close(read_end)
        os.close(write_end)


def _noted() -> int | None:
    """The first stop signal noted by `stop_signals_noted` (None if none has arrived)."""
    if _state.signalled is None and _state.wakeup is not None:
        with contextlib.suppress(BlockingIOError):
            arrived = os.read(_state.wakeup, 512)
            _state.signalled = next((s for s in arrived if s in STOP_SIGNALS), None)
    return _state.signalled


def is_stopping() -> bool:
    return _state.stopping


def stopping(cause: BaseException | int | None = None,
             doing: str = "stopping at a safe point") -> None:
    """The run is stopping (`cause`: the signal, or the exception it raised): from now on a
    SIGTERM or SIGINT stops it at once. Idempotent. `doing` is what the warning says the
    process does now: a pipeline run stops at a safe point; another command just stops.

    Prefect's engine restores the SIGTERM handler it replaced before it delivers the signal
    again (`flows.shutdown.stop_signals`' handler, which knows this is the first signal);
    until then, and for SIGINT, the at-once handler is installed here."""
    if _state.stopping:
        return
    _state.stopping = True
    signum = cause if isinstance(cause, int) else (
        signal.SIGINT if isinstance(cause, KeyboardInterrupt)
        else getattr(cause, "signal", None) or getattr(cause, "signum", None)
        or _noted())
    what = signal.Signals(signum).name if signum else "a stop signal"
    log.warning("selfsup: %s: %s (send another to stop at once)", what, doing)
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, _at_once)


def _at_once(signum: int, frame) -> None:
    stop_now(signum)


def descendants(pid: int) -> list[int]:
    """Every living descendant of process `pid`, children first (Linux: /proc's children
    lists; elsewhere none are found)."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop(0)
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                for child in children.read_text().split():
                    found.append(int(child))
                    queue.append(int(child))
    return found


def stop_now(signum: int) -> None:
    """End this process at once, as `signum`'s default action does, after SIGKILLing every
    process it started (a temporary Prefect server, Dask workers, training processes): a
    second signal must not leave them behind."""
    for child in descendants(os.getpid()):
        with contextlib.suppress(OSError):
            os.kill(child, signal.SIGKILL)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


@contextlib.contextmanager
def stops_deferred() -> Iterator[None]:
    """Hold a first SIGTERM or SIGINT until the block ends, then deliver it to the handler that
    was in place; a second one meanwhile stops at once.

    For loading TensorFlow: a stop raised in the middle of its import (Prefect's engine raises
    where the run is) leaves it half-initialised, and a process that then touches it can hang
    instead of stopping. Loading takes seconds, so the stop is late by at most that."""
    if threading.current_thread() is not threading.main_thread() or _state.stopping:
        yield  # handlers are the main thread's; a stopping run stops at once anyway
        return
    held: list[int] = []

    def hold(signum: int, frame) -> None:
        if held:
            stop_now(signum)
        held.append(signum)
        log.warning("selfsup: %s: stopping as soon as the stage's code has loaded (send "
                    "another to stop at once)", signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, hold) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if held:
            signal.raise_signal(held[0])
