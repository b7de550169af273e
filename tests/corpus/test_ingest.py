import json

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from selfsup_model.config import IngestConfig
from selfsup_model.corpus.ingest import (
    REJECT_REASONS,
    RawRecord,
    ingest_corpus,
    ingest_records,
    judge_data,
    normalize_document,
)
from selfsup_model.corpus.pydocs import harvest
from selfsup_model.corpus.sharding import InProcess, local_map
from selfsup_model.errors import CorpusError

CFG = IngestConfig(min_chars=20)


def test_folder_corpus_rejects_bad_files_with_reasons(folder_corpus):
    result = ingest_corpus(str(folder_corpus), "auto", CFG)
    reasons = dict(zip(result.rejects["id"], result.rejects["reason"]))
    assert reasons == {
        "birds/latin1.txt": "not_utf8", "fish/empty.txt": "empty", "fish/copy.txt": "duplicate_text"
    }
    assert "fish/c.txt" in result.rejects.set_index("id").loc["fish/copy.txt", "detail"]
    assert sorted(result.documents["label"]) == ["birds", "birds", "fish", "fish"]
    c = result.counts
    assert (c["read"], c["kept"], c["rejected"]) == (7, 4, 3)
    assert c["read"] == c["kept"] + sum(c[f"rejected_{r}"] for r in REJECT_REASONS)


def test_normalisation_is_nfc_and_collapses_whitespace():
    raw = "Cafe\u0301\r\n\r\n\r\n  two   spaces\t "
    assert normalize_document(raw) == "Caf\u00e9\n\ntwo spaces"


def test_table_corpus_with_optional_columns(tmp_path):
    path = tmp_path / "t.csv"
    body = ["a long enough first document text", "another long enough second text", ""]
    pd.DataFrame({"body": body, "cat": ["x", None, "y"]}).to_csv(path, index=False)
    cfg = IngestConfig(min_chars=10, text_column="body", label_column="cat")
    result = ingest_corpus(str(path), "auto", cfg)
    assert result.documents["id"].tolist() == ["row-0", "row-1"]
    assert result.documents["label"].tolist()[0] == "x"
    assert pd.isna(result.documents["label"].tolist()[1])
    assert result.rejects["reason"].tolist() == ["empty"]


def test_table_without_text_column_names_the_columns(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"body": "hello"}\n')
    with pytest.raises(CorpusError, match=r"no 'text' column \(columns: body\)"):
        ingest_corpus(str(path), "auto", CFG)


def test_missing_and_empty_corpora_are_clear_errors(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        ingest_corpus(str(tmp_path / "nope"), "auto", CFG)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="no .txt files"):
        ingest_corpus(str(tmp_path / "empty"), "auto", CFG)


def test_all_rejected_names_reasons():
    recs = [RawRecord("s", "a", b""), RawRecord("s", "b", b"short")]
    with pytest.raises(CorpusError, match="empty=1, too_short=1"):
        ingest_records(recs, CFG, "mem")


def test_pydocs_ids_are_unique_and_labelled():
    cfg = IngestConfig(pydocs_libraries=("json",), min_chars=20, workers=1)
    result = ingest_corpus("pydocs", "auto", cfg)
    docs = result.documents
    assert len(docs) > 10 and docs["id"].is_unique
    assert set(docs["label"]) == {"json"}
    assert all(i.startswith("json:json") for i in docs["id"])


def test_pydocs_harvest_in_worker_processes_equals_the_serial_one():
    libraries = ("email", "xml", "unittest")  # 64 files: enough for the process pool
    pooled = harvest(libraries, workers=2, max_per_library=40)
    pd.testing.assert_frame_equal(pooled, harvest(libraries, workers=1, max_per_library=40))
    assert len(pooled) == 120 and list(dict.fromkeys(pooled["label"])) == list(libraries)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d"]),
                          st.binary(max_size=60) | st.text(max_size=60)),
                min_size=1, max_size=30))
def test_accounting_law_holds_for_any_input(items):
    """read = kept + every rejection reason, whatever bytes or text arrive."""
    recs = [RawRecord(f"src{i}", doc_id, data) for i, (doc_id, data) in enumerate(items)]
    try:
        result = ingest_records(recs, IngestConfig(min_chars=3), "fuzz")
    except CorpusError:
        return  # nothing usable: a clear error is the documented outcome
    c = result.counts
    assert c["read"] == len(items) == c["kept"] + sum(c[f"rejected_{r}"] for r in REJECT_REASONS)
    assert result.documents["id"].is_unique


class _Elsewhere:
    """A fan-out whose shards count as running in another process: the driver stages table
    texts and the shards spill theirs to files, exactly as on Dask, but run here."""

    in_process = False

    def __init__(self, shards: int):
        self.shards = shards
        self.calls = 0

    def run(self, name, body):
        return body(self._mapper)

    def _mapper(self, name, fn, items, progress=None):
        self.calls += len(items)
        return local_map(name, fn, items, progress)


