"""Windows, offsets, empty documents, stored arrays and the causal shift."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers

from selfsup_model.config import EncodeConfig
from selfsup_model.text.encoding import encode_split, write_encoded
from selfsup_model.text.specials import (
    CLS_ID,
    NUM_SPECIAL,
    PAD_ID,
    SEP_ID,
    SPECIAL_TOKENS,
)
from selfsup_model.text.windows import first_windows


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """Word-level tokenizer where word "tK" has id NUM_SPECIAL + K: ids are hand-checkable."""
    vocab = {s: i for i, s in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"t{k}": NUM_SPECIAL + k for k in range(600)})
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return t


def doc(first: int, n: int) -> str:
    return " ".join(f"t{k}" for k in range(first, first + n))


def ids(first: int, n: int) -> list[int]:
    return list(range(NUM_SPECIAL + first, NUM_SPECIAL + first + n))


def test_windows_by_hand(tok):
    # content = 6 per window, stride = 4; doc 0 has 10 tokens -> 2 windows, doc 1 has 3.
    cfg = EncodeConfig(max_len=8, overlap=2, max_windows_per_doc=4)
    out = encode_split(tok, [doc(0, 10), doc(50, 3)], cfg)
    assert out.windows.tolist() == [
        [CLS_ID, *ids(0, 6), SEP_ID],
        [CLS_ID, *ids(4, 6), SEP_ID],
        [CLS_ID, *ids(50, 3), SEP_ID, PAD_ID, PAD_ID, PAD_ID],
    ]
    assert out.windows.dtype == np.int32 and out.doc_offsets.dtype == np.int64
    assert out.doc_offsets.tolist() == [0, 2, 3]
    assert (first_windows(out.windows, out.doc_offsets).tolist()
            == [out.windows[0].tolist(), out.windows[2].tolist()])
    # tokens = non-pad positions, [CLS]/[SEP] included, overlap counted in each window.
    assert out.counts == {
        "documents": 2,
        "kept_docs": 2,
        "empty_docs": 0,
        "sequences": 3,
        "tokens": 8 + 8 + 5,
        "content_tokens": 13,
        "truncated_docs": 0,
        "truncated_tokens": 0,
    }


def test_window_cap_truncates_and_counts(tok):
    cfg = EncodeConfig(max_len=8, overlap=2, max_windows_per_doc=2)
    out = encode_split(tok, [doc(0, 13), doc(100, 10)], cfg)  # 13 tokens need 3 windows
    assert out.doc_offsets.tolist() == [0, 2, 4]
    assert out.windows[1].tolist() == [CLS_ID, *ids(4, 6), SEP_ID]
    assert out.counts["truncated_docs"] == 1 and out.counts["truncated_tokens"] == 3


def test_empty_documents_are_reported_not_dropped(tok):
    texts = ["", doc(0, 3), "   ", doc(10, 2)]
    out = encode_split(tok, texts, EncodeConfig(max_len=8, overlap=0))
    assert out.kept.tolist() == [1, 3] and out.empty.tolist() == [0, 2]
    assert out.counts["empty_docs"] == 2 and out.counts["kept_docs"] == 2
    assert out.doc_offsets.tolist() == [0, 1, 2]
    assert out.windows[out.doc_offsets[1], 1] == NUM_SPECIAL + 10


def test_no_documents(tok):
    out = encode_split(tok, [], EncodeConfig(max_len=8, overlap=0))
    assert out.windows.shape == (0, 8) and out.doc_offsets.tolist() == [0]
    assert out.counts["sequences"] == 0


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    max_len=st.integers(8, 16),
    overlap_frac=st.floats(0, 0.9),
    max_windows=st.integers(1, 5),
    batch_size=st.integers(1, 5),
)
def test_windows_rebuild_each_document_and_never_cross(
    tok, lengths, max_len, overlap_frac, max_windows, batch_size
):
    content = max_len - 2
    overlap = min(int(overlap_frac * content), content - 1)
    cfg = EncodeConfig(
        max_len=max_len, overlap=overlap, max_windows_per_doc=max_windows, batch_size=batch_size
    )
    # Documents use disjoint id ranges, so a crossing window would show a foreign id.
    firsts = [41 * i for i in range(len(lengths))]
    texts = [doc(f, n) for f, n in zip(firsts, lengths, strict=True)]
    out = encode_split(tok, texts, cfg)

    assert out.kept.tolist() == [i for i, n in enumerate(lengths) if n]
    assert out.empty.tolist() == [i for i, n in enumerate(lengths) if not n]
    assert out.doc_offsets[-1] == len(out.windows)
    uncovered = []
    for j, i in enumerate(out.kept):
        rows = out.windows[out.doc_offsets[j] : out.doc_offsets[j + 1]]
        assert 1 <= len(rows) <= max_windows
        rebuilt: list[int] = []
        for r, row in enumerate(rows):
            n_real = int(np.count_nonzero(row != PAD_ID))
            assert row[0] == CLS_ID and row[n_real - 1] == SEP_ID
            assert (row[n_real:] == PAD_ID).all()
            body = row[1 : n_real - 1].tolist()
            assert body == ids(firsts[i], lengths[i])[r * (content - overlap) :][:content]
            rebuilt = rebuilt[: r * (content - overlap)] + body
        assert rebuilt == ids(firsts[i], lengths[i])[: len(rebuilt)]
        if len(rebuilt) < lengths[i]:
            assert len(rows) == max_windows  # only the cap may leave content out
        uncovered.append(lengths[i] - len(rebuilt))
    assert out.counts["tokens"] == int(np.count_nonzero(out.windows))
    assert out.counts["truncated_tokens"] == sum(uncovered)
    assert out.counts["truncated_docs"] == sum(1 for u in uncovered if u)
    assert out.counts["content_tokens"] == sum(lengths)


def test_batch_size_does_not_change_result(tok):
    texts = [doc(10 * i, (7 * i) % 23) for i in range(20)]
    a = encode_split(tok, texts, EncodeConfig(max_len=10, overlap=3, batch_size=3))
    b = encode_split(tok, texts, EncodeConfig(max_len=10, overlap=3, batch_size=1000))
    assert np.array_equal(a.windows, b.windows) and np.array_equal(a.doc_offsets, b.doc_offsets)
    assert a.counts == b.counts


def test_write_and_memory_map_round_trip(tok, tmp_path):
    out = encode_split(tok, [doc(0, 12), "", doc(30, 4)], EncodeConfig(max_len=8, overlap=1))
    names = write_encoded(out, tmp_path, "train")
    assert names == ["train_windows.npy", "train_doc_offsets.npy", "train_kept.npy"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)  # no temp files left
    # Read back the way the classification stages read them: windows memory-mapped.
    windows = np.load(tmp_path / "train_windows.npy", mmap_mode="r", allow_pickle=False)
    assert isinstance(windows, np.memmap) and windows.dtype == np.int32
    assert np.array_equal(windows, out.windows)
    offsets = np.load(tmp_path / "train_doc_offsets.npy", allow_pickle=False)
    assert offsets.tolist() == out.doc_offsets.tolist()
    assert np.load(tmp_path / "train_kept.npy", allow_pickle=False).tolist() == [0, 2]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=0, max_size=12), st.integers(1, 6))
def test_shards_encoded_apart_and_merged_equal_one_pass(tok, tmp_path_factory, lengths, shards):
    """The encode stage's sharding law: whatever the cut, the merge is the one-pass result
    (empty documents included: their indices shift with their shard)."""
    from selfsup_model.corpus.sharding import InMemoryTexts, shard_bounds
    from selfsup_model.text.encoding import encode_shard, merge_encoded
    from selfsup_model.text.tokenization import save_tokenizer

    cfg = EncodeConfig(max_len=16, overlap=2, max_windows_per_doc=3, batch_size=4)
    texts = [doc(k, n) for k, n in enumerate(lengths)]
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    save_tokenizer(tok, path)
    rows = np.arange(len(texts))
    merged = merge_encoded([encode_shard(InMemoryTexts(texts), rows[lo:hi], str(path), cfg)
                            for lo, hi in shard_bounds(len(texts), shards)], cfg.max_len)
    whole = encode_split(tok, texts, cfg)
    for name in ("windows", "doc_offsets", "kept", "empty"):
        got, want = getattr(merged, name), getattr(whole, name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got, want, err_msg=name)
    assert merged.counts == whole.counts
