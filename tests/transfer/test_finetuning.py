"""The fair fine-tuning protocol: update budget, selection on validation only, staged unfreezing,
frozen features, and one grid and budget for every neural method."""

import random
import threading
import types

import keras
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from selfsup_model.config import FinetuneConfig, ModelConfig
from selfsup_model.errors import UserError
from selfsup_model.nn.model import build_backbone
from selfsup_model.pretraining.devices import gpu_available
from selfsup_model.report.metrics import macro_f1
from selfsup_model.text.specials import BOS_ID, CLS_ID, PAD_ID, SEP_ID
from selfsup_model.text.windows import first_windows
from selfsup_model.transfer.classify import build_classifier, is_causal, predict_classes
from selfsup_model.transfer.features import frozen_features
from selfsup_model.transfer.finetuning import (
    ClassifierRun,
    Stage,
    StageTrainers,
    _backbone_of,
    check_points,
    plan_stages,
    train_classifier,
    update_budget,
)
from selfsup_model.transfer.protocol import (
    EncodedWindows,
    LabelledData,
    LabelledSplit,
    NeuralMethod,
    features_probe,
    train_neural_methods,
)
from tests.library.toy import make_docs
from tests.nn.legacy_models import with_plain_keras_dropout

VOCAB, MAX_LEN = 20, 8
CFG = FinetuneConfig(batch_size=8, epochs=2, min_updates=8, max_updates=24, evals=4, patience=2,
                     dropout=0.0, encoder_dropout=0.0, learning_rates=(3e-4, 1e-3))


def backbone(layers: int = 1, dropout: float = 0.0) -> keras.Model:
    return build_backbone(VOCAB, MAX_LEN, ModelConfig(hidden=8, layers=layers, heads=2, ff=16,
                                                      dropout=dropout, norm="pre"))


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    keras.utils.set_random_seed(0)
    path = tmp_path_factory.mktemp("enc") / "encoder.keras"
    backbone(layers=2).save(path)
    return lambda: keras.saving.load_model(path, safe_mode=True)


def weights_of(model: keras.Model, layer: str) -> list[np.ndarray]:
    return [np.array(w) for w in model.get_layer("backbone").get_layer(layer).get_weights()]


def test_update_budget_has_a_floor_and_a_ceiling():
    assert update_budget(16, CFG) == 8  # 2 epochs of 2 batches = 4, lifted to the floor
    assert update_budget(80, CFG) == 20  # 2 epochs of 10 batches
    assert update_budget(10_000, CFG) == 24  # capped


def test_check_points_by_hand():
    assert check_points([120], 4) == [[30, 60, 90, 120]]
    assert check_points([10], 4) == [[3, 5, 8, 10]]  # ceil(2.5), 5, ceil(7.5), 10
    # staged thirds of 200 with 8 checks: quotas 2.64, 2.64, 2.72 -> 2, 2, 2, and the two
    # largest remainders (the third stage, then the first of the tied two) get one more
    assert check_points([66, 66, 68], 8) == [[22, 44, 66], [33, 66], [23, 46, 68]]
    assert check_points([1, 1, 98], 3) == [[1], [1], [98]]  # at least one check per stage
    assert check_points([2, 2, 2], 1) == [[2], [2], [2]]  # one per stage even when evals is less
    assert check_points([2], 4) == [[1, 2]]  # never more checks than updates
    with pytest.raises(ValueError):
        check_points([0, 5], 2)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 400), min_size=1, max_size=3), st.integers(1, 12))
def test_check_points_give_every_mode_the_same_number_of_checks(updates, evals):
    points = check_points(updates, evals)
    for stage, p in zip(updates, points):
        assert p[-1] == stage and p == sorted(set(p)) and p[0] >= 1  # rising, ends the stage
    if all(u >= evals for u in updates):
        assert sum(map(len, points)) == max(evals, len(updates))
    # a staged run gets as many checks as a one-stage run over the same budget (unless evals
    # is below its one check per stage)
    whole = sum(updates)
    if evals >= len(updates) and min(updates) >= evals:
        assert sum(map(len, points)) == len(check_points([whole], evals)[0])


