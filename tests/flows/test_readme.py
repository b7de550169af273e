"""Every command the README and the docs/ pages show is checked: selfsup commands parse and their
settings validate, make targets exist, prefect and mlflow commands exist (the integration tests
run them for real). Every relative link resolves, and the README stays a front page that links
every docs page."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from flows.cli import build_parser
from flows.settings import resolve_settings
from tasks.registry import select_stages

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
README_MAX_LINES = 250


def readme_commands() -> list[list[str]]:
    return readme_commands_in(README.read_text())


def readme_commands_in(text: str) -> list[list[str]]:
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)
    commands = []
    for line in "\n".join(blocks).splitlines():
        line = line.split(" #")[0].strip()
        if not line or line.startswith("export "):
            continue
        words = shlex.split(line)
        while "=" in words[0]:  # leading VAR=value assignments
            words = words[1:]
        commands.append(words)
    return commands


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


# (page, command) for every command in a ```bash block of the README or a docs page
PAGE_COMMANDS = [(_name(page), words) for page in PAGES
                 for words in readme_commands_in(page.read_text())]
COMMANDS = [words for _, words in PAGE_COMMANDS]


def test_docs_pages_exist_and_show_commands():
    assert DOCS, "docs/*.md: the README's details live there"
    assert any(page != "README.md" for page, _ in PAGE_COMMANDS)


def test_readme_shows_the_two_commands():
    assert ["make", "demo"] in readme_commands() and ["make", "test"] in readme_commands()


@pytest.mark.parametrize("page,words", [(p, c) for p, c in PAGE_COMMANDS
                                        if Path(c[0]).name == "selfsup"],
                         ids=[f"{p}: {' '.join(c)}" for p, c in PAGE_COMMANDS
                              if Path(c[0]).name == "selfsup"])
def test_selfsup_commands_parse_and_validate(page, words, tmp_path):
    args = build_parser().parse_args(words[1:])
    if args.command in ("run", "stages"):  # every --set key exists and is valid
        resolve_settings(tmp_path, args.corpus, args.corpus_format, args.preset, None,
                         args.overrides)
    if args.command == "run":
        select_stages(args.only, args.from_stage, args.to_stage)


def test_make_targets_exist():
    targets = set(re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(), flags=re.MULTILINE))
    assert {c[1] for c in COMMANDS if c[0] == "make"} <= targets


# One interpreter answers every `python -m <tool> <subcommand> --help` in turn (the module's
# __main__ run again each time): the same entry point as a shell, without a start-up per command.
_HELP_CHILD = """
import json, runpy, sys
module, subs = sys.argv[1], json.loads(sys.argv[2])
codes = []
for sub in subs:
    sys.argv = [module, *sub, "--help"]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        codes.append(0)
    except SystemExit as exc:
        codes.append(exc.code or 0)
print("CODES", json.dumps(codes))
"""


def _help_codes(module: str) -> dict[tuple[str, ...], int]:
    # `mlflow server --host ...`: an option is no subcommand (and would take --help as value)
    subs = sorted({tuple(w for w in c[1:3] if not w.startswith("-"))
                   for c in COMMANDS if c[0] == module})
    out = subprocess.run([sys.executable, "-c", _HELP_CHILD, module, json.dumps(subs)],
                         capture_output=True, text=True, check=False, timeout=180)
    assert "CODES " in out.stdout, out.stderr[-2000:]
    return dict(zip(subs, json.loads(out.stdout.rsplit("CODES ", 1)[1]), strict=True))


def test_prefect_subcommands_exist():
    codes = _help_codes("prefect")
    assert codes and all(code == 0 for code in codes.values()), codes


def test_use_the_model_shows_each_way_to_use_a_run():
    section = README.read_text().split("## Use the model", 1)[1].split("\n## ")[0]
    shown = {c[1] for c in readme_commands_in(section) if Path(c[0]).name == "selfsup"}
    assert {"predict", "fill-mask", "generate"} <= shown
    assert "models:/selfsup-classifier/" in section


def test_mlflow_subcommands_exist():
    codes = _help_codes("mlflow")
    assert codes and all(code == 0 for code in codes.values()), codes


def _prose(text: str) -> str:
    """The text less fenced blocks and inline code, where a [x](y) is no link."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    return re.sub(r"`[^`\n]*`", "", text)


def relative_links(text: str) -> list[str]:
    """Targets of the Markdown links and images in `text` that are not URLs."""
    targets = re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", _prose(text))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t, flags=re.IGNORECASE)]


def anchors(text: str) -> set[str]:
    """GitHub's anchors for the headings of a Markdown page."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", _fenced_removed(text),
                              flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _fenced_removed(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)


def test_link_helpers():
    text = ("See [a](docs/a.md#x-y), ![img](pic.png) and [web](https://example.org).\n"
            "`[not](a-link.md)`\n```\n[nor](this.md)\n# Not a heading\n```\n"
            "## X: y (`z`)\n## X: y (`z`)\n")
    assert relative_links(text) == ["docs/a.md#x-y", "pic.png"]
    assert anchors(text) == {"x-y-z", "x-y-z-1"}


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_point_to_existing_files(page):
    broken = []
    for target in relative_links(page.read_text()):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {_name(file)}")
    assert not broken, broken


def test_readme_is_a_front_page_that_links_every_docs_page():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, "README.md: move details into docs/"
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in relative_links(text)}
    assert [_name(p) for p in DOCS if p.resolve() not in linked] == []
