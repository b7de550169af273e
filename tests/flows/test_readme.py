"""Every command the README shows is checked: selfsup commands parse and their settings validate,
make targets exist, prefect commands exist (the integration test runs them for real)."""

from __future__ import annotations

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


def readme_commands() -> list[list[str]]:
    return readme_commands_in((ROOT / "README.md").read_text())


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


COMMANDS = readme_commands()


def test_readme_shows_the_two_commands():
    assert ["make", "demo"] in COMMANDS and ["make", "test"] in COMMANDS


@pytest.mark.parametrize("words", [c for c in COMMANDS if Path(c[0]).name == "selfsup"],
                         ids=" ".join)
def test_selfsup_commands_parse_and_validate(words, tmp_path):
    args = build_parser().parse_args(words[1:])
    if args.command in ("run", "stages"):  # every --set key exists and is valid
        resolve_settings(tmp_path, args.corpus, args.corpus_format, args.preset, None,
                         args.overrides)
    if args.command == "run":
        select_stages(args.only, args.from_stage, args.to_stage)


def test_make_targets_exist():
    targets = set(re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(), flags=re.MULTILINE))
    assert {c[1] for c in COMMANDS if c[0] == "make"} <= targets


def test_prefect_subcommands_exist():
    for words in {tuple(c[:3]) for c in COMMANDS if c[0] == "prefect"}:
        sub = [w for w in words[1:] if not w.startswith("-")][:2]
        out = subprocess.run([sys.executable, "-m", "prefect", *sub, "--help"], capture_output=True,
                             text=True, check=False, timeout=120)
        assert out.returncode == 0, (words, out.stderr[-500:])


def test_use_the_model_shows_each_way_to_use_a_run():
    section = (ROOT / "README.md").read_text().split("## Use the model", 1)[1].split("\n## ")[0]
    shown = {c[1] for c in readme_commands_in(section) if Path(c[0]).name == "selfsup"}
    assert {"predict", "fill-mask", "generate"} <= shown
    assert "models:/selfsup-classifier/" in section


def test_mlflow_subcommands_exist():
    for words in {tuple(c[:3]) for c in COMMANDS if c[0] == "mlflow"}:
        # `mlflow server --host ...`: an option is no subcommand (and would take --help as value)
        sub = [w for w in words[1:] if not w.startswith("-")][:2]
        out = subprocess.run([sys.executable, "-m", "mlflow", *sub, "--help"],
                             capture_output=True, text=True, check=False, timeout=120)
        assert out.returncode == 0, (words, out.stderr[-500:])
