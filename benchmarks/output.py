"""What every JSON-reporting benchmark does with its result: print it, and keep it if asked."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flows.shutdown import stop_signals


def emit(result: Any, out: str | None) -> None:
    """Print `result` as indented JSON; also write it to `out` when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n", encoding="utf-8")


def run_cli(parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], Any]) -> None:
    """Add the options every benchmark shares (--seed, --out), parse, run and emit."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args()
    # SIGTERM or SIGINT end the benchmark through a normal exit (status 128 + the signal), so a
    # temporary Prefect server a pipeline run started stops with it.
    with stop_signals():
        result = run(args)
    emit(result, args.out)
