"""MLflow "models from code" definition of a served cross-encoder teacher (no pickled objects anywhere).

MLflow copies this file into the model; `load_context` loads the saved cross-encoder folder
(safetensors + JSON, `embed_lib.teacher.cross_encoder.PairCrossEncoder`). `predict` takes a DataFrame with
`sentence1` / `sentence2` and returns `score` (on the frozen cosine's scale, by the folder's
calibration) and `logit` per pair. A dict of lists is a row per pair, and bad input a `PairInputError`, as for
the adapter (`pyfunc_inputs`).
"""
from __future__ import annotations

import mlflow
import pandas as pd
from mlflow.pyfunc import PythonModel

from embed_lib.teacher.cross_encoder import PairCrossEncoder
from embed_lib.tracking.pyfunc_inputs import PairInputError, rows_of_lists, texts


class CrossEncoderModel(PythonModel):
    def load_context(self, context) -> None:
        self.ce = PairCrossEncoder(context.artifacts["cross_encoder"])

    def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
        model_input = rows_of_lists(model_input)
        if not {"sentence1", "sentence2"} <= set(model_input.columns):
            raise PairInputError(f"Input needs columns sentence1 and sentence2; got {list(model_input.columns)}.")
        pairs = list(zip(texts(model_input["sentence1"], "sentence1"), texts(model_input["sentence2"], "sentence2")))
        z = self.ce.logits(pairs)
        return pd.DataFrame({"score": self.ce.to_score(z), "logit": z})


mlflow.models.set_model(CrossEncoderModel())
