import json

import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import accuracy_score, f1_score

from selfsup_model.errors import UserError
from selfsup_model.report.comparison import (
    CONFUSION_PLOT,
    CURVE_PLOT,
    grid_edges,
    narrow_grids,
    recompute_results,
    render_markdown,
    winner_statements,
    write_report,
)
from selfsup_model.report.effects import effect_sentence, pretraining_effects, seed_spread

LABELS = np.array(["json", "email", "csv"])
SKILL = {"tfidf": 0.6, "probe": 0.7, "full": 0.9}  # chance of predicting the true label


def predictions_table(n_test=60, seed=0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    truth = LABELS[rng.integers(0, 3, n_test)]
    rows = []
    for fraction in (0.25, 1.0):
        for method, skill in SKILL.items():
            guess = np.where(rng.random(n_test) < skill * (0.8 + 0.2 * fraction), truth,
                             LABELS[rng.integers(0, 3, n_test)])
            # Rows deliberately shuffled: recomputation must not depend on row order.
            for i in rng.permutation(n_test):
                rows.append({"id": f"doc{i:03d}", "method": method, "fraction": fraction,
                             "label": truth[i], "prediction": guess[i]})
    return pd.DataFrame(rows)


def test_report_numbers_recompute_from_predictions(tmp_path):
    table = predictions_table()
    results = [{**r, "val_macro_f1": 0.5, "train_time_s": 1.25}
               for r in recompute_results(table, 200, 1)]
    context = {"pretraining corpus": {"docs": 120, "tokens": 9000}, "scored tokens": 1350,
               "leakage audit": "0 near-duplicates crossed", "labels": list(LABELS)}
    written = write_report(tmp_path, results, context, predictions=table)
    assert set(written) == {"report.md", "report.json", CURVE_PLOT, CONFUSION_PLOT}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(written)  # no temp files left
    for name in (CURVE_PLOT, CONFUSION_PLOT):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    report = json.loads((tmp_path / "report.json").read_text())
    assert report["context"]["scored tokens"] == 1350
    again = {(r["method"], r["fraction"]): r for r in recompute_results(table, 200, 1)}
    for row in report["results"]:
        fresh = again[(row["method"], row["fraction"])]
        for key in ("test_accuracy", "test_macro_f1", "test_accuracy_ci", "test_macro_f1_ci",
                    "n_test"):
            assert row[key] == pytest.approx(fresh[key])
        group = table[(table.method == row["method"]) & (table.fraction == row["fraction"])]
        assert row["test_accuracy"] == pytest.approx(accuracy_score(group.label, group.prediction))
        assert row["test_macro_f1"] == pytest.approx(f1_score(group.label, group.prediction,
                                                              average="macro"))
        low, high = row["test_macro_f1_ci"]
        assert low <= row["test_macro_f1"] <= high

    markdown = (tmp_path / "report.md").read_text()
    assert markdown.count("| full |") == 2 and "Label fraction 0.25:" in markdown
    assert "leakage audit" in markdown and "test-set sampling only" in markdown


def test_grid_edges_name_each_selection_at_an_end_of_its_grid():
    results = [
        {"method": "random_init", "fraction": 0.25, "selected": {"learning_rate": 3e-3, "seed": 0}},
        {"method": "full", "fraction": 0.25, "selected": {"learning_rate": 1e-3, "seed": 1}},
        {"method": "bag", "fraction": 0.05, "selected": {"learning_rate": 3e-4, "seed": 1}},
        {"method": "tfidf", "fraction": 0.05, "selected": {"C": 10.0, "ngram_max": 2}},
        {"method": "tfidf", "fraction": 0.25, "selected": {"C": 100.0, "ngram_max": 1}},
        {"method": "probe", "fraction": 0.05, "selected": {"C": 0.01}},
        {"method": "majority", "fraction": 0.05},
    ]
    grids = {"*": {"learning_rate": (1e-3, 3e-4, 3e-3)},  # any order
             "tfidf": {"C": (0.1, 1.0, 10.0, 100.0)},
             "probe": {"C": (0.01, 0.01)}}  # one value searched: nothing was selected
    assert grid_edges(results, grids) == [
        {"method": "bag", "fraction": 0.05, "setting": "learning_rate", "value": 3e-4,
         "end": "smallest"},
        {"method": "random_init", "fraction": 0.25, "setting": "learning_rate", "value": 3e-3,
         "end": "largest"},
        {"method": "tfidf", "fraction": 0.25, "setting": "C", "value": 100.0, "end": "largest"},
    ]


def test_a_widened_search_is_judged_on_the_values_it_tried():
    grids = {"tfidf": {"C": (0.1, 1.0, 10.0, 100.0)}}
    wide = [0.1, 1.0, 10.0, 100.0, 1000.0, 10000.0]
    results = [  # 100 beat both neighbours once 1000 was tried; 10000 is where widening stopped
        {"method": "tfidf", "fraction": 0.05, "selected": {"C": 100.0},
         "searched": {"C": wide[:5]}},
        {"method": "tfidf", "fraction": 0.25, "selected": {"C": 10000.0},
         "searched": {"C": wide}},
    ]
    assert grid_edges(results, grids) == [
        {"method": "tfidf", "fraction": 0.25, "setting": "C", "value": 10000.0, "end": "largest"}]


def test_report_lists_grid_edges_or_says_there_are_none(tmp_path):
    table = predictions_table()
    results = [{**r, "selected": {"learning_rate": 3e-3 if r["method"] == "full" else 1e-3}}
               for r in recompute_results(table, 50, 1)]
    edges = grid_edges(results, {"*": {"learning_rate": (3e-4, 1e-3, 3e-3)}})
    assert [(e["method"], e["fraction"]) for e in edges] == [("full", 0.25), ("full", 1.0)]
    write_report(tmp_path, results, {}, edges=edges)
    assert json.loads((tmp_path / "report.json").read_text())["grid_edges"] == edges
    markdown = (tmp_path / "report.md").read_text()
    assert ("- full at label fraction 0.25: learning_rate 0.003, the largest value tried. "
            "A wider grid might change its result.") in markdown
    write_report(tmp_path, results, {}, edges=[])
    assert "- None: every setting chosen on validation lies inside its grid." in (
        tmp_path / "report.md").read_text()


def test_a_two_value_grid_is_said_once_not_flagged_at_every_selection(tmp_path):
    # The demo's shape: every neural method picks from two rates, TF-IDF from four values of C.
    results = [
        {"method": "full", "fraction": 0.05, "selected": {"learning_rate": 1e-3, "seed": 1}},
        {"method": "full", "fraction": 0.25, "selected": {"learning_rate": 3e-3, "seed": 0}},
        {"method": "bag", "fraction": 0.05, "selected": {"learning_rate": 1e-3, "seed": 0}},
        {"method": "tfidf", "fraction": 0.05, "selected": {"C": 10.0}},
        {"method": "probe", "fraction": 0.05, "selected": {"C": 1.0}},
    ]
    grids = {"*": {"learning_rate": (3e-3, 1e-3)}, "tfidf": {"C": (0.1, 1.0, 10.0, 100.0)},
             "probe": {"C": (0.3, 3.0)}}
    assert grid_edges(results, grids) == []  # four choices from two values: none flagged
    narrow = narrow_grids(results, grids)
    assert narrow == [
        {"setting": "C", "values": [0.3, 3.0], "methods": ["probe"]},
        {"setting": "learning_rate", "values": [1e-3, 3e-3], "methods": ["bag", "full"]},
    ]
    scored = [{**r, "test_accuracy": 0.5, "test_macro_f1": 0.5} for r in results]
    write_report(tmp_path, scored, {}, edges=[], narrow=narrow)
    markdown = (tmp_path / "report.md").read_text()
    assert markdown.count("chosen from two values") == 2
    assert ("- learning_rate was chosen from two values (0.001, 0.003) for bag, full: any choice "
            "from two values is at an end of its grid, so this run cannot tell whether a value "
            "beyond them would do better. Search three or more values to find out.") in markdown
    assert ("- Among grids of three or more values, none: every setting chosen on validation "
            "lies inside its grid.") in markdown
    assert "None: every setting" not in markdown
    assert json.loads((tmp_path / "report.json").read_text())["narrow_grids"] == narrow


def test_recompute_is_independent_of_row_order():
    table = predictions_table(seed=3)
    shuffled = table.sample(frac=1.0, random_state=7)
    assert recompute_results(table, 100, 2) == recompute_results(shuffled, 100, 2)


def row(method, f1, ci, fraction=1.0):
    return {"method": method, "fraction": fraction, "test_accuracy": f1, "test_macro_f1": f1,
            "test_macro_f1_ci": ci}


def test_statements_claim_only_what_the_intervals_support():
    separated = winner_statements([row("probe", 0.60, (0.55, 0.65)),
                                   row("full", 0.80, (0.75, 0.85))])
    assert separated == [
        "Label fraction 1: full has the highest test macro-F1, 0.800 [0.750, 0.850]; "
        + "runner-up probe 0.600 [0.550, 0.650]. The intervals do not overlap."
    ]
    close = winner_statements([row("full", 0.80, (0.70, 0.90)), row("probe", 0.78, (0.68, 0.88)),
                               row("tfidf", 0.10, (0.05, 0.15))])
    assert close[0].endswith("The intervals overlap: this test set does not clearly separate them.")
    assert "runner-up probe" in close[0]
    assert "tie" in winner_statements([row("a", 0.5, (0.4, 0.6)), row("b", 0.5, (0.4, 0.6))])[0]
    assert "nothing to compare" in winner_statements(
        [row("full", 0.8, (0.7, 0.9), fraction=0.05)])[0]
    assert "No interval" in winner_statements([row("a", 0.5, None), row("b", 0.4, None)])[0]


def test_report_rejects_incomplete_results(tmp_path):
    with pytest.raises(UserError, match="no results"):
        render_markdown([], {})
    with pytest.raises(UserError, match="lacks"):
        write_report(tmp_path, [{"method": "full", "fraction": 1.0}], {})
    with pytest.raises(UserError, match="lacks columns"):
        recompute_results(pd.DataFrame({"id": [1]}))


def test_pretraining_effect_compares_the_validation_choice_on_test():
    ids = [f"d{i}" for i in range(8)]
    y = list("aabbaabb")
    rows = []
    for method, pred in (("pretrained_full", y), ("pretrained_probe", list("aaaaaaaa")),
                         ("random_init", list("abababab")), ("tfidf_logreg", y)):
        rows += [(i, method, 0.5, t, p) for i, t, p in zip(ids, y, pred)]
    predictions = pd.DataFrame(rows, columns=["id", "method", "fraction", "label", "prediction"])
    results = recompute_results(predictions, 200, 0)
    # Validation prefers the probe, so the probe is "the best pretrained method", not full.
    val = {"pretrained_full": 0.6, "pretrained_probe": 0.7, "random_init": 0.9, "tfidf_logreg": 0.9}
    for r in results:
        r["val_macro_f1"] = val[r["method"]]
    effects = pretraining_effects(results, predictions, 200, 0)
    assert [(e["pretrained_method"], e["reference"]) for e in effects] == [
        ("pretrained_probe", "random_init"), ("pretrained_probe", "tfidf_logreg")]
    # probe: all "a" -> macro-F1 1/3; random_init: half right in each class -> 1/2; tfidf: 1.
    assert effects[0]["test_macro_f1_difference"] == pytest.approx(1 / 3 - 1 / 2)
    assert effects[1]["test_macro_f1_difference"] == pytest.approx(1 / 3 - 1)
    assert effects[1]["verdict"] == "worse" and effects[1]["ci"][1] < 0
    sentence = effect_sentence(effects[1])
    assert "pretrained_probe" in sentence and "behind TF-IDF + logistic regression" in sentence
    # a validation tie goes to the cheaper method, as the classifier handed over does
    val["pretrained_full"] = 0.7
    for r in results:
        r["val_macro_f1"] = val[r["method"]]
    assert {e["pretrained_method"] for e in pretraining_effects(results, predictions, 200, 0)} \
        == {"pretrained_probe"}


def test_seed_spread_over_training_seeds():
    rows = [("d0", "m", 0.5, s, "a", p) for s, p in ((0, "a"), (1, "b"))]
    rows += [("d1", "m", 0.5, s, "b", "b") for s in (0, 1)]
    rows += [("d0", "single", 0.5, 0, "a", "a")]
    spread = seed_spread(pd.DataFrame(rows, columns=["id", "method", "fraction", "seed", "label",
                                                     "prediction"]))
    # seed 0: both right (macro-F1 1); seed 1: "b" twice -> F1_a 0, F1_b 2/3 -> 1/3.
    assert set(spread) == {("m", 0.5)}
    assert spread[("m", 0.5)]["mean"] == pytest.approx(2 / 3)
    assert spread[("m", 0.5)]["sd"] == pytest.approx(np.std([1, 1 / 3], ddof=1))
