"""The classifier a run hands over, and how new text reaches it.

The finetune stage keeps one classifier: of the pretrained encoder's methods
(linear probe, full fine-tuning, staged unfreezing), the one with the highest
validation macro-F1 at the largest label fraction; test metrics play no part.
It writes a bundle beside it, so inference needs nothing else from the run:

    classifier.keras   ids (B, L) -> class logits (B, C)
    tokenizer.json     the tokenizer the encoder was trained with
    classifier.json    labels in class order, how text becomes ids (encode
                       settings, classifier length, causal framing, windows
                       read), what was kept and why, and the sha256 of the
                       two files above

New text takes the training path exactly: `normalize_document`, the run's
tokenizer, `encode_split`, the classifier's length and framing, and the run's
reading of a document (`finetune.read_windows`): every window, a document's
probabilities the mean of its windows', or the first window only. Loading
checks both hashes before opening anything, and opens the Keras file with
`safe_mode=True`.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from selfsup_model.artifacts import (
    atomic_path,
    atomic_write_json,
    read_manifest,
    save_keras_atomic,
    sha256_file,
    verify_outputs,
)
from selfsup_model.config import EncodeConfig
from selfsup_model.corpus.ingest import normalize_document
from selfsup_model.errors import ArtifactError, UserError
from selfsup_model.report.effects import tie_rank
from selfsup_model.text.encoding import encode_split
from selfsup_model.text.tokenization import load_tokenizer
from selfsup_model.text.windows import (
    document_windows,
    first_windows,
    frame_windows,
    mean_over_documents,
    softmax,
)

if TYPE_CHECKING:  # Keras is imported where a Keras model is built or loaded: an ONNX bundle
    import keras  # scores without it (the ONNX pyfunc needs neither Keras nor TensorFlow)

CLASSIFIER_FILE = "classifier.keras"
TOKENIZER_FILE = "tokenizer.json"
SPEC_FILE = "classifier.json"
BUNDLE_FILES = (CLASSIFIER_FILE, TOKENIZER_FILE, SPEC_FILE)
SPEC_VERSION = 1
_CHUNK_DOCS = 4096  # documents tokenised and windowed at a time: bounds memory on long inputs


@dataclasses.dataclass(frozen=True)
class KeptCandidate:
    """One method's selected classifier at the largest label fraction."""

    method: str
    fraction: float
    val_macro_f1: float
    selected: dict[str, Any]  # e.g. {"learning_rate": 1e-3, "seed": 0} or {"C": 1.0}
    build: Callable[[], keras.Model]  # the Keras classifier (built only if kept)


def choose_kept(candidates: Sequence[KeptCandidate]) -> KeptCandidate:
    """Highest validation macro-F1; a tie goes to the cheaper method (`effects.tie_rank`, as the
    report's best pretrained method), then to the earlier candidate."""
    if not candidates:
        raise ValueError("no classifier to keep")
    return min(candidates, key=lambda c: (-c.val_macro_f1, tie_rank(c.method)))


def probe_classifier(backbone: keras.Model, pooling: str, model: Any, mean: np.ndarray,
                     scale: np.ndarray, classes: Sequence[str]) -> keras.Model:
    """The frozen-feature probe as one Keras classifier: ids (B, L) -> logits (B, C).

    The logistic regression saw standardised features z = (x - mean) / scale,
    so its logits W z + b are folded into one Dense layer on the pooled states x:
    kernel W / scale, bias b - (W / scale) . mean (computed in float64). A binary
    regression has one logit z; [0, z] gives the same softmax (its sigmoid).
    """
    fitted = [str(c) for c in model.classes_]
    if fitted != list(classes):
        raise ValueError(f"probe classes {fitted} differ from the run's {list(classes)}")
    coef = np.asarray(model.coef_, np.float64)  # (C or 1, d)
    intercept = np.asarray(model.intercept_, np.float64)  # (C or 1,)
    if len(classes) == 2 and coef.shape[0] == 1:
        coef = np.vstack([np.zeros_like(coef), coef])
        intercept = np.concatenate([[0.0], intercept])
    import keras

    from selfsup_model.transfer.classify import build_pooling

    weights = coef / np.asarray(scale, np.float64)[None, :]  # (C, d)
    bias = intercept - weights @ np.asarray(mean, np.float64)  # (C,)
    ids = keras.Input(shape=(None,), dtype="int32", name="token_ids")
    pooled = build_pooling(pooling, backbone)(backbone(ids), ids)  # (B, H)
    head = keras.layers.Dense(len(classes), name="head_logits")
    logits = head(pooled)  # (B, C)
    head.set_weights([weights.T.astype(np.float32), bias.astype(np.float32)])
    return keras.Model(ids, logits, name="probe_classifier")


