"""The embedded default corpus: docstrings harvested from installed libraries.

Sources are parsed with `ast`, never imported, so harvesting cannot execute
library code and does not depend on a library importing cleanly. Each
docstring (module, class, function or method) is one document:
label = library, group = source file (relative to the library root),
id = ``library:module:qualname``. Test folders are skipped: they hold fixtures,
not prose. Order is deterministic: libraries in the given order, files sorted,
docstrings in source order.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import multiprocessing
import os
import warnings
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from selfsup_model.errors import CorpusError

if TYPE_CHECKING:
    import pandas as pd

_SKIP_DIRS = {"tests", "test", "testing", "__pycache__", "_vendor_tests", "benchmarks"}
_DEF_NODES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def library_root(name: str) -> Path:
    """Source folder (or single file) of an installed library, located without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin in (None, "built-in", "frozen"):
        raise CorpusError(
            f"pydocs library {name!r} is not installed as Python source; "
            "remove it from ingest.pydocs_libraries or install it"
        )
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin)


def library_files(name: str) -> list[tuple[str, str]]:
    """(relative path, absolute path) of every .py file of a library, sorted."""
    root = library_root(name)
    if root.is_file():
        return [(root.name, str(root))]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for fn in sorted(filenames):
            if fn.endswith(".py") and not fn.startswith("test_"):
                full = Path(dirpath) / fn
                out.append((f"{name}/{full.relative_to(root).as_posix()}", str(full)))
    out.sort()
    return out


def _module_name(rel_path: str) -> str:
    mod = rel_path[:-3].replace("/", ".")
    return mod.removesuffix(".__init__")


def docstrings_of_file(label: str, rel_path: str, abs_path: str) -> list[tuple[str, str, str, str]]:
    """(id, text, label, group) for each docstring in one source file; [] if unparsable."""
    try:
        source = Path(abs_path).read_bytes()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in old sources
            tree = ast.parse(source, filename=abs_path)
    except (OSError, SyntaxError, ValueError):
        return []
    module = _module_name(rel_path)
    rows = []
    doc = ast.get_docstring(tree, clean=True)
    if doc:
        rows.append((f"{label}:{module}:<module>", doc, label, rel_path))
    stack: list[tuple[ast.AST, str]] = [(tree, "")]
    while stack:
        node, prefix = stack.pop()
        children = [c for c in ast.iter_child_nodes(node) if isinstance(c, _DEF_NODES)]
        # An explicit stack instead of recursion: generated sources nest deeply.
        for child in reversed(children):
            qual = f"{prefix}{child.name}"
            stack.append((child, qual + "."))
        for child in children:
            doc = ast.get_docstring(child, clean=True)
            if doc:
                rows.append((f"{label}:{module}:{prefix}{child.name}", doc, label, rel_path))
    return rows


def _harvest_file(args: tuple[str, str, str]) -> list[tuple[str, str, str, str]]:
    return docstrings_of_file(*args)


def _keep_sample(rows: list[tuple[str, str, str, str]],
                 limit: int | None) -> list[tuple[str, str, str, str]]:
    """At most `limit` rows, spread over the whole library (hash of id), original order kept."""
    if limit is None or len(rows) <= limit:
        return rows
    ranked = sorted(range(len(rows)), key=lambda i: hashlib.sha1(rows[i][0].encode()).digest())
    keep = set(ranked[:limit])
    return [r for i, r in enumerate(rows) if i in keep]


def harvest(
    libraries: Sequence[str], workers: int = 2, max_per_library: int | None = None
) -> pd.DataFrame:
    """Docstrings of `libraries` as a DataFrame with columns id, text, label, group.

    Workers come from a fork server, never a fork of the caller: by ingest the pipeline process
    holds MLflow's database connections (SQLite or PostgreSQL) and Prefect's and TensorFlow's
    threads, none of which a forked child may inherit safely. As with any non-fork start method,
    a script that calls this at import time needs the `if __name__ == "__main__":` guard.
    """
    import pandas as pd  # here, not at the top: workers import this module and need only `ast`

    jobs = [(lib, rel, full) for lib in libraries for rel, full in library_files(lib)]
    if workers > 1 and len(jobs) > 50:
        with ProcessPoolExecutor(max_workers=workers,
                                 mp_context=multiprocessing.get_context("forkserver")) as pool:
            per_file = list(pool.map(_harvest_file, jobs, chunksize=32))
    else:
        per_file = [_harvest_file(j) for j in jobs]
    rows: list[tuple[str, str, str, str]] = []
    for lib in libraries:
        lib_rows = [r for (jl, _, _), file_rows in zip(jobs, per_file) if jl == lib
                    for r in file_rows]
        rows.extend(_keep_sample(lib_rows, max_per_library))
    return pd.DataFrame(rows, columns=["id", "text", "label", "group"])


def library_versions(libraries: Sequence[str]) -> dict[str, str]:
    """Installed version per library (for the ingest fingerprint), read from metadata only."""
    import sys
    from importlib import metadata

    dist_names = {"sklearn": "scikit-learn"}
    out = {}
    for lib in libraries:
        try:
            out[lib] = metadata.version(dist_names.get(lib, lib))
        except metadata.PackageNotFoundError:
            out[lib] = (f"python-{sys.version_info.major}.{sys.version_info.minor}"
                        if lib in sys.stdlib_module_names else "unknown")
    return out