def test_a_staged_run_checks_validation_as_often_as_a_full_one(pretrained):
    cfg = CFG.model_copy(update={"patience": 100})  # no early stop: count every check
    train, val = make_docs(32, 1), make_docs(16, 2)
    runs = {mode: train_classifier(pretrained, train, val, 2, mode, cfg, seed=0,
                                   learning_rate=3e-3) for mode in ("full", "staged")}
    budget = update_budget(32, cfg)
    assert [h["update"] for h in runs["full"].history] == [2, 4, 6, 8]
    assert len(runs["staged"].history) == len(runs["full"].history) == cfg.evals
    assert runs["staged"].history[-1]["update"] == budget
    with pytest.raises(UserError, match="at least 3 updates"):
        plan_stages("staged", 2, 1e-3, cfg)


def test_selection_uses_validation_only(pretrained):
    train, val = make_docs(32, 1), make_docs(16, 2)
    runs = [train_classifier(pretrained, train, val, 2, "full", CFG, seed=3, learning_rate=3e-3,
                             eval_sets={"test": make_docs(10 + k, 5 + k)[0]}) for k in (0, 1)]
    a, b = runs
    # Different test sets, same training and selection: test data played no part in it.
    assert a.history == b.history and a.best_update == b.best_update
    np.testing.assert_array_equal(a.val_predictions, b.val_predictions)
    assert a.val_macro_f1 == max(h["val_macro_f1"] for h in a.history)
    assert macro_f1(val[1], predict_classes(a.model, val[0])) == a.val_macro_f1
    assert 0 < a.updates_run <= update_budget(32, CFG)


def test_staged_unfreezing_trains_head_then_top_block_then_all(pretrained):
    keras.utils.set_random_seed(0)
    encoder = pretrained()
    model = build_classifier(encoder, 2, dropout=0.0)
    train, val = make_docs(32, 1), make_docs(16, 2)
    run = ClassifierRun(model, encoder, train, val, CFG, np.random.default_rng(0))
    lower, upper = (lambda: weights_of(model, "block_0")), (lambda: weights_of(model, "block_1"))
    low0, up0, head0 = lower(), upper(), model.get_layer("head_logits").get_weights()
    run.train_stage(Stage("head", 8, 3e-2), [4, 8])
    # Head alone, on frozen features: no encoder weight moved; the head did.
    assert all(np.array_equal(x, y) for x, y in zip(lower() + upper(), low0 + up0))
    assert not np.array_equal(model.get_layer("head_logits").get_weights()[0], head0[0])
    low1, up1 = lower(), upper()
    run.best_f1 = -1.0  # make the stage's weights stay, whatever validation says
    run.train_stage(Stage("top", 8, 3e-2), [4, 8])
    assert all(np.array_equal(x, y) for x, y in zip(lower(), low1))  # the lower block is frozen
    assert not all(np.array_equal(x, y) for x, y in zip(upper(), up1))  # the top block learned
    assert [s["stage"] for s in run.stages] == ["head", "top"]


def test_staged_mode_records_its_stages_and_keeps_only_helpful_ones(pretrained):
    result = train_classifier(pretrained, make_docs(32, 1), make_docs(16, 2), 2, "staged", CFG,
                              seed=0, learning_rate=3e-3)
    assert [s["stage"] for s in result.stages] == ["head", "top", "all"]
    assert sum(s["updates"] for s in result.stages) == update_budget(32, CFG)
    assert result.stages[2]["learning_rate"] == pytest.approx(3e-3 * CFG.staged_final_lr_scale)
    assert result.stages[0]["kept"]  # the first stage always improves on nothing
    best = -1.0
    for stage in result.stages:  # a stage is kept exactly when it raised the best so far
        assert stage["kept"] == (stage["val_macro_f1"] > best)
        best = max(best, stage["val_macro_f1"])
    assert result.val_macro_f1 == best


