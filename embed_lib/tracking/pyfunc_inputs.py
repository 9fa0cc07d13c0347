"""What the registered pyfunc models (`pyfunc_adapter.py`, `pyfunc_cross_encoder.py`) check in their input.

Their errors are `PairInputError`: a ValueError in process, and an MlflowException with
INVALID_PARAMETER_VALUE, so MLflow's own scoring server (`mlflow models serve`) answers 400 with the message
naming the field and row, where any other exception becomes its generic "unexpected error while evaluating the
model" with the message left in a stack trace.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE


class PairInputError(MlflowException, ValueError):
    def __init__(self, message: str) -> None:
        super().__init__(message, error_code=INVALID_PARAMETER_VALUE)


def texts(column: pd.Series, name: str) -> list[str]:
    """The column's texts, or PairInputError naming the first row that is missing, not a string, or blank."""
    out = column.tolist()
    for i, t in enumerate(out):
        if t is None or (isinstance(t, float) and np.isnan(t)):  # MLflow's schema makes NaN of None
            raise PairInputError(f"{name}[{i}] is missing (None or NaN); give a text in every row.")
        if not isinstance(t, str):
            raise PairInputError(f"{name}[{i}] must be a string; got {type(t).__name__} ({t!r:.40}).")
        if not t.strip():
            raise PairInputError(f"{name}[{i}] is empty or blank; give a text with a visible character.")
    return out


def rows_of_lists(frame: pd.DataFrame) -> pd.DataFrame:
    """A row per pair of the one row MLflow makes of a dict of lists of texts (sentence1 / sentence2); any other
    frame as it is. (A dict of lists of vectors MLflow's schema refuses before this: give those as a DataFrame.)"""
    if len(frame) != 1 or not {"sentence1", "sentence2"} <= set(frame.columns):
        return frame
    a, b = frame["sentence1"].iloc[0], frame["sentence2"].iloc[0]
    if not (isinstance(a, (list, tuple, np.ndarray)) and isinstance(b, (list, tuple, np.ndarray))):
        return frame
    if len(a) != len(b):
        raise PairInputError(f"sentence1 holds {len(a)} texts and sentence2 {len(b)}; give one of each per pair.")
    return pd.DataFrame({"sentence1": list(a), "sentence2": list(b)})
