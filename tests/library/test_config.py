import pytest

from selfsup_model.errors import UserError
from selfsup_model.presets import PRESETS, build_config, parse_override


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_validates(preset):
    cfg = build_config(preset)
    assert cfg.split.train + cfg.split.val + cfg.split.test == pytest.approx(1.0)


def test_overrides_parse_yaml_values_into_nested_keys():
    assert parse_override("dedup.threshold=0.85") == {"dedup": {"threshold": 0.85}}
    cfg = build_config("tiny", overrides=["dedup.threshold=0.85", "finetune.fractions=[0.5, 1.0]"])
    assert cfg.dedup.threshold == 0.85
    assert cfg.finetune.fractions == (0.5, 1.0)


def test_yaml_file_then_set_override(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("dedup:\n  threshold: 0.7\n  num_perm: 64\n")
    cfg = build_config("demo", path, ["dedup.threshold=0.9"])
    assert (cfg.dedup.threshold, cfg.dedup.num_perm) == (0.9, 64)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("ingest.bogus=3", "ingest.bogus: unknown key"),
        ("masks.select_rate=1.5", "masks.select_rate"),
        ("split.train=0.9", "must sum to 1"),
        ("masks.mask_rate=0.5", "must sum to 1"),
        ("model.heads=3", "divisible"),
        ("finetune.seeds=[0, 1, 0]", "must not repeat a seed"),
        ("nonsense", "KEY=VALUE"),
    ],
)
def test_invalid_settings_are_one_clear_line(override, message):
    with pytest.raises(UserError) as err:
        build_config("tiny", overrides=[override])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_preset_names_the_choices():
    with pytest.raises(UserError, match="tiny, demo, base"):
        build_config("huge")


def test_on_and_off_mean_the_words_in_set_values_and_config_files(tmp_path):
    # YAML reads on/off as booleans; every on/off setting takes them back as the words
    cfg = build_config("tiny", overrides=["pretrain.jit=on", "finetune.jit=off",
                                          "pretrain.mixed_precision=off",
                                          "baseline.sentence_embeddings=on"])
    assert (cfg.pretrain.jit, cfg.finetune.jit, cfg.pretrain.mixed_precision,
            cfg.baseline.sentence_embeddings) == ("on", "off", "off", "on")
    path = tmp_path / "run.yaml"
    path.write_text("pretrain:\n  jit: off\nfinetune:\n  jit: on\n", "utf-8")
    cfg = build_config("tiny", config_file=path)
    assert (cfg.pretrain.jit, cfg.finetune.jit) == ("off", "on")
    with pytest.raises(UserError, match="pretrain.mixed_precision"):
        build_config("tiny", overrides=["pretrain.mixed_precision=on"])  # not one of its words