def test_layer_wise_decay_slows_the_layers_below_the_head(pretrained):
    # decay 1e-3: the embeddings (two layers below the top of a one-block encoder) learn at
    # 1e-6 times the rate, so they stay where pretraining left them while the head trains.
    docs, val = make_docs(32, 1), make_docs(16, 2)
    start = pretrained().get_layer("embeddings").get_weights()
    runs = {decay: train_classifier(pretrained, docs, val, 2, "full", CFG, seed=0,
                                    learning_rate=3e-3, layer_decay=decay)
            for decay in (1.0, 1e-3)}
    for decay, result in runs.items():
        assert result.layer_decay == decay and result.stages[0]["layer_decay"] == decay
        moved = [np.abs(a - b).max() for a, b in zip(
            _backbone_of(result.model).get_layer("embeddings").get_weights(), start)]
        assert (max(moved) < 1e-5) == (decay < 1), (decay, moved)
    head = [r.model.get_layer("head_logits").get_weights()[0] for r in runs.values()]
    assert not np.allclose(head[1], 0) and not np.array_equal(head[0], head[1])


def test_frozen_features_are_computed_in_inference_mode():
    keras.utils.set_random_seed(0)
    encoder = backbone(dropout=0.5)  # dropout would change every call in training mode
    ids = make_docs(20, 4)[0]
    first, second = frozen_features(encoder, ids), frozen_features(encoder, ids)
    np.testing.assert_array_equal(first, second)
    assert first.shape == (20, 8) and first.dtype == np.float32
    noisy = [np.asarray(encoder(ids, training=True)).mean() for _ in range(2)]
    assert noisy[0] != noisy[1]  # the same encoder in training mode is not deterministic


def test_scratch_starts_from_fresh_weights_of_the_same_architecture(tmp_path):
    marked = backbone(layers=2)
    marked.set_weights([np.full_like(w, 0.5) for w in marked.get_weights()])
    marked.save(tmp_path / "encoder.keras")
    result = train_classifier(lambda: keras.saving.load_model(tmp_path / "encoder.keras",
                                                              safe_mode=True),
                              make_docs(16, 1), make_docs(8, 2), 2, "scratch", CFG, seed=1,
                              learning_rate=1e-9)
    trained = result.model.get_layer("backbone").get_weights()
    assert [w.shape for w in trained] == [w.shape for w in marked.get_weights()]
    assert not any(np.allclose(w, 0.5) for w in trained if w.size > 1)


def test_errors_are_clear(pretrained):
    ids, y = make_docs(8, 1)
    with pytest.raises(UserError, match="single label"):
        train_classifier(pretrained, (ids, np.zeros(8, int)), (ids, y), 2, "full", CFG, 0, 1e-3)
    with pytest.raises(UserError, match="unknown fine-tuning mode"):
        train_classifier(pretrained, (ids, y), (ids, y), 2, "linear", CFG, 0, 1e-3)
    # validation windows of 4 documents: each needs its document, in order, and each document
    # a window
    for owner in ([0, 0, 1, 1, 3, 3, 3, 3], [0, 0, 2, 2, 1, 1, 3, 3], [0, 1, 2, 3]):
        with pytest.raises(UserError, match="each of its 8 windows needs its document"):
            train_classifier(pretrained, (ids, y), (ids, y[:4]), 2, "full", CFG, 0, 1e-3,
                             val_owner=np.array(owner))


def _first_class(n: int) -> np.ndarray:
    """Class probabilities of two classes that predict the first for each of `n` rows, as a
    fake classifier run hands them back."""
    return np.tile(np.array([1.0, 0.0], np.float32), (n, 1))


def _labelled_data() -> LabelledData:
    """Two classes; 40 training, 10 validation and 6 test documents."""
    docs = {s: make_docs(n, k) for s, n, k in (("train", 40, 0), ("val", 10, 1), ("test", 6, 2))}
    splits = {s: LabelledSplit(np.array([f"{s}{i}" for i in range(len(y))]),
                               np.where(y == 1, "b", "a"), ids) for s, (ids, y) in docs.items()}
    return LabelledData(["a", "b"], splits, {}, MAX_LEN)


