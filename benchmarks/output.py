"""What every JSON-reporting benchmark does with its result: print it, and keep it if asked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(result: Any, out: str | None) -> None:
    """Print `result` as indented JSON; also write it to `out` when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n", encoding="utf-8")