def _table_with_every_reason(path):
    rows = [{"id": f"d{i}", "text": f"document number {i} has enough words to be kept"}
            for i in range(23)]
    rows[3]["text"] = rows[1]["text"]  # duplicate_text
    rows[5]["id"] = "d2"  # duplicate_id
    rows[7]["text"] = "tiny"  # too_short
    rows[9]["text"] = "   "  # empty
    rows[13]["text"] = "a NUL \x00 inside a long enough document"  # binary
    rows[15]["text"] = None  # missing
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize("shards", [1, 3, 7, 40])
@pytest.mark.parametrize("elsewhere", [False, True])
def test_sharded_judging_gives_the_one_shard_result(folder_corpus, tmp_path, shards, elsewhere):
    table = _table_with_every_reason(tmp_path / "t.jsonl")
    cfg = IngestConfig(min_chars=10)
    for corpus in (str(folder_corpus), str(table)):
        one = ingest_corpus(corpus, "auto", cfg)
        fan_out = _Elsewhere(shards) if elsewhere else InProcess(shards)
        scratch = tmp_path / "scratch"
        scratch.mkdir(exist_ok=True)
        cut = ingest_corpus(corpus, "auto", cfg, fan_out=fan_out, scratch=scratch)
        pd.testing.assert_frame_equal(cut.documents, one.documents)
        pd.testing.assert_frame_equal(cut.rejects, one.rejects)
        assert cut.counts == one.counts
        assert list(scratch.iterdir()) == []  # staged and spilled files are gone
        if elsewhere:
            assert fan_out.calls == min(shards, one.counts["read"])


def test_table_rejects_carry_their_reasons(tmp_path):
    result = ingest_corpus(str(_table_with_every_reason(tmp_path / "t.jsonl")), "auto",
                           IngestConfig(min_chars=10))
    reasons = dict(zip(result.rejects["id"], result.rejects["reason"]))
    assert reasons == {"d3": "duplicate_text", "d2": "duplicate_id", "d7": "too_short",
                       "d9": "empty", "d13": "binary", "d15": "empty"}
    assert result.counts["kept"] == 23 - 6


@pytest.mark.parametrize("fan_out", [InProcess(2), _Elsewhere(2)])
def test_undecodable_text_is_rejected_not_a_crash(fan_out):
    """Text with escaped undecodable bytes (CSV) or a lone surrogate cannot be written as
    UTF-8: it is rejected as not_utf8, also when staged for shards elsewhere."""
    recs = [RawRecord("s", "ok", "a perfectly fine document"),
            RawRecord("s", "esc", "bad byte \udce9 in a long enough text"),
            RawRecord("s", "lone", "lone \ud800 surrogate in a long enough text")]
    result = ingest_records(recs, IngestConfig(min_chars=10), "mem", fan_out=fan_out)
    assert result.rejects[["id", "reason", "detail"]].values.tolist() == [
        ["esc", "not_utf8", "invalid UTF-8 bytes"],
        ["lone", "not_utf8", "lone surrogate U+D800"]]
    assert result.documents["id"].tolist() == ["ok"]


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab \t\n\r\u00a0\u2003e\u0301\u00e9\ud800.")),
               max_size=80))
def test_judging_a_kept_text_gives_it_back(raw):
    """What a grown corpus relies on to skip judging the last version's texts: a text ingest
    kept is kept unchanged when judged again (normalisation is idempotent)."""
    text, reason, _ = judge_data(raw, CFG)
    if reason is None:
        assert judge_data(text, CFG) == (text, None, "")


def test_known_texts_are_not_judged_again_and_change_nothing(monkeypatch):
    from selfsup_model.corpus import ingest

    raw = ["  Swallows cross the sky\r\nin long loops.  ", "A heron waits in the reeds, still.",
           "Salmon swim upstream against currents.", "x\x00 binary"]
    recs = [RawRecord(f"s{i}", f"d{i}", text) for i, text in enumerate(raw)]
    plain = ingest_records(recs, CFG, "t")
    judged = []
    real = ingest.judge_data
    monkeypatch.setattr(ingest, "judge_data", lambda data, cfg: judged.append(data) or
                        real(data, cfg))
    known = plain.documents["text"].tolist()  # the last version's kept texts
    again = ingest_records(recs, CFG, "t", known_texts=known)
    pd.testing.assert_frame_equal(again.documents, plain.documents)
    pd.testing.assert_frame_equal(again.rejects, plain.rejects)
    # judged again: the text that normalising changed, and the rejected one
    assert judged == [raw[0], raw[3]]
