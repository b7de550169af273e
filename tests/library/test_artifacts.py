import json

import pytest

from selfsup_model.artifacts import (
    FileRecord,
    StageManifest,
    atomic_path,
    atomic_write_text,
    read_manifest,
    record_outputs,
    verify_outputs,
)


def test_atomic_path_leaves_nothing_behind_on_failure(tmp_path):
    target = tmp_path / "out.txt"
    atomic_write_text(target, "old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_manifest_round_trip_and_tamper_detection(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"abc")
    outputs = record_outputs(tmp_path, ["a.bin"])
    assert outputs["a.bin"] == FileRecord(
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad", 3)
    manifest = StageManifest("x", "v", {"p": 1}, {}, outputs, {"n": 1})
    manifest.write(tmp_path)
    assert read_manifest(tmp_path) == manifest
    assert verify_outputs(tmp_path, manifest) == []
    (tmp_path / "a.bin").write_bytes(b"abd")  # same size, different bytes
    assert verify_outputs(tmp_path, manifest) == ["a.bin"]


def test_unreadable_manifest_is_not_trusted(tmp_path):
    (tmp_path / "manifest.json").write_text('{"stage": "x"')
    assert read_manifest(tmp_path) is None
    (tmp_path / "manifest.json").write_text(json.dumps({"stage": "x", "surprise": 1}))
    assert read_manifest(tmp_path) is None


def test_atomic_writes_get_the_permissions_open_would_give(tmp_path):
    import os
    import stat

    from selfsup_model.artifacts import atomic_write_text

    previous = os.umask(0o027)
    try:
        atomic_write_text(tmp_path / "spec.json", "{}")
        with open(tmp_path / "plain.json", "w", encoding="utf-8") as fh:
            fh.write("{}")
    finally:
        os.umask(previous)
    mode = stat.S_IMODE((tmp_path / "spec.json").stat().st_mode)
    assert mode == stat.S_IMODE((tmp_path / "plain.json").stat().st_mode) == 0o640
