"""Property-based ingest fuzz: random bytes and text written as corpus files never crash ingest,
and every file read is accounted for exactly once."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from selfsup_model.config import IngestConfig
from selfsup_model.corpus.ingest import REJECT_REASONS, ingest_corpus
from selfsup_model.errors import CorpusError

contents = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=300).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.text(alphabet=st.characters(categories=["L", "Zs", "P"]), min_size=20, max_size=200).map(
        str.encode
    ),
)
files = st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), contents), min_size=1, max_size=12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(files)
def test_random_files_are_each_kept_or_rejected_with_a_reason(entries):
    root = Path(tempfile.mkdtemp())
    try:
        for i, (label, data) in enumerate(entries):
            (root / label).mkdir(exist_ok=True)
            (root / label / f"doc{i}.txt").write_bytes(data)
        try:
            result = ingest_corpus(str(root), "folder", IngestConfig(min_chars=10))
        except CorpusError as exc:
            # the one documented whole-corpus outcome
            assert "yielded no usable documents" in str(exc)
            return
        c = result.counts
        rejected = sum(c[f"rejected_{r}"] for r in REJECT_REASONS)
        assert c["read"] == len(entries) == c["kept"] + rejected
        assert set(result.documents["id"]).isdisjoint(result.rejects["id"])
        assert result.documents["text"].map(len).min() >= 10
        assert set(result.rejects["reason"]) <= set(REJECT_REASONS)
    finally:
        shutil.rmtree(root)
