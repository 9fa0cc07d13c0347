"""MLflow "models from code" definition of a saved adapter (no pickled objects anywhere).

MLflow copies this file into the model; at load time it runs it, and `load_context` reads the
adapter from safetensors + JSON (`embed_lib.training.export`). `predict` takes a DataFrame with either
`emb_a` / `emb_b` (cached raw vectors: lists of floats or float32 / float64 arrays, one per row) or
`sentence1` / `sentence2` (texts; the frozen encoder named in the manifest is loaded once and checked
against the manifest's fingerprint), and returns `score`, `baseline` and `difficulty` per pair (score and baseline
clipped to [-1, 1], as the service answers: `export.as_served`). A dict of lists
(`{"sentence1": [...], "sentence2": [...]}`), which MLflow hands over as one row of lists, is a row per pair.
Bad input: `pyfunc_inputs.PairInputError`, which `mlflow models serve` answers with 400 and its message.
"""
from __future__ import annotations

import mlflow
import numpy as np
import pandas as pd
from mlflow.pyfunc import PythonModel

from embed_lib.encoding.cache import encoder_for
from embed_lib.tracking.pyfunc_inputs import PairInputError, rows_of_lists, texts
from embed_lib.training.export import as_served, ensemble_scores, load_adapter


class PairAdapterModel(PythonModel):
    def load_context(self, context) -> None:
        self.model, self.config, self.manifest = load_adapter(context.artifacts["adapter"])
        self._encoder = None

    def _encode(self, texts: list[str]) -> np.ndarray:
        if self._encoder is None:
            self._encoder = encoder_for(self.manifest)
        return self._encoder.encode(texts)

    def _vectors(self, column: pd.Series, name: str) -> np.ndarray:
        """(n, dim) float32 of a column of vectors; PairInputError (a ValueError) naming the column and row of a
        wrong length or a value that is not finite."""
        dim = int(self.manifest["dim"])
        rows = [np.asarray(v, dtype=np.float32).reshape(-1) for v in column.tolist()]
        for i, v in enumerate(rows):
            if v.shape[0] != dim:
                raise PairInputError(f"{name}[{i}] has {v.shape[0]} values; this adapter takes vectors of {dim} "
                                     f"(its encoder's, {self.manifest.get('encoder', '?')}).")
            if not np.isfinite(v).all():
                raise PairInputError(f"{name}[{i}] holds NaN or infinity; give finite raw vectors of the encoder.")
        return np.stack(rows) if rows else np.zeros((0, dim), np.float32)

    def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
        model_input = rows_of_lists(model_input)
        if {"emb_a", "emb_b"} <= set(model_input.columns):
            xa = self._vectors(model_input["emb_a"], "emb_a")
            xb = self._vectors(model_input["emb_b"], "emb_b")
        elif {"sentence1", "sentence2"} <= set(model_input.columns):
            xa = self._encode(texts(model_input["sentence1"], "sentence1"))
            xb = self._encode(texts(model_input["sentence2"], "sentence2"))
        else:
            got = list(model_input.columns) or "none of them (MLflow passes on only the columns the model's " \
                "signature names: sentence1, sentence2, emb_a, emb_b)"
            raise PairInputError(f"Input needs columns emb_a/emb_b or sentence1/sentence2; got {got}.")
        out = ensemble_scores(self.model, xa, xb)
        return pd.DataFrame({"score": as_served(out["score"]), "baseline": as_served(out["baseline"]),
                             "difficulty": out["difficulty"]})  # the signature's outputs


mlflow.models.set_model(PairAdapterModel())
