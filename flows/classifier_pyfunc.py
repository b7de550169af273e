"""The kept classifier as an MLflow pyfunc model, logged as "models from code".

MLflow runs this file when it loads the model (nothing of ours is pickled). Its
artifacts are the bundle the finetune stage wrote (see
`selfsup_model.serving.inference`): classifier.keras, tokenizer.json, classifier.json.
Loading checks their sha256 against classifier.json and opens the Keras file
with `safe_mode=True`.

    model = mlflow.pyfunc.load_model("models:/selfsup-classifier/1")
    model.predict(pd.DataFrame({"text": ["a new document"]}))
    # -> DataFrame: label, probability, p_<class> per class
"""

from __future__ import annotations

from pathlib import Path

import mlflow
import pandas as pd
from mlflow.pyfunc import PythonModel

from selfsup_model.serving.inference import SPEC_FILE, ClassifierBundle
from selfsup_model.serving.scoring import prediction_frame


class SelfsupClassifier(PythonModel):
    def load_context(self, context):
        self.bundle = ClassifierBundle.load(Path(context.artifacts[SPEC_FILE]).parent)

    def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
        if not isinstance(model_input, pd.DataFrame) or "text" not in model_input.columns:
            raise ValueError("input must be a table with a 'text' column")
        # MLflow's schema enforcement turns a null text (None, JSON null) into NaN: missing, not
        # the word "nan".
        texts = ["" if pd.isna(t) else str(t) for t in model_input["text"].tolist()]
        probs, kept = self.bundle.predict_proba(texts)
        if len(kept) < len(texts):
            missing = sorted(set(range(len(texts))) - set(kept.tolist()))
            raise ValueError(f"rows {missing[:20]} have no text to classify (empty after "
                             "normalisation or no tokens)")
        return prediction_frame(probs, self.bundle.classes)  # what `selfsup predict` writes


mlflow.models.set_model(SelfsupClassifier())
