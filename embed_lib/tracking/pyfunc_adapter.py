"""MLflow "models from code" definition of a saved adapter (no pickled objects anywhere).

MLflow copies this file into the model; at load time it runs it, and `load_context` reads the
adapter from safetensors + JSON (`embed_lib.training.export`). `predict` takes a DataFrame with either
`emb_a` / `emb_b` (cached raw vectors: lists of floats or float32 / float64 arrays, one per row) or
`sentence1` / `sentence2` (texts; the frozen encoder named in the manifest is loaded once and checked
against the manifest's fingerprint), and returns `score`, `baseline` and `difficulty` per pair. A dict of lists
(`{"sentence1": [...], "sentence2": [...]}`), which MLflow hands over as one row of lists, is a row per pair.
"""
from __future__ import annotations

import mlflow
import numpy as np
import pandas as pd
from mlflow.pyfunc import PythonModel

from embed_lib.encoding.cache import encoder_for
from embed_lib.encoding.encoders import check_texts
from embed_lib.training.export import ensemble_scores, load_adapter


class PairAdapterModel(PythonModel):
    def load_context(self, context) -> None:
        self.model, self.config, self.manifest = load_adapter(context.artifacts["adapter"])
        self._encoder = None

    def _encode(self, texts: list[str]) -> np.ndarray:
        if self._encoder is None:
            self._encoder = encoder_for(self.manifest)
        return self._encoder.encode(texts)

    def _vectors(self, column: pd.Series, name: str) -> np.ndarray:
        """(n, dim) float32 of a column of vectors; ValueError naming the column and row of a wrong length or a
        value that is not finite."""
        dim = int(self.manifest["dim"])
        rows = [np.asarray(v, dtype=np.float32).reshape(-1) for v in column.tolist()]
        for i, v in enumerate(rows):
            if v.shape[0] != dim:
                raise ValueError(f"{name}[{i}] has {v.shape[0]} values; this adapter takes vectors of {dim} (its "
                                 f"encoder's, {self.manifest.get('encoder', '?')}).")
            if not np.isfinite(v).all():
                raise ValueError(f"{name}[{i}] holds NaN or infinity; give finite raw vectors of the encoder.")
        return np.stack(rows) if rows else np.zeros((0, dim), np.float32)

    @staticmethod
    def _texts(column: pd.Series, name: str) -> list[str]:
        texts = column.tolist()
        for i, t in enumerate(texts):
            if t is None or (isinstance(t, float) and np.isnan(t)):  # MLflow's schema makes NaN of None
                raise ValueError(f"{name}[{i}] is missing (None or NaN); give a text in every row.")
        check_texts(texts, name)
        for i, t in enumerate(texts):
            if isinstance(t, str) and not t.strip():
                raise ValueError(f"{name}[{i}] is empty or blank; give a text with a visible character.")
        return texts

    def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
        model_input = _rows_of_lists(model_input)
        if {"emb_a", "emb_b"} <= set(model_input.columns):
            xa = self._vectors(model_input["emb_a"], "emb_a")
            xb = self._vectors(model_input["emb_b"], "emb_b")
        elif {"sentence1", "sentence2"} <= set(model_input.columns):
            xa = self._encode(self._texts(model_input["sentence1"], "sentence1"))
            xb = self._encode(self._texts(model_input["sentence2"], "sentence2"))
        else:
            raise ValueError(f"Input needs columns emb_a/emb_b or sentence1/sentence2; got {list(model_input.columns)}.")
        out = ensemble_scores(self.model, xa, xb)
        return pd.DataFrame({k: out[k] for k in ("score", "baseline", "difficulty")})  # the signature's outputs


def _rows_of_lists(frame: pd.DataFrame) -> pd.DataFrame:
    """A row per pair of the one row MLflow makes of a dict of lists of texts (sentence1 / sentence2); any other
    frame as it is. (A dict of lists of vectors MLflow's schema refuses before this: give those as a DataFrame.)"""
    if len(frame) != 1 or not {"sentence1", "sentence2"} <= set(frame.columns):
        return frame
    a, b = frame["sentence1"].iloc[0], frame["sentence2"].iloc[0]
    if not (isinstance(a, (list, tuple, np.ndarray)) and isinstance(b, (list, tuple, np.ndarray))):
        return frame
    if len(a) != len(b):
        raise ValueError(f"sentence1 holds {len(a)} texts and sentence2 {len(b)}; give one of each per pair.")
    return pd.DataFrame({"sentence1": list(a), "sentence2": list(b)})


mlflow.models.set_model(PairAdapterModel())
