"""The ensemble row: its weight chosen on validation by hand-computed numbers, applied once to
test, and kept apart from the pretraining verdicts."""

import numpy as np
import pandas as pd
import pytest

from selfsup_model.errors import ArtifactError
from selfsup_model.report.ensemble import (
    ENSEMBLE_METHOD,
    choose_weight,
    ensemble_rows,
    merge_probabilities,
    probabilities_key,
)
from selfsup_model.transfer.protocol import class_columns

# Three validation documents of classes 0, 1, 1. The pretrained member alone predicts 0, 0, 1
# and TF-IDF alone 1, 1, 0; their even average [[.65, .35], [.45, .55], [.40, .60]] predicts
# 0, 1, 1: all right.
Y = np.array([0, 1, 1])
P = np.array([[0.9, 0.1], [0.6, 0.4], [0.2, 0.8]])
Q = np.array([[0.4, 0.6], [0.3, 0.7], [0.6, 0.4]])


def test_the_weight_is_the_one_best_on_validation():
    weight, f1, grid = choose_weight(Y, P, Q, (0.0, 0.5, 1.0))
    assert weight == 0.5 and f1 == 1.0
    # w = 0: predictions 1, 1, 0 -> class 0 F1 0, class 1 F1 2/3 (precision 1/2, recall 1/2)
    # w = 1: predictions 0, 0, 1 -> class 0 F1 2/3, class 1 F1 2/3
    assert [(g["weight"], round(g["val_macro_f1"], 4)) for g in grid] == [
        (0.0, round((0 + 0.5) / 2, 4)), (0.5, 1.0), (1.0, round(2 / 3, 4))]


def test_ties_go_to_the_weight_nearest_an_even_average_then_the_smaller():
    assert choose_weight(Y, P, P, (0.0, 0.4, 0.7, 1.0))[0] == 0.4
    assert choose_weight(Y, P, P, (0.7, 0.3))[0] == 0.3
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        choose_weight(Y, P, Q, (0.5, 1.5))


def _arrays(val_pretrained_full=P):
    """Two pretrained methods and TF-IDF at one fraction, on three validation and two test
    documents."""
    a = {"classes": np.array(["neg", "pos"]), "val_ids": np.array(["v1", "v2", "v3"]),
         "val_y": Y, "test_ids": np.array(["t1", "t2"])}
    a[probabilities_key("pretrained_full", 0.5, "val")] = val_pretrained_full
    a[probabilities_key("pretrained_full", 0.5, "test")] = np.array([[0.8, 0.2], [0.45, 0.55]])
    a[probabilities_key("pretrained_probe", 0.5, "val")] = Q
    a[probabilities_key("pretrained_probe", 0.5, "test")] = np.array([[0.5, 0.5], [0.5, 0.5]])
    a[probabilities_key("tfidf_logreg", 0.5, "val")] = Q
    a[probabilities_key("tfidf_logreg", 0.5, "test")] = np.array([[0.3, 0.7], [0.7, 0.3]])
    return a


SUMMARIES = [{"method": "pretrained_full", "fraction": 0.5, "val_macro_f1": 2 / 3},
             {"method": "pretrained_probe", "fraction": 0.5, "val_macro_f1": 0.25},
             {"method": "tfidf_logreg", "fraction": 0.5, "val_macro_f1": 0.25},
             {"method": "random_init", "fraction": 0.5, "val_macro_f1": 0.9}]
PREDICTIONS = pd.DataFrame({"id": ["t2", "t1"], "method": "tfidf_logreg", "fraction": 0.5,
                            "label": ["neg", "pos"], "prediction": ["neg", "pos"]})


def test_the_row_mixes_the_best_pretrained_method_with_tfidf_on_test():
    rows, (summary,) = ensemble_rows(SUMMARIES, PREDICTIONS, _arrays(), (0.0, 0.5, 1.0))
    # pretrained_full is the pretrained method best on validation (random_init is not one)
    assert summary["selected"] == {"weight": 0.5, "pretrained_member": "pretrained_full"}
    assert summary["method"] == ENSEMBLE_METHOD and summary["val_macro_f1"] == 1.0
    # test: 0.5 x [[.8, .2], [.45, .55]] + 0.5 x [[.3, .7], [.7, .3]] = [[.55, .45], [.575, .425]]
    assert rows.to_dict("records") == [
        {"id": "t1", "method": ENSEMBLE_METHOD, "fraction": 0.5, "label": "pos",
         "prediction": "neg"},
        {"id": "t2", "method": ENSEMBLE_METHOD, "fraction": 0.5, "label": "neg",
         "prediction": "neg"}]


def test_no_row_without_both_members_and_a_clear_error_for_other_documents():
    rows, summaries = ensemble_rows(SUMMARIES[2:], PREDICTIONS, _arrays(), (0.5,))
    assert rows.empty and summaries == []
    other = PREDICTIONS.assign(id=["t2", "t9"])
    with pytest.raises(ArtifactError, match="other test documents"):
        ensemble_rows(SUMMARIES, other, _arrays(), (0.5,))


def test_stage_files_must_describe_the_same_documents():
    merged = merge_probabilities({"finetune": _arrays(), "baseline": {"classes": np.array([])},
                                  "other": _arrays()})
    assert list(merged["val_ids"]) == ["v1", "v2", "v3"]
    moved = {**_arrays(), "test_ids": np.array(["t1", "t3"])}
    with pytest.raises(ArtifactError, match="test_ids"):
        merge_probabilities({"finetune": _arrays(), "baseline": moved})


def test_a_models_columns_are_put_in_the_training_splits_class_order():
    got = class_columns(np.array([[0.7, 0.3]]), ["c", "a"], ["a", "b", "c"])
    np.testing.assert_array_equal(got, np.array([[0.3, 0.0, 0.7]], np.float32))
    with pytest.raises(ValueError, match="'z'"):
        class_columns(np.array([[1.0]]), ["z"], ["a"])