def test_other_seeds_repeat_the_point_the_first_seeds_grid_chose(monkeypatch):
    # Validation favours the middle rate with layer-wise decay 0.8, and among seeds the last:
    # the repeats must run that point (not the grid's last one), and the reported seed is the
    # one best on validation.
    val_f1 = {1e-4: 0.2, 1e-3: 0.5, 1e-2: 0.3}
    calls = []

    class Fake:
        def __init__(self, seed, lr, decay):
            self.val_macro_f1 = val_f1[lr] + 0.05 * (decay == 0.8 and lr == 1e-3) + 0.01 * seed
            self.learning_rate, self.layer_decay = lr, decay
            self.updates_run = self.best_update = 1
            self.stages, self.model = [], None
            self.val_probabilities = _first_class(10)

        def probabilities(self, ids, owner=None):
            return _first_class(len(ids))

    def fake_train(factory, train, val, num_classes, mode, cfg, seed, learning_rate, trainers,
                   budget_documents, val_owner, layer_decay):
        calls.append((seed, learning_rate, layer_decay))
        return Fake(seed, learning_rate, layer_decay)

    monkeypatch.setattr("selfsup_model.transfer.protocol.train_classifier", fake_train)
    cfg = FinetuneConfig(fractions=(1.0,), learning_rates=(1e-4, 1e-3, 1e-2), seeds=(5, 0, 7),
                         layer_decays=(1.0, 0.8))
    results, _ = train_neural_methods(_labelled_data(), [NeuralMethod("m", "full", object)], cfg)
    assert calls == [(5, 1e-4, 1.0), (5, 1e-3, 1.0), (5, 1e-2, 1.0),
                     (5, 1e-4, 0.8), (5, 1e-3, 0.8), (5, 1e-2, 0.8), (0, 1e-3, 0.8),
                     (7, 1e-3, 0.8)]
    (summary,) = results.summaries
    assert summary["selected"] == {"learning_rate": 1e-3, "layer_decay": 0.8, "seed": 7}
    assert [(g["seed"], g["learning_rate"], g["layer_decay"])
            for g in summary["grid"]] == calls


def test_every_neural_method_gets_the_same_grid_budget_and_subsets(monkeypatch):
    calls, predicted = [], []

    class Fake:
        def __init__(self, lr):
            self.val_macro_f1, self.learning_rate = lr, lr  # the larger rate "wins" validation
            self.layer_decay = 1.0
            self.updates_run = self.best_update = 1
            self.stages, self.model = [], None
            self.val_probabilities = _first_class(10)

        def probabilities(self, ids, owner=None):
            predicted.append((len(ids), self.learning_rate))
            return _first_class(len(ids))

    def fake_train(factory, train, val, num_classes, mode, cfg, seed, learning_rate, trainers,
                   budget_documents, val_owner, layer_decay):
        assert layer_decay == 1.0
        assert budget_documents == len(train[1])  # one window per document here
        calls.append((factory(), mode, len(train[1]), tuple(train[1]), cfg, seed, learning_rate))
        return Fake(learning_rate)

    monkeypatch.setattr("selfsup_model.transfer.protocol.train_classifier", fake_train)
    data = _labelled_data()
    cfg = FinetuneConfig(fractions=(0.25, 1.0), learning_rates=(1e-3, 3e-3), seeds=(0, 1),
                         repeat_seeds_up_to=0.25)
    methods = [NeuralMethod(name, mode, lambda name=name: name) for name, mode in
               (("pretrained_full", "full"), ("pretrained_staged", "staged"),
                ("random_init", "scratch"), ("bag_of_embeddings", "scratch"))]
    results, kept = train_neural_methods(data, methods, cfg)
    by_method = {}
    for name, mode, n, labels, run_cfg, seed, lr in calls:
        by_method.setdefault(name, []).append((n, labels, id(run_cfg), seed, lr))
    runs = list(by_method.values())
    assert len(runs) == 4 and all(r == runs[0] for r in runs)  # identical runs for every method
    # 0.25: the first seed x two rates, then the second seed at the rate validation chose;
    # 1.0: the first seed x two rates.
    assert [(n, seed, lr) for n, _, _, seed, lr in runs[0]] == [
        (10, 0, 1e-3), (10, 0, 3e-3), (10, 1, 3e-3), (40, 0, 1e-3), (40, 0, 3e-3)]
    at_quarter = [s for s in results.summaries if s["fraction"] == 0.25]
    assert all([(g["seed"], g["learning_rate"]) for g in s["grid"]] ==
               [(0, 1e-3), (0, 3e-3), (1, 3e-3)] for s in at_quarter)
    assert {s["selected"]["learning_rate"] for s in results.summaries} == {3e-3}
    assert {s["budget_updates"] for s in results.summaries if s["fraction"] == 1.0} == \
        {update_budget(40, cfg)}
    assert len(results.seed_rows) == 4 * (2 + 1) * 6 and set(kept) == {m.name for m in methods}
    # The test set is predicted once per method, fraction and seed, by the rate validation chose.
    assert predicted == [(6, 3e-3)] * 4 * (2 + 1)


