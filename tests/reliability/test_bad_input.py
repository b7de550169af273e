"""Bad input: a clear one-line error with exit code 2, or a per-document rejection with a reason."""

from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pytest

from flows.cli import main
from flows.pipeline import run_pipeline
from flows.summary import collect_report
from selfsup_model.corpus.ingest import REJECT_REASONS, ingest_corpus
from selfsup_model.presets import build_config

PROSE = [
    "The quick brown fox jumps over the lazy dog near the quiet river bank at dawn.",
    "A heron waits in the reeds, perfectly still, until a frog moves nearby in the mud.",
    "Salmon swim upstream against strong currents to reach their spawning beds each year.",
    "Coral reefs shelter thousands of small fish from the larger predators of the open sea.",
    "Owls hunt silently across moonlit fields, guided by sharp hearing and keen night vision.",
    "Bees carry pollen between flowers, and the orchard fruits better for their constant work.",
]


def random_docs(n: int, seed: int = 0) -> list[str]:
    """Distinct, unrelated documents (random words), so each is its own split unit."""
    rng = np.random.default_rng(seed)
    syllables = np.array(["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "xe", "zu", "pa", "qi"])
    words = ["".join(rng.choice(syllables, 3)) for _ in range(400)]
    return [" ".join(rng.choice(words, 14)) + "." for _ in range(n)]


def _cli_error(capsys, argv) -> str:
    """The run exits 2 and stderr holds one error line and no traceback (Prefect's own copies are
    hidden)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "Error" in line or "error" in line]
    assert len(errors) == 1 and errors[0].startswith("selfsup: error: "), err
    assert "Traceback" not in err
    return errors[0]


@pytest.mark.parametrize("setup, message", [
    ("missing", "does not exist"),
    ("empty_folder", "no .txt files"),
    ("no_txt", "no .txt files"),
    ("no_text_column", "no 'text' column"),
    ("unknown_suffix", "cannot tell the format"),
])
def test_unusable_corpora_exit_2(tmp_path, capsys, setup, message):
    corpus = tmp_path / "corpus"
    if setup == "empty_folder":
        corpus.mkdir()
    elif setup == "no_txt":
        (corpus / "a").mkdir(parents=True)
        (corpus / "a" / "notes.md").write_text("hello")
    elif setup == "no_text_column":
        corpus = tmp_path / "t.csv"
        pd.DataFrame({"body": ["x"]}).to_csv(corpus, index=False)
    elif setup == "unknown_suffix":
        corpus = tmp_path / "t.xml"
        corpus.write_text("<a/>")
    err = _cli_error(capsys, ["run", "--corpus", str(corpus), "--workdir", str(tmp_path / "wd"),
                              "--no-tracking", "--preset", "tiny", "--only", "ingest"])
    assert message in err


@pytest.mark.parametrize("override, message", [
    ("bogus.key=1", "unknown key"),
    ("masks.select_rate=1.5", "masks.select_rate"),
    ("split.train=0.5", "must sum to 1"),
])
def test_invalid_settings_exit_2(tmp_path, capsys, override, message):
    assert message in _cli_error(capsys, ["run", "--set", override, "--workdir", str(tmp_path),
                                          "--no-tracking"])


def test_unknown_format_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", "--format", "xml"])
    assert exc.value.code == 2
    assert "invalid choice: 'xml'" in capsys.readouterr().err


def test_every_bad_file_is_a_counted_rejection(tmp_path):
    root = tmp_path / "c"
    (root / "a").mkdir(parents=True)
    for i, text in enumerate(PROSE[:2]):
        (root / "a" / f"ok{i}.txt").write_text(text)
    (root / "a" / "binary.txt").write_bytes(
        b"\x00\x01\x02 binary payload that is long enough to pass")
    (root / "a" / "latin1.txt").write_bytes(
        "d\xe9j\xe0 vu, encore une fois, et encore".encode("latin-1"))
    (root / "a" / "huge.txt").write_text("word " * 10_000_000)  # a 50 MB single line
    (root / "a" / "dangling.txt").symlink_to(tmp_path / "nowhere.txt")
    (root / "loose.txt").write_text("a file outside any label folder, long enough")
    unreadable = root / "a" / "secret.txt"
    unreadable.write_text("you cannot read this file at all, hopefully")
    unreadable.chmod(0)
    result = ingest_corpus(str(root), "auto", build_config("tiny").ingest)
    reasons = dict(zip(result.rejects["id"], result.rejects["reason"]))
    expected = {"a/binary.txt": "binary", "a/latin1.txt": "not_utf8", "a/huge.txt": "too_long",
                "a/dangling.txt": "unreadable", "loose.txt": "outside_class_folder"}
    assert {k: reasons[k] for k in expected} == expected
    if os.geteuid() != 0:  # root reads mode-000 files anyway
        assert reasons["a/secret.txt"] == "unreadable"
    c = result.counts
    assert c["read"] == c["kept"] + sum(c[f"rejected_{r}"] for r in REJECT_REASONS) == 8


def test_identical_documents_are_too_few_to_split(tmp_path, capsys):
    path = tmp_path / "same.csv"
    pd.DataFrame({"text": [PROSE[0]] * 50, "label": ["x", "y"] * 25}).to_csv(path, index=False)
    # ingest itself succeeds (one document kept, 49 duplicate_text); splitting then needs 3 units:
    assert main(["run", "--corpus", str(path), "--workdir", str(tmp_path / "wd2"), "--no-tracking",
                 "--preset", "tiny"]) == 2
    assert "split unit" in capsys.readouterr().err


def test_tables_with_odd_labels_ids_and_empty_tokens(tmp_path):
    """NaN labels, one-document labels, duplicate ids, path-like ids, text that tokenises to
    nothing."""
    rows = [{"id": f"d{i}", "text": text, "label": ["alpha", "beta", "gamma"][i % 3]}
            for i, text in enumerate(random_docs(60))]
    rows[0]["label"] = None
    rows[1]["label"] = "lonely"
    rows[2]["id"] = "../../../../escape"
    rows[3]["id"] = "d5"  # duplicate id: row 5 is the one rejected
    rows[4]["text"] = "\u200b" * 40  # zero-width spaces: survive ingest, tokenise to nothing
    path = tmp_path / "t.jsonl"
    pd.DataFrame(rows).to_json(path, orient="records", lines=True)
    before = set(tmp_path.parent.iterdir())
    wd = tmp_path / "wd"
    cfg = build_config("tiny", overrides=["split.audit_action=warn"])
    stages = ["ingest", "dedup", "split", "tokenizer", "encode"]
    run_pipeline(cfg, str(path), workdir=str(wd), stages=stages, tracking=False)
    report = collect_report(wd)
    ingest = report["stages"]["ingest"]["counts"]
    assert ingest["rejected_duplicate_id"] == 1
    assert report["stages"]["encode"]["counts"]["empty_docs"] == 1
    assert pd.read_parquet(wd / "encode" / "rejects.parquet")["reason"].tolist() == ["no_tokens"]
    acc = report["accounting"]
    assert acc["balanced"] and acc["read"] == 60
    assert "../../../../escape" in set(pd.read_parquet(wd / "ingest" / "documents.parquet")["id"])
    assert set(tmp_path.parent.iterdir()) == before  # nothing written outside the workdir


def test_a_single_label_skips_classification_but_pretrains(tmp_path):
    rows = [{"text": text, "label": "only"} for text in random_docs(80, seed=1)]
    path = tmp_path / "one.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    wd = tmp_path / "wd"
    results = run_pipeline(build_config("tiny"), str(path), workdir=str(wd), tracking=False)
    assert [r.status for r in results] == ["ran"] * len(results)
    stages = collect_report(wd)["stages"]
    assert stages["pretrain"]["counts"]["steps"] == build_config("tiny").pretrain.steps
    assert (stages["finetune"]["counts"]["skipped"] == 1
            and stages["baseline"]["counts"]["skipped"] == 1)
    assert "Skipped" in (wd / "compare" / "report.md").read_text()

