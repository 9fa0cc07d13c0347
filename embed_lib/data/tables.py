"""Pair tables from disk: .csv / .tsv / .jsonl / .json / .parquet read as text, each failure naming the file and
the row (`read_table`), and the texts of a table's columns (`table_texts`: a warm corpus)."""
from __future__ import annotations

import csv
import json
import warnings
from pathlib import Path

import pandas as pd

TABLE_SUFFIXES = (".csv", ".tsv", ".jsonl", ".json", ".parquet")


def read_table(path: Path) -> pd.DataFrame:
    """A .csv / .tsv / .jsonl / .json / .parquet file as a DataFrame (text kept as text)."""
    suffix = path.suffix.lower()
    try:
        if suffix in (".csv", ".tsv"):
            return _read_delimited(path, "\t" if suffix == ".tsv" else ",")
        if suffix in (".jsonl", ".json"):
            try:
                return pd.read_json(path, lines=suffix == ".jsonl", dtype=False)
            except ValueError:
                if suffix == ".jsonl":  # pandas names a byte position: name the line to blame, where one is
                    _check_json_lines(path)
                raise
        if suffix == ".parquet":
            return pd.read_parquet(path)
    except _RowError:
        raise
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path}: cannot be read as {suffix[1:]}: {exc}") from exc
    raise ValueError(f"{path}: unknown file type {suffix!r}; use .csv, .tsv, .jsonl or .parquet.")


class _RowError(ValueError):
    """A row of a table that cannot be read, named (not wrapped again by read_table)."""


def _check_json_lines(path: Path) -> None:
    """_RowError naming the first line of a .jsonl file that is not a JSON object."""
    with open(path, encoding="utf-8-sig") as fh:
        for i, line in enumerate((ln for ln in fh if ln.strip()), start=1):
            try:
                ok = isinstance(json.loads(line), dict)
            except ValueError as exc:
                raise _RowError(f"{path}, row {i}: not JSON ({exc.msg}, column {exc.colno}); each line holds one "
                                "object, e.g. {\"a\": \"...\", \"b\": \"...\", \"score\": 4.2}.") from exc
            if not ok:
                raise _RowError(f"{path}, row {i}: a JSON value that is not an object; each "
                                "line holds one object, e.g. {\"a\": \"...\", \"b\": \"...\", \"score\": 4.2}.")


def sep_hint(frame: pd.DataFrame) -> str:
    """A file of one column whose name holds another separator was read with the wrong one (a ';'-separated .csv)."""
    found = [c for c in (";", "\t", "|", ",") if len(frame.columns) == 1 and c in str(frame.columns[0])]
    return (f"; its header holds {found[0]!r}: a .csv must be comma-separated and a .tsv tab-separated, so save it "
            "again as one of those") if found else ""


def _read_delimited(path: Path, sep: str) -> pd.DataFrame:
    """A .csv / .tsv file; a row of more fields than the header is an error naming the row. (pandas would take a
    first column of texts as the index when every row had one field more, shifting every column by one, or drop
    the extra fields with a warning.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("error", pd.errors.ParserWarning)
        try:
            return pd.read_csv(path, sep=sep, dtype=object, keep_default_na=False, na_values=[""], index_col=False)
        except (pd.errors.ParserWarning, pd.errors.ParserError) as exc:
            with open(path, encoding="utf-8-sig", newline="") as fh:
                rows = csv.reader(fh, delimiter=sep)
                header = next(rows, [])
                for i, row in enumerate(rows, start=1):
                    if len(row) > len(header):
                        hint = 'a comma ("a, b")' if sep == "," else "a tab"
                        raise _RowError(f"{path}, row {i}: {len(row)} fields where the header has {len(header)}; "
                                        f"quote a text that holds {hint}.") from exc
            raise ValueError(f"{path}: cannot be read as {path.suffix[1:]}: {exc}") from exc


def table_texts(path: Path, columns: list[str] | None = None) -> list[str]:
    """The distinct non-empty texts of a table's `columns` (default: every column holding only text that is
    not all numbers, so a CSV's label column is left out)."""
    frame = read_table(path)
    if columns:
        missing = [c for c in columns if c not in frame.columns]
        if missing:
            raise ValueError(f"{path}: no column {missing[0]!r}; its columns: {list(frame.columns)}.")
    else:
        columns = [c for c in frame.columns if frame[c].map(lambda v: isinstance(v, str)).all()
                   and not pd.to_numeric(frame[c], errors="coerce").notna().all()]
        if not columns:
            raise ValueError(f"{path}: no column holds only text; name the text columns.")
    texts = (v for c in columns for v in frame[c] if isinstance(v, str) and v.strip())
    return list(dict.fromkeys(texts))