@pytest.mark.parametrize("read_windows", ["all", "first"])
def test_classifiers_read_every_window_of_their_documents(monkeypatch, read_windows):
    # Encode's windows of four documents; the second is unlabelled. Each row's first token
    # names it: document 0 owns rows 10 and 11, document 2 row 30, document 3 rows 40-42. The
    # same documents serve as training, validation and test split.
    rows = [[CLS_ID, 10, SEP_ID, PAD_ID, PAD_ID], [CLS_ID, 11, SEP_ID, PAD_ID, PAD_ID],
            [CLS_ID, 20, SEP_ID, PAD_ID, PAD_ID], [CLS_ID, 30, SEP_ID, PAD_ID, PAD_ID],
            [CLS_ID, 40, SEP_ID, PAD_ID, PAD_ID], [CLS_ID, 41, SEP_ID, PAD_ID, PAD_ID],
            [CLS_ID, 42, 43, 44, SEP_ID]]  # cut to 4 tokens like every window
    windows, offsets = np.array(rows, np.int32), np.array([0, 2, 3, 4, 7])
    labelled = np.array([0, 2, 3])
    split = LabelledSplit(np.array(["d0", "d2", "d3"]), np.array(["a", "b", "a"]),
                          first_windows(windows, offsets, labelled, max_len=4),
                          EncodedWindows(windows, offsets, labelled))
    data = LabelledData(["a", "b"], {"train": split, "val": split, "test": split}, {}, 5)
    seen, tested = [], []

    class Fake:
        val_macro_f1, learning_rate, updates_run, best_update = 0.5, 1e-3, 1, 1
        layer_decay = 1.0
        stages, model = [], None
        val_probabilities = _first_class(3)

        def probabilities(self, ids, owner=None):
            tested.append((ids.tolist(), owner.tolist()))
            return _first_class(owner[-1] + 1)

    def fake_train(factory, train, val, num_classes, mode, cfg, seed, learning_rate, trainers,
                   budget_documents, val_owner, layer_decay):
        seen.append((train[0].tolist(), train[1].tolist(), budget_documents, val[0].tolist(),
                     val[1].tolist(), val_owner.tolist()))
        return Fake()

    monkeypatch.setattr("selfsup_model.transfer.protocol.train_classifier", fake_train)
    cfg = FinetuneConfig(fractions=(1.0,), learning_rates=(1e-3,), read_windows=read_windows)
    results, _ = train_neural_methods(data, [NeuralMethod("m", "full", object)], cfg)
    if read_windows == "all":
        read = [[CLS_ID, 10, SEP_ID, PAD_ID], [CLS_ID, 11, SEP_ID, PAD_ID],
                [CLS_ID, 30, SEP_ID, PAD_ID], [CLS_ID, 40, SEP_ID, PAD_ID],
                [CLS_ID, 41, SEP_ID, PAD_ID], [CLS_ID, 42, 43, SEP_ID]]
        owner = [0, 0, 1, 2, 2, 2]
    else:
        read = [[CLS_ID, 10, SEP_ID, PAD_ID], [CLS_ID, 30, SEP_ID, PAD_ID],
                [CLS_ID, 40, SEP_ID, PAD_ID]]
        owner = [0, 1, 2]
    # training rows carry their document's label; the budget counts the 3 documents either way;
    # validation and test are read alike, one label and one prediction per document
    labels = [[0, 1, 0][d] for d in owner]
    assert seen == [(read, labels, 3, read, [0, 1, 0], owner)]
    assert tested == [(read, owner)]
    (summary,) = results.summaries
    assert (summary["n_train"], summary["n_train_windows"]) == (3, len(owner))