def write_bundle(out_dir: Path, kept: KeptCandidate, model: keras.Model, tokenizer_path: Path,
                 classes: Sequence[str], encode: EncodeConfig, max_len: int | None,
                 pooling: str, backbone: keras.Model, read_windows: str = "all") -> list[str]:
    """Write classifier.keras, tokenizer.json and classifier.json (last); return their names."""
    from selfsup_model.transfer.classify import is_causal

    out_dir = Path(out_dir)
    save_keras_atomic(model, out_dir / CLASSIFIER_FILE)
    with atomic_path(out_dir / TOKENIZER_FILE) as tmp:
        shutil.copyfile(tokenizer_path, tmp)
    atomic_write_json(out_dir / SPEC_FILE, {
        "version": SPEC_VERSION,
        "kept": {"method": kept.method, "fraction": kept.fraction,
                 "val_macro_f1": kept.val_macro_f1, "selected": kept.selected,
                 "why": "highest validation macro-F1 at the largest label fraction among the "
                        "pretrained encoder's methods (test data not consulted)"},
        "classes": list(classes),
        "encode": encode.model_dump(mode="json"),
        "max_len": max_len,
        "read_windows": read_windows,
        "pooling": pooling,
        "objective": "clm" if is_causal(backbone) else "mlm",
        "causal": is_causal(backbone),
        "sha256": {name: sha256_file(out_dir / name) for name in (CLASSIFIER_FILE, TOKENIZER_FILE)},
    })
    return list(BUNDLE_FILES)


def write_no_classifier(out_dir: Path, reason: str) -> list[str]:
    """classifier.json saying why this run hands over no classifier."""
    atomic_write_json(Path(out_dir) / SPEC_FILE, {"version": SPEC_VERSION, "skipped": reason})
    return [SPEC_FILE]


@dataclasses.dataclass(frozen=True)
class EncodedTexts:
    ids: np.ndarray  # (m, L) int32 framed classifier inputs: windows of the texts with tokens
    owner: np.ndarray  # (m,) int64 the kept text of each row (its position in `kept`)
    kept: np.ndarray  # (k,) int64 indices into the texts
    empty: np.ndarray  # (e,) int64 indices of texts with no tokens


