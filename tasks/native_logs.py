"""TensorFlow's native start-up lines, held back while it loads.

Imported, TensorFlow writes C++ log lines (absl's notice, CPU features, oneDNN, and on GPU hosts
plugin registrations) straight to file descriptor 2, past Python's logging and its levels.
`native_startup_logs_held` points descriptor 2 at a temporary file meanwhile, then writes back
what was held but for those lines, so nothing else written meanwhile (another thread's log
line, a Python warning) is lost; if the import fails, everything comes back, since the lines
may say why. SELFSUP_TF_LOGS=1 lets everything through as it comes.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from types import ModuleType

# absl's format (I0000 00:00:1796582739.060280   23991 cpu_feature_guard.cc:227] ...), the
# older dated one (2024-01-01 12:00:00.000000: I tensorflow/core/util/port.cc:113] ...), absl's
# notice before its logging starts, and the CPU-feature line's second line.
_NATIVE_LINE = re.compile(
    r"^([IWEF]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ \S+:\d+\]"
    r"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] \S+:\d+\]"
    r"|WARNING: All log messages before absl::InitializeLog\(\) is called"
    r"|To enable the following instructions: .* rebuild TensorFlow)")


def native_line(line: str) -> bool:
    """Whether a line is one of TensorFlow's native log lines."""
    return _NATIVE_LINE.match(line) is not None


@contextlib.contextmanager
def native_startup_logs_held() -> Iterator[None]:
    """Hold what reaches file descriptor 2 during the block; write it back when the block ends,
    but for TensorFlow's native lines unless the block failed."""
    if os.environ.get("SELFSUP_TF_LOGS") == "1":
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        failed = True
        try:
            yield
            failed = False
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().decode("utf-8", "replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines
                                     if failed or not native_line(line)))
            sys.stderr.flush()


def import_quietly(module: str) -> ModuleType:
    """`importlib.import_module`, with TensorFlow's start-up lines held back if Keras is not
    loaded yet (the module may load it)."""
    if "keras" in sys.modules:
        return importlib.import_module(module)
    with native_startup_logs_held():
        return importlib.import_module(module)
