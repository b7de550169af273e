"""What a workdir was made with: corpus, preset and the resolved config, stored beside its stages.

`selfsup run` writes `<workdir>/run_settings.json` (atomically) at the start of
every run. A later `selfsup run`, `stages` or `report` on that workdir starts
from it, so a plain rerun neither resets the size preset nor reports every
stage stale; a preset, YAML file or `--set` given on the command line applies
on top, and the run says which settings changed and which stages will rerun.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from selfsup_model.artifacts import atomic_write_json
from selfsup_model.config import CorpusFormat, PipelineConfig
from selfsup_model.errors import ArtifactError
from selfsup_model.presets import build_config, deep_merge, parse_override, validate_config

SETTINGS_NAME = "run_settings.json"
DEFAULTS = {"corpus": "pydocs", "corpus_format": "auto", "preset": "demo"}


@dataclasses.dataclass(frozen=True)
class RunSettings:
    corpus: str
    corpus_format: CorpusFormat
    preset: str  # the size preset the config started from ("custom" for a given config object)
    config: PipelineConfig

    def to_dict(self) -> dict[str, Any]:
        return {"corpus": self.corpus, "corpus_format": self.corpus_format, "preset": self.preset,
                "config": self.config.model_dump(mode="json")}


def read_settings(workdir: str | Path) -> RunSettings | None:
    """The settings of the workdir's last run, or None for a new workdir."""
    path = Path(workdir) / SETTINGS_NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text("utf-8"))
        return RunSettings(data["corpus"], data["corpus_format"], data["preset"],
                           validate_config(data["config"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ArtifactError(f"{path} is unreadable ({exc}); "
                            "delete it to start from the defaults") from None


def write_settings(workdir: str | Path, settings: RunSettings) -> Path:
    return atomic_write_json(Path(workdir) / SETTINGS_NAME, settings.to_dict())


def resolve_settings(workdir: str | Path, corpus: str | None = None,
                     corpus_format: CorpusFormat | None = None,
                     preset: str | None = None, config_file: str | None = None,
                     overrides: list[str] | tuple[str, ...] = ()) -> RunSettings:
    """Command-line choices over the workdir's stored settings over the defaults.

    A preset or config file given now rebuilds the config from scratch; without
    either, `overrides` apply to the stored config (or the default preset's).
    """
    stored = read_settings(workdir)
    if stored is not None and preset is None and config_file is None:
        data = stored.config.model_dump(mode="json")
        for item in overrides:
            data = deep_merge(data, parse_override(item))
        config = validate_config(data)
    else:
        config = build_config(preset or DEFAULTS["preset"], config_file, overrides)
    base = stored.to_dict() if stored is not None else DEFAULTS
    return RunSettings(corpus=corpus or base["corpus"],
                       corpus_format=corpus_format or base["corpus_format"],
                       preset=preset or base["preset"], config=config)


def changed_keys(before: RunSettings, after: RunSettings) -> list[str]:
    """Dotted names of the settings that differ (corpus and format included)."""
    def flat(prefix: str, value: Any) -> dict[str, Any]:
        if isinstance(value, dict):
            return {k: v for key, sub in value.items()
                    for k, v in flat(f"{prefix}{key}.", sub).items()}
        return {prefix[:-1]: value}

    a, b = flat("", before.to_dict()), flat("", after.to_dict())
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k) and k != "preset")
