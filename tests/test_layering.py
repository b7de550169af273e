"""The tree reads as the pipeline: imports only point down it.

selfsup_model's subpackages follow the pipeline (corpus -> text -> nn -> pretraining -> transfer
-> serving), with the shared modules and report/ low; a module may import its own folder and
the folders before it, never one later. The library imports no orchestration, tasks never import
flows, and no stage's task imports another stage's. Every import counts, also those inside
functions and module names given to importlib as strings.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tasks.registry import PIPELINE

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. "" is the shared top level: config, presets, artifacts, errors.
LIBRARY_ORDER = ("", "report", "corpus", "text", "nn", "pretraining", "transfer", "serving")
ORCHESTRATION = ("prefect", "mlflow", "flows", "tasks")
STAGE_MODULES = frozenset(f"tasks.{spec.name}" for spec in PIPELINE)
_MODULE_STRING = re.compile(r"(selfsup_model|tasks|flows)(\.\w+)+")


def imported_modules(source: str, module: str) -> set[str]:
    """Every module `source` (the text of `module`) imports, at any depth, plus dotted module
    names in string constants (what importlib is handed)."""
    package = module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            # The name imported: `from pkg import mod` imports pkg.mod, a class stays in its module.
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and _MODULE_STRING.fullmatch(node.value)):
            found.add(node.value)
    return found


def library_phase(module: str) -> int | None:
    """Where a selfsup_model module sits in LIBRARY_ORDER (None: not a library module)."""
    parts = module.split(".")
    if parts[0] != "selfsup_model":
        return None
    folder = parts[1] if len(parts) > 1 and parts[1] in LIBRARY_ORDER else ""
    return LIBRARY_ORDER.index(folder)


def violations(module: str, source: str) -> list[str]:
    """What in `module` breaks the layering, one line each."""
    bad = []
    top = module.split(".")[0]
    for target in sorted(imported_modules(source, module)):
        head = target.split(".")[0]
        if top == "selfsup_model":
            if head in ORCHESTRATION:
                bad.append(f"{module} imports {target}: the library never imports orchestration")
            elif head == "selfsup_model" and library_phase(target) > library_phase(module):
                bad.append(f"{module} imports {target}: it comes later in the pipeline")
        elif top == "tasks":
            if head == "flows":
                bad.append(f"{module} imports {target}: tasks never import flows")
            stage = ".".join(target.split(".")[:2])
            if module in STAGE_MODULES and stage in STAGE_MODULES and stage != module:
                bad.append(f"{module} imports {target}: one stage's task imports another's")
    return bad


def project_modules() -> list[tuple[str, Path]]:
    paths = [p for folder in ("selfsup_model", "tasks", "flows")
             for p in sorted((ROOT / folder).rglob("*.py"))]
    return [(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"), p)
            for p in paths]


def test_imports_only_point_down_the_pipeline():
    modules = project_modules()
    assert len(modules) > 50  # the walk found the tree
    found = [line for module, path in modules for line in violations(module, path.read_text())]
    assert found == []


def test_every_library_module_sits_in_a_known_folder():
    folders = {p.parent.name for p in (ROOT / "selfsup_model").rglob("*.py")}
    assert folders == {"selfsup_model", *LIBRARY_ORDER[1:]}


# The checker itself must catch what it is for: hand-written breaches, one per rule.
@pytest.mark.parametrize(("module", "source", "expected"), [
    ("selfsup_model.nn.model", "from selfsup_model.transfer.classify import MaskedMeanPooling",
     "comes later in the pipeline"),
    ("selfsup_model.nn.saving", "NAMES = ('selfsup_model.transfer.classify',)",
     "comes later in the pipeline"),
    ("selfsup_model.corpus.dedup", "def f():\n    from selfsup_model.text import masking",
     "comes later in the pipeline"),
    ("selfsup_model.config", "from selfsup_model.report.metrics import macro_f1",
     "comes later in the pipeline"),
    ("selfsup_model.text.windows", "from ..pretraining import loop", "comes later"),
    ("selfsup_model.report.plots", "import mlflow", "never imports orchestration"),
    ("tasks.compare", "from tasks.baseline import SENTENCE_METHOD", "another's"),
    ("tasks.split", "from flows.settings import resolve_settings", "never import flows"),
])
def test_the_checker_catches_each_kind_of_breach(module, source, expected):
    found = violations(module, source)
    assert len(found) == 1 and expected in found[0], found


@pytest.mark.parametrize(("module", "source"), [
    ("selfsup_model.transfer.classify", "from selfsup_model.nn.pooling import MaskedMeanPooling"),
    ("selfsup_model.serving.inference", "from selfsup_model.corpus import ingest"),
    ("selfsup_model.nn.layers", "from selfsup_model.errors import UserError"),
    ("tasks.compare", "from tasks.stage import RunContext\nfrom tasks.joined import invite"),
])
def test_the_checker_allows_imports_down_the_pipeline(module, source):
    assert violations(module, source) == []
