"""Saved artifacts outlive the code layout: classes load by their registered names, never by the
module they lived in when the file was written."""

from __future__ import annotations

import json
import zipfile

import keras
import numpy as np

from selfsup_model.config import ModelConfig
from selfsup_model.nn import saving
from selfsup_model.nn.model import build_backbone, build_pretrain_export_model
from selfsup_model.transfer.bag_of_embeddings import build_bag_of_embeddings
from selfsup_model.transfer.classify import build_classifier

# Every name a saved .keras file may refer to. Renaming one breaks every artifact written before.
REGISTERED = {
    "BagTokenEmbedding", "CausalLMHead", "ClsPooling", "DocumentMask", "FastDropout",
    "LastTokenPooling", "MaskedLMHead", "MaskedMeanPooling", "PaddingMask", "PretrainExportModel",
    "PretrainingModel", "SelectiveAdamW", "TokenAndPositionEmbedding", "TokenWeightedLoss",
    "TransformerEncoderBlock", "WarmupDecay",
    # replaced-token detection (pretrain.objective=rtd)
    "Generator", "ReplaceTokens", "ReplacedTokenExportModel", "ReplacedTokenHead",
    "ReplacedTokenModel",
}
# Where each module lived before the library was split into subpackages (release 4423362).
FLAT_MODULES = {"selfsup_model.nn.layers": "selfsup_model.layers",
                "selfsup_model.nn.model": "selfsup_model.model",
                "selfsup_model.nn.pooling": "selfsup_model.classify",
                "selfsup_model.nn.losses": "selfsup_model.losses",
                "selfsup_model.nn.optimizers": "selfsup_model.optimizers"}


def test_the_registered_names_are_those_earlier_artifacts_use():
    for module in saving._REGISTERING_MODULES:
        __import__(module)
    ours = {name.split(">", 1)[1] for name in keras.saving.get_custom_objects()
            if name.startswith(f"{saving.PACKAGE}>")}
    assert ours == REGISTERED


def as_written_before_the_move(path, out):
    """A copy of the .keras file at `path` whose config names the old, flat module paths."""
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w") as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            if item.filename == "config.json":
                text = data.decode()
                for new, old in FLAT_MODULES.items():
                    text = text.replace(f'"module": "{new}"', f'"module": "{old}"')
                assert "selfsup_model.nn." not in text  # every module of ours was rewritten
                data = text.encode()
            dst.writestr(item, data)
    return out


def test_files_that_name_the_old_module_paths_still_load(tmp_path):
    keras.utils.set_random_seed(0)
    cfg = ModelConfig(hidden=8, layers=1, heads=2, ff=16, dropout=0.0)
    backbone = build_backbone(40, 12, cfg, seed=0)
    ids = np.array([[2, 9, 10, 11, 3, 0, 0], [2, 12, 3, 0, 0, 0, 0]], dtype=np.int32)
    models = {
        "classifier_mean": build_classifier(backbone, 3, pooling="mean", seed=0),
        "classifier_cls": build_classifier(backbone, 3, pooling="cls", seed=0),
        "bag": build_classifier(build_bag_of_embeddings(40, 12, dim=4), 3, seed=0),
    }
    for name, model in models.items():
        path = tmp_path / f"{name}.keras"
        model.save(path)
        old = as_written_before_the_move(path, tmp_path / f"{name}_flat.keras")
        config = json.loads(zipfile.ZipFile(old).read("config.json"))
        assert "selfsup_model.nn" not in json.dumps(config)
        loaded = saving.load_keras_model(old)
        np.testing.assert_array_equal(loaded.predict(ids, verbose=0), model.predict(ids, verbose=0))


def test_a_pretrain_model_naming_the_old_paths_loads(tmp_path):
    from selfsup_model.nn.model import build_pretraining_model

    cfg = ModelConfig(hidden=8, layers=1, heads=2, ff=16, dropout=0.0)
    backbone = build_backbone(40, 12, cfg, seed=1)
    trainer = build_pretraining_model(backbone, "mlm", cfg, seed=1)
    model = build_pretrain_export_model(backbone, trainer.head, "mlm")
    ids = np.array([[2, 9, 4, 11, 3, 0]], dtype=np.int32)
    path = tmp_path / "pretrain_model.keras"
    model.save(path)
    loaded = saving.load_keras_model(as_written_before_the_move(path, tmp_path / "flat.keras"))
    np.testing.assert_array_equal(loaded(ids), model(ids))


def test_one_model_saves_to_the_same_bytes_and_loads_back(tmp_path):
    """Two builds of one model save to identical files: no save time, and shared objects
    numbered 1, 2, ... instead of by memory address (which differs between processes: the
    chaos test compares files of separate runs). What loads back computes what was saved."""
    from selfsup_model.artifacts import save_keras_atomic, sha256_file

    cfg = ModelConfig(hidden=8, layers=1, heads=2, ff=16, dropout=0.1)
    ids = np.array([[2, 9, 10, 11, 3, 0, 0], [2, 12, 3, 0, 0, 0, 0]], dtype=np.int32)
    paths, models = [], []
    for k in range(2):
        model = build_classifier(build_backbone(40, 12, cfg, seed=0), 3, pooling="mean", seed=0)
        models.append(model)
        model.save(tmp_path / f"plain{k}.keras")  # Keras' own: addresses and times inside
        paths.append(save_keras_atomic(model, tmp_path / f"model{k}.keras"))
    assert sha256_file(paths[0]) == sha256_file(paths[1])
    plain = json.loads(zipfile.ZipFile(tmp_path / "plain0.keras").read("config.json"))
    with zipfile.ZipFile(paths[0]) as saved:
        assert {i.date_time for i in saved.infolist()} == {(1980, 1, 1, 0, 0, 0)}
        text = saved.read("config.json").decode()
    shared = json.loads(text)
    found: list[int] = []

    def walk(node):
        if isinstance(node, dict):
            found.extend(v for k, v in node.items() if k == "shared_object_id")
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(shared)
    ours = found[:]
    found.clear()
    walk(plain)
    assert max(found) > 1 << 20  # Keras' own: addresses
    number = dict(zip(found, ours, strict=True))  # one-to-one: the same object, the same number
    assert all(number[a] == b for a, b in zip(found, ours, strict=True))
    assert len(set(number.values())) == len(number) and sorted(set(ours)) == list(
        range(1, len(number) + 1))
    loaded = saving.load_keras_model(paths[0])
    np.testing.assert_array_equal(loaded.predict(ids, verbose=0),
                                  models[0].predict(ids, verbose=0))