def test_the_probe_trains_on_the_rows_of_its_subsets_documents(monkeypatch):
    # Six training rows (windows) of three documents; each fraction's logistic regression sees
    # the rows of its documents with their labels, standardised over those rows alone.
    train = LabelledSplit(np.array(["d0", "d1", "d2"]), np.array(["a", "b", "a"]),
                          np.zeros((3, 4), np.int32))
    other = LabelledSplit(np.array(["v0"]), np.array(["a"]), np.zeros((1, 4), np.int32))
    data = LabelledData(["a", "b"], {"train": train, "val": other, "test": other}, {}, 4)
    features = {"train": np.array([[0.0], [2.0], [4.0], [6.0], [8.0], [10.0]], np.float32),
                "val": np.array([[7.0], [7.0]], np.float32), "test": np.array([[5.0]], np.float32)}
    owner = np.array([0, 0, 1, 2, 2, 2])
    monkeypatch.setattr("selfsup_model.transfer.protocol.label_subsets", lambda data, cfg: iter(
        [(0.5, np.array([1, 2])), (1.0, np.array([0, 1, 2]))]))
    seen = []

    def fake_logreg(x, y, val_x, val_y, evals, c_grid, what, val_owner, eval_owners):
        assert val_owner.tolist() == [0, 0] and eval_owners["test"].tolist() == [0]
        seen.append((x.ravel().tolist(), list(y), val_x.ravel().tolist()))
        return types.SimpleNamespace(predictions={"test": ["a"]}, val_macro_f1=1.0,
                                     params={"C": 1.0}, fit_time_s=0.0, c_tried=(1.0,),
                                     model=types.SimpleNamespace(classes_=np.array(["a", "b"])),
                                     val_probabilities=_first_class(1),
                                     probabilities={"test": _first_class(1)})

    monkeypatch.setattr("selfsup_model.transfer.protocol.logreg_on_features", fake_logreg)
    cfg = FinetuneConfig(fractions=(0.5, 1.0))
    results = features_probe("probe", data, features, (1.0,), cfg, standardize=True,
                             owners={"train": owner, "val": np.array([0, 0]),
                                     "test": np.array([0])})
    half, whole = seen
    s5, s70 = np.sqrt(5.0), np.sqrt(70.0 / 6)  # standard deviations of 4,6,8,10 and 0..10
    assert half[1] == ["b", "a", "a", "a"] and whole[1] == ["a", "a", "b", "a", "a", "a"]
    np.testing.assert_allclose(half[0], [(v - 7) / s5 for v in (4, 6, 8, 10)], rtol=1e-6)
    np.testing.assert_allclose(whole[0], [(v - 5) / s70 for v in (0, 2, 4, 6, 8, 10)], rtol=1e-6)
    np.testing.assert_allclose([half[2], whole[2]], [[0.0, 0.0], [2 / s70] * 2], rtol=1e-6,
                               atol=1e-7)
    assert [(r["n_train"], r["n_train_windows"]) for r in results.summaries] == [(2, 4), (3, 6)]


def test_a_causal_encoder_fine_tunes_causally_on_bos_eos_windows(monkeypatch):
    causal = build_backbone(VOCAB, MAX_LEN, ModelConfig(hidden=8, layers=1, heads=2, ff=16,
                                                        dropout=0.0), causal=True)
    seen = []
    original = ClassifierRun.__init__

    def spy(self, model, backbone, train, val, *args, **kwargs):
        seen.append(train[0])
        original(self, model, backbone, train, val, *args, **kwargs)

    monkeypatch.setattr(ClassifierRun, "__init__", spy)
    ids, y = make_docs(16, 1)
    for mode in ("full", "scratch"):  # pretrained clm, and random_init of the same architecture
        result = train_classifier(lambda: causal, (ids, y), make_docs(8, 2), 2, mode,
                                  CFG.model_copy(update={"pooling": "last"}), 0, 1e-3)
        assert is_causal(result.model.get_layer(causal.name))
    for windows in seen:  # the encoder read [BOS] ... [EOS], never [CLS]/[SEP]
        assert (windows[:, 0] == BOS_ID).all() and not np.isin(windows, [CLS_ID, SEP_ID]).any()