class ClassifierBundle:
    """A finished run's classifier with its tokenizer and spec, verified and loaded.

    The model is `classifier.keras` (Keras) or, in a bundle `selfsup export --format onnx`
    wrote, an ONNX file scored by ONNX Runtime (the spec's `model_file` names it); the text
    path is the same for both."""

    def __init__(self, directory: str | Path, spec: dict[str, Any], model: Any,
                 tokenizer: Any):
        self.directory, self.spec, self.model, self.tokenizer = (
            Path(directory), spec, model, tokenizer)
        self.classes: list[str] = list(spec["classes"])
        # A bundle from before `read_windows` read first windows only.
        self.every_window = spec.get("read_windows", "first") == "all"
        # The first window does not depend on how many follow: read no more than that.
        self.encode = EncodeConfig(**spec["encode"])
        if not self.every_window:
            self.encode = self.encode.model_copy(update={"max_windows_per_doc": 1})
        self.engine = "onnx" if str(spec.get("model_file", "")).endswith(".onnx") else "keras"
        self._scorer: Callable[[np.ndarray, int], np.ndarray] | None = None
        if self.engine == "onnx":
            from selfsup_model.serving.onnx_export import OnnxScorer

            self._scorer = OnnxScorer(self.directory / spec["model_file"])

    @classmethod
    def load(cls, directory: str | Path, spec_file: str = SPEC_FILE) -> ClassifierBundle:
        directory = Path(directory)
        spec = read_spec(directory, spec_file)
        model_file = spec.get("model_file", CLASSIFIER_FILE)
        tokenizer_file = spec.get("tokenizer_file", TOKENIZER_FILE)
        digests = spec.get("sha256") if isinstance(spec.get("sha256"), dict) else {}
        if unhashed := [n for n in (model_file, tokenizer_file) if n not in digests]:
            raise ArtifactError(f"{directory / spec_file} records no sha256 for {unhashed}: not "
                                "a bundle selfsup wrote; rerun the finetune stage")
        for name, digest in digests.items():
            path = directory / name
            if not path.is_file():
                raise ArtifactError(f"{path} is missing; rerun the finetune stage (or the "
                                    "export that wrote it)")
            if sha256_file(path) != digest:
                raise ArtifactError(f"{path} does not match the sha256 in {spec_file} "
                                    "(changed after it was written); rerun the finetune stage "
                                    "(or the export that wrote it)")
        if model_file.endswith(".onnx"):
            model = None
        else:
            from selfsup_model.nn.saving import load_keras_model

            model = load_keras_model(directory / model_file)
        return cls(directory, spec, model, load_tokenizer(directory / tokenizer_file))

    def onnx_engine(self) -> ClassifierBundle:
        """This bundle scoring through ONNX Runtime: its Keras classifier converted in memory
        (`onnx_export.classifier_onnx`), the same text path."""
        if self.engine == "onnx":
            return self
        from selfsup_model.serving.onnx_export import OnnxScorer, classifier_onnx

        bundle = ClassifierBundle(self.directory, self.spec, self.model, self.tokenizer)
        bundle.engine = "onnx"
        bundle._scorer = OnnxScorer(classifier_onnx(self.model).SerializeToString())
        return bundle

    def logits(self, ids: np.ndarray, batch_size: int = 256) -> np.ndarray:
        """Class logits (m, C) for framed classifier inputs (m, L), by this bundle's engine."""
        if self._scorer is not None:
            return self._scorer(ids, batch_size)
        from selfsup_model.transfer.classify import predict_in_batches

        return predict_in_batches(self.model, ids, batch_size)

    def encode_texts(self, texts: Sequence[str]) -> EncodedTexts:
        """Texts -> framed classifier inputs, by the training path (see the module docstring)."""
        normalised = [normalize_document(t) for t in texts]
        enc = encode_split(self.tokenizer, normalised, self.encode)
        if self.every_window:
            windows, owner = document_windows(enc.windows, enc.doc_offsets,
                                              np.arange(len(enc.kept)), self.spec["max_len"])
        else:
            windows = first_windows(enc.windows, enc.doc_offsets, None, self.spec["max_len"])
            owner = np.arange(len(windows), dtype=np.int64)
        return EncodedTexts(frame_windows(windows, self.spec["causal"]), owner, enc.kept,
                            enc.empty)

    def predict_proba(self, texts: Sequence[str], batch_size: int = 256,
                      progress: Callable[[int, int], None] | None = None
                      ) -> tuple[np.ndarray, np.ndarray]:
        """(probabilities (k, C) float32 in class order, kept indices (k,)) for `texts`; texts
        with no tokens are left out (their indices are the ones missing from `kept`)."""
        probs, kept = [], []
        for start in range(0, len(texts), _CHUNK_DOCS):
            enc = self.encode_texts(texts[start : start + _CHUNK_DOCS])
            logits = self.logits(enc.ids, batch_size)  # (m, C)
            probs.append(mean_over_documents(softmax(logits), enc.owner, len(enc.kept)))
            kept.append(enc.kept + start)
            if progress is not None:
                progress(min(start + _CHUNK_DOCS, len(texts)), len(texts))
        if not probs:
            return np.zeros((0, len(self.classes)), np.float32), np.zeros(0, np.int64)
        return np.concatenate(probs), np.concatenate(kept)


