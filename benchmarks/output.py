"""What every JSON-reporting benchmark does with its result: print it, and keep it if asked."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


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
    emit(run(args), args.out)