def test_a_run_through_shared_compiled_trainers_does_not_depend_on_earlier_runs(pretrained):
    # Staged: its stages go through all three kinds of trainer, ``all`` (full's) included.
    mode = "staged"
    train, val, test = make_docs(32, 1), make_docs(16, 2), {"test": make_docs(12, 3)[0]}
    cfg = CFG.model_copy(update={"dropout": 0.3})  # dropout draws must restart with the run
    alone = train_classifier(pretrained, train, val, 2, mode, cfg, 1, 3e-3, test)
    shared = StageTrainers()
    train_classifier(pretrained, make_docs(24, 7), val, 2, mode, cfg, 5, 1e-2, test,
                     trainers=shared)  # another seed, rate and subset first
    after = train_classifier(pretrained, train, val, 2, mode, cfg, 1, 3e-3, test, trainers=shared)
    assert after.history == alone.history and after.stages == alone.stages
    np.testing.assert_array_equal(after.predictions["test"], alone.predictions["test"])
    for a, b in zip(after.model.get_weights(), alone.model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    # The run's model is its own: a later run through the same trainers leaves it alone.
    kept = [w.copy() for w in after.model.get_weights()]
    train_classifier(pretrained, make_docs(24, 8), val, 2, mode, cfg, 2, 1e-2, test,
                     trainers=shared)
    assert all(np.array_equal(a, b) for a, b in zip(kept, after.model.get_weights()))
    # ... and so are its predictions, asked for after that run (as the test set is).
    np.testing.assert_array_equal(after.predict(test["test"]), alone.predictions["test"])


def test_a_run_does_not_read_what_other_threads_draw_from_pythons_random(pretrained):
    """MLflow's and Prefect's background threads draw from Python's global `random`; Keras
    would seed a layer built without a seed from it, so a run must seed every layer itself
    (a fresh encoder's weights too: test_model's seeded re-initialisation)."""
    train, val, test = make_docs(32, 1), make_docs(16, 2), {"test": make_docs(12, 3)[0]}
    cfg = CFG.model_copy(update={"dropout": 0.3, "encoder_dropout": 0.1})

    def run() -> list:
        result = train_classifier(pretrained, train, val, 2, "full", cfg, 1, 3e-3, test)
        return [result.history, result.predictions["test"].tolist(),
                [w.tolist() for w in result.model.get_weights()]]

    quiet = run()
    stop = threading.Event()

    def draw() -> None:  # a draw every millisecond, as long as the run lasts
        while not stop.wait(0.001):
            random.random()

    drawer = threading.Thread(target=draw, daemon=True)
    drawer.start()
    try:
        busy = run()
    finally:
        stop.set()
        drawer.join()
    assert busy == quiet


def test_finetune_jit_setting_reaches_the_compiled_trainers_and_changes_no_result(pretrained):
    train, val, test = make_docs(32, 1), make_docs(16, 2), {"test": make_docs(12, 3)[0]}
    # With dropout in the head and the encoder: FastDropout draws the same masks either way.
    cfg = CFG.model_copy(update={"dropout": 0.1, "encoder_dropout": 0.1})
    runs = {}
    for jit in ("off", "on"):
        trainers = StageTrainers()
        runs[jit] = train_classifier(pretrained, train, val, 2, "full",
                                     cfg.model_copy(update={"jit": jit}), 1, 3e-3, test,
                                     trainers=trainers)
        assert trainers.trainer("all", runs[jit].model, CFG).jit_compile is (jit == "on")
    assert runs["on"].history == runs["off"].history  # XLA reorders float sums, nothing more
    np.testing.assert_array_equal(runs["on"].predictions["test"], runs["off"].predictions["test"])
    for a, b in zip(runs["on"].model.get_weights(), runs["off"].model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


def test_xla_on_a_cpu_is_warned_about_only_for_keras_own_dropout(caplog):
    """TensorFlow's random ops under XLA on a CPU are slow; our FastDropout draws by a hash.

    A backbone saved before FastDropout existed has a plain keras Dropout: that one is named."""
    warned = keras.backend.backend() == "tensorflow" and not gpu_available()
    ours = build_classifier(backbone(dropout=0.1), 2, "mean", 0.1)
    old = build_classifier(with_plain_keras_dropout(backbone(dropout=0.1)), 2, "mean", 0.1)
    with caplog.at_level("WARNING", logger="selfsup.finetuning"):
        for model, jit in ((ours, "on"), (old, "off"), (old, "on")):
            StageTrainers().trainer("all", model, CFG.model_copy(update={"jit": jit}))
    slow = [r.getMessage() for r in caplog.records if "XLA on a CPU" in r.getMessage()]
    expected = ("XLA on a CPU with keras dropout layers embeddings_dropout: TensorFlow's random "
                "draws under XLA make each step slower than without XLA; set their rate to 0 or "
                "turn jit off")
    assert slow == ([expected] if warned else [])


def test_validation_scores_only_labels_training_has_for_every_method():
    # v2's label "z" is not a training class: no classifier can predict it, so it would add a
    # zero-F1 class to the macro average. The probe, TF-IDF and majority leave it out, as the
    # neural methods do (a perfect prediction of v0 and v1 scores 1.0, not 2/3).
    import pandas as pd

    from selfsup_model.config import BaselineConfig
    from selfsup_model.transfer.protocol import text_baselines

    ids = {"train": ["d0", "d1", "d2", "d3"], "val": ["v0", "v1", "v2"], "test": ["t0", "t1"]}
    labels = {"train": ["a", "a", "b", "b"], "val": ["a", "b", "z"], "test": ["a", "b"]}
    splits = {s: LabelledSplit(np.array(ids[s]), np.array(labels[s]),
                               np.zeros((len(ids[s]), 4), np.int32)) for s in ids}
    data = LabelledData(["a", "b"], splits, {}, 4)
    np.testing.assert_array_equal(data.scorable("val"), [0, 1])
    cfg = FinetuneConfig(fractions=(1.0,))
    side = {"a": -1.0, "b": 1.0, "z": 0.1}
    features = {s: np.array([[side[y]] for y in labels[s]], np.float32) for s in ids}
    (probe,) = features_probe("probe", data, features, (1.0,), cfg).summaries
    assert probe["val_macro_f1"] == 1.0
    # the same with several rows per document: v2's two rows are dropped, v0 and v1 kept
    rows = {s: np.repeat(features[s], 2, axis=0) for s in ids}
    owners = {s: np.repeat(np.arange(len(ids[s])), 2) for s in ids}
    (probe,) = features_probe("probe", data, rows, (1.0,), cfg, owners=owners).summaries
    assert probe["val_macro_f1"] == 1.0
    words = {"a": "apple pie", "b": "banana split", "z": "cherry tart"}
    texts = pd.Series({i: words[y] for s in ids for i, y in zip(ids[s], labels[s])})
    baseline = BaselineConfig(tfidf_c=(10.0,), tfidf_ngram_max=(1,))
    found = {r["method"]: r["val_macro_f1"] for r in text_baselines(data, texts, baseline,
                                                                       cfg).summaries}
    assert found["tfidf_logreg"] == 1.0
    assert found["majority"] == pytest.approx(1 / 3)  # "a" for both: F1 2/3 on a, 0 on b


def test_random_init_is_built_in_the_precision_pretraining_builds_the_encoder_in(tmp_path):
    # On a GPU `auto` pretrains in mixed bf16; random_init must not fine-tune in float32 beside
    # it. Forced here with pretrain.mixed_precision=bf16 (what `auto` resolves to on a GPU).
    from selfsup_model.config import TokenizerConfig
    from selfsup_model.presets import build_config
    from selfsup_model.pretraining.devices import resolve_precision
    from selfsup_model.text.tokenization import fit_tokenizer, load_tokenizer, save_tokenizer
    from tasks.baseline import _neural_methods
    from tasks.stage import RunContext

    tokenizer = tmp_path / "tokenizer.json"
    save_tokenizer(fit_tokenizer(["one two three four", "five six seven"] * 4,
                                 TokenizerConfig(vocab_size=64, min_frequency=1)), tokenizer)
    data = LabelledData(["a", "b"], {}, {}, MAX_LEN)
    for setting in ("bf16", "off"):
        config = build_config("tiny", overrides=[f"pretrain.mixed_precision={setting}"])
        methods = _neural_methods(RunContext(tmp_path, config), data, tokenizer)
        (random_init,) = [m for m in methods if m.name == "random_init"]
        vocab = load_tokenizer(tokenizer).get_vocab_size()
        pretrained = build_backbone(vocab, MAX_LEN, config.model,
                                    dtype=resolve_precision(setting))  # as pretraining builds it
        policies = {layer.dtype_policy.name for layer in random_init.factory().layers[1:]}
        assert policies == {layer.dtype_policy.name for layer in pretrained.layers[1:]}
        assert ("mixed_bfloat16" in policies) == (setting == "bf16")