def verified_outputs(workdir: str | Path, stage: str, names: Sequence[str],
                     what: str) -> list[Path]:
    """Paths of `names` in a finished stage of `workdir`, each checked against the sha256 its
    manifest recorded (no manifest: the stage never finished, nothing there is trusted)."""
    stage_dir = Path(workdir) / stage
    manifest = read_manifest(stage_dir)
    if manifest is None:
        raise UserError(f"no {what} in {workdir}: its {stage} stage has not completed "
                        f"(run: selfsup run --workdir {workdir})")
    absent = [name for name in names if name not in manifest.outputs]
    if absent:
        raise UserError(f"the {stage} stage in {workdir} wrote no {', '.join(absent)} (an older "
                        f"selfsup); rerun it: selfsup run --workdir {workdir} --from {stage}")
    wanted = dataclasses.replace(manifest, outputs={n: manifest.outputs[n] for n in names})
    changed = verify_outputs(stage_dir, wanted)  # only these files are hashed
    if changed:
        raise ArtifactError(f"{', '.join(changed)} in {stage_dir} changed after the run wrote "
                            f"them; rerun: selfsup run --workdir {workdir} --from {stage}")
    return [stage_dir / name for name in names]


@dataclasses.dataclass(frozen=True)
class RunPretrained:
    """A finished run's `pretrain_model.keras` and the tokenizer it was trained with."""

    model: keras.Model
    tokenizer: Any
    model_path: Path
    tokenizer_path: Path


def load_run_pretrained(workdir: str | Path) -> RunPretrained:
    """The run's pretrain_model.keras and tokenizer, both verified against their manifests,
    and the tokenizer checked to be the one pretraining read."""
    model_path = verified_outputs(workdir, "pretrain", ["pretrain_model.keras"],
                                  "pretrained model")[0]
    tok_path = verified_outputs(workdir, "tokenizer", [TOKENIZER_FILE], "tokenizer")[0]
    # One refitted since (a rerun of the tokenizer stage alone) maps text to ids the model
    # never learned.
    trained_with = read_manifest(model_path.parent).inputs.get(f"tokenizer/{TOKENIZER_FILE}")
    if trained_with != sha256_file(tok_path):
        raise UserError(f"the tokenizer in {workdir} is not the one its pretrained model was "
                        f"trained with (refitted since); rerun: selfsup run --workdir {workdir} "
                        "--from pretrain")
    from selfsup_model.nn.saving import load_keras_model

    return RunPretrained(load_keras_model(model_path), load_tokenizer(tok_path), model_path,
                         tok_path)


def load_run_classifier(workdir: str | Path) -> ClassifierBundle:
    """The classifier a finished finetune stage in `workdir` handed over, verified: the spec
    against the stage's manifest, the other files against the spec (in `ClassifierBundle.load`;
    a run without a classifier says why there)."""
    spec_path = verified_outputs(workdir, "finetune", [SPEC_FILE], "finished classifier")[0]
    return ClassifierBundle.load(spec_path.parent)


def read_spec(directory: str | Path, spec_file: str = SPEC_FILE) -> dict[str, Any]:
    """classifier.json (or an ONNX export's spec) of a bundle, or one clear error."""
    path = Path(directory) / spec_file
    try:
        spec = json.loads(path.read_text("utf-8"))
    except FileNotFoundError:
        raise UserError(f"no finished classifier in {Path(directory)} ({spec_file} missing); "
                        "run the pipeline through the finetune stage first") from None
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{path} is unreadable ({exc}); rerun the finetune stage") from None
    if spec.get("version") != SPEC_VERSION:
        raise ArtifactError(f"{path} has version {spec.get('version')!r}, this code reads "
                            f"{SPEC_VERSION}; rerun the finetune stage")
    if "skipped" in spec:
        raise UserError(f"this run has no classifier: {spec['skipped']}")
    return spec
