"""Presets, YAML config files and `--set KEY=VALUE` overrides -> one validated `PipelineConfig`.

Order of precedence: the preset, then the YAML file, then each `--set` in the
order given. Every failure is one `UserError` line naming the key and the fix.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from selfsup_model.config import PipelineConfig
from selfsup_model.errors import UserError

PRESETS: dict[str, dict[str, Any]] = {
    # Seconds per stage on 2 cores: for tests and CI.
    "tiny": {
        "ingest": {"min_chars": 20, "pydocs_libraries": ["email", "xml", "unittest"],
                   "pydocs_max_per_library": 100},
        "dedup": {"num_perm": 64},
        "tokenizer": {"vocab_size": 300, "min_frequency": 1},
        "encode": {"max_len": 32, "overlap": 8, "max_windows_per_doc": 2},
        "masks": {"max_predictions": 6},
        "model": {"hidden": 16, "layers": 1, "heads": 2, "ff": 32, "dropout": 0.0},
        "pretrain": {"batch_size": 8, "steps": 12, "warmup_steps": 2, "log_every": 4,
                      "eval_every": 6, "checkpoint_every": 6},
        "finetune": {"fractions": [0.5, 1.0], "epochs": 2, "batch_size": 16, "min_updates": 4,
                     "max_updates": 12, "evals": 2, "patience": 1, "learning_rates": [1e-3],
                     "probe_c": [1.0], "eval_batch_size": 64},
        "baseline": {"tfidf_c": [1.0], "tfidf_ngram_max": [1], "bag_dim": 16, "sentence_c": [1.0]},
        "compare": {"bootstrap": 50},
    },
    # The default: the whole pipeline on the embedded corpus in about 9-25 minutes on 2 CPU
    # cores, depending on the host (docs/performance.md), a third to a half of it pretraining.
    "demo": {
        "ingest": {"pydocs_max_per_library": 1500},
        "tokenizer": {"vocab_size": 4096},
        # Windows of the length the classifier reads (benchmarks/pretrain_recipe.py measured 64
        # beating 128 on 64-token validation masks at equal time), covering the same text.
        "encode": {"max_len": 64, "overlap": 16, "max_windows_per_doc": 8},
        "masks": {"max_predictions": 12},
        # The measured small-budget recipe: pre-LN, no dropout while pretraining (also ~50%
        # faster on CPU), linear decay, peak 1e-3.
        "model": {"hidden": 128, "layers": 2, "heads": 4, "ff": 512, "dropout": 0.0,
                  "norm": "pre"},
        # Length buckets 16/32/48/64: benchmarks/bucketing.py measured 1.20x the real tokens/s
        # of unbucketed batches on the demo's windows (13% padding -> 3%); the price is
        # compiling 4 shapes instead of 1, once each.
        # A same-document contrastive term at weight 0.1 (benchmarks/README, "Pairing windows
        # of a document"): chosen on the linear probe's validation macro-F1 among 0.02, 0.1
        # and 0.5 (0.492, 0.542, 0.512 at 5% labels; 0.440 without), at a cost in validation
        # MLM loss (4.19 against 3.89). Its pairs need longer buckets (7% padding).
        # 1,200 steps, down from 2,400, for the demo to fit 12 minutes on 2 cores (it took 17 on
        # the faster of our hosts, pretraining 630 s of it): on the objective sweep's host the
        # full fine-tuning validation macro-F1 went 0.556 / 0.657 at 1,225 steps against
        # 0.572 / 0.660 at 2,400 (5% / 25% labels; benchmarks/README.md, objective sweep).
        # Not packing (pretrain.packing): at 64 tokens it measured 0.98x the real tokens/s of
        # these buckets, which leave 3% padding, and the contrastive term pairs whole rows.
        "pretrain": {"batch_size": 64, "steps": 1200, "learning_rate": 1e-3, "warmup_steps": 50,
                      "decay": "linear", "log_every": 50, "eval_every": 400,
                      "checkpoint_every": 400, "jit": "on", "length_buckets": 4,
                      "contrastive_weight": 0.1},
        # Every neural method: 2 rates, then the chosen one again with a second seed at 5%;
        # 120-300 updates, no dropout inside the encoder (chosen when it cost a third of a CPU
        # step; under XLA FastDropout makes it ~2%, quality not re-measured) — the same for
        # pretrained and random_init — and XLA
        # (benchmarks/finetune.py: 1.5-1.7x the updates/s once compiled). The rates: with
        # (3e-4, 1e-3) every Transformer chose the top rate on two corpora; given 3e-3,
        # validation picked it for random_init at 25% on both (test macro-F1 +0.039 on the
        # demo, -0.062 on the other), and no method chose 3e-4 in the demo runs since, so it
        # left the grid (a third of each Transformer's fine-tuning time; the library default
        # keeps all three, and 1e-2 lost everywhere, docs/protocol.md). Two label fractions and two
        # pretrained modes (staged unfreezing was the weaker of the two fine-tuned ones at
        # every fraction, for 2 of the demo's minutes) bound the time; add them with
        # --set finetune.fractions=... / finetune.modes=...
        "finetune": {"fractions": [0.05, 0.25], "modes": ["probe", "full"],
                     "learning_rates": [1e-3, 3e-3], "epochs": 3,
                     "min_updates": 120, "max_updates": 300, "evals": 4, "patience": 2,
                     "encoder_dropout": 0.0, "seeds": [0, 1], "repeat_seeds_up_to": 0.05,
                     "jit": "on"},
        # Embedding ~13k docstrings with MiniLM costs ~4 minutes on 2 cores: opt in with
        # --set baseline.sentence_embeddings=auto (or on) when the `embeddings` extra is installed.
        # TF-IDF searches its whole default grid (C 0.1/1/10/100, widened past an end it
        # chooses, x word 1-2-grams and character 2-5-grams): seconds for words with saga, a
        # minute or two for characters with Newton-CG (benchmarks/README.md).
        "baseline": {"sentence_embeddings": "off"},
    },
    # GPU scale.
    "base": {
        "tokenizer": {"vocab_size": 16384},
        "encode": {"max_len": 256},
        "masks": {"max_predictions": 40},
        # Pre-LN: the small-budget sweep's winner (benchmarks/README.md); a deep post-LN stack
        # needs a long warm-up to train stably.
        "model": {"hidden": 512, "layers": 8, "heads": 8, "ff": 2048, "norm": "pre"},
        # Length buckets 64/128/192/256: 1.56x the real tokens/s of full-length batches on an
        # H200 (benchmarks/gpu_check.sh), where half of every 256-token window is padding.
        "pretrain": {"batch_size": 128, "steps": 20000, "warmup_steps": 1000,
                      "eval_every": 1000, "checkpoint_every": 1000, "length_buckets": 4},
        "finetune": {"epochs": 10, "max_updates": 5000},
    },
}


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_override(text: str) -> dict[str, Any]:
    """`a.b=value` -> {"a": {"b": value}}; the value is parsed as YAML (numbers, lists, bools)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise UserError(f"--set expects KEY=VALUE (e.g. dedup.threshold=0.85), got {text!r}")
    value = yaml.safe_load(raw) if raw.strip() else ""
    parts = key.strip().split(".")
    out: dict[str, Any] = {}
    node = out
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def build_config(
    preset: str = "demo",
    config_file: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
) -> PipelineConfig:
    """Preset, then YAML file, then `--set` overrides; errors are one clear line."""
    if preset not in PRESETS:
        raise UserError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    data = copy.deepcopy(PRESETS[preset])
    if config_file is not None:
        path = Path(config_file)
        try:
            loaded = yaml.safe_load(path.read_text("utf-8")) or {}
        except OSError as exc:
            raise UserError(f"cannot read config file {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise UserError(f"config file {path} is not valid YAML: {exc}") from None
        if not isinstance(loaded, dict):
            raise UserError(f"config file {path} must hold a mapping of sections")
        data = deep_merge(data, loaded)
    for item in overrides:
        data = deep_merge(data, parse_override(item))
    return validate_config(data)


def validate_config(data: dict[str, Any]) -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as exc:
        raise UserError(f"invalid configuration: {_one_line(exc)}") from None


def _one_line(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)
