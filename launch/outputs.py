"""The result in formats other programs read, beside ``result.npz``: ``result.json`` (every named
array as JSON) and, for a result of per-column values, ``result.csv`` (one row per column).

Both are written by :func:`sharded_scan.workdir.write_atomically` (a fresh temp file renamed over
the name), on process 0, after the job's own outputs.
"""

from __future__ import annotations

import csv
import io
import json
import math
from typing import Any

import numpy as np

from sharded_scan.paths import as_path
from sharded_scan.storage import storage_error, storage_reason
from sharded_scan.workdir import RESULT, SUMMARY, named_arrays, write_atomically

JSON, CSV = "result.json", "result.csv"
# Fields along another axis than X's columns: quantile levels, bin edges shared by every column,
# PCA's components and their variances (one per component).
NOT_BY_COLUMN = ("qs", "edges", "components", "explained_variance", "explained_variance_ratio", "singular_values")
# The sketches' state (result.sketch): kept in result.npz, for to_datasketches(); not a statistic.
STATE = "sketch"
# A 2-D field whose second axis another field labels: quantiles[0.5] rather than quantiles[4].
LABELLED_BY = {"quantiles": "qs"}


def plain(value: Any) -> Any:
    """``value`` (an array, a numpy scalar) as JSON values: lists, numbers, strings; NaN is null
    and the infinities are the strings ``"inf"`` / ``"-inf"`` (JSON has neither)."""
    if isinstance(value, np.ndarray | np.generic):
        return plain(value.tolist())
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def result_json(arrays: dict[str, np.ndarray]) -> str:
    """The named arrays of a result as one JSON object, the keys of ``result.npz``, one a line."""
    fields = [f"  {json.dumps(name)}: {json.dumps(plain(array), allow_nan=False)}" for name, array in arrays.items()]
    return "{\n" + ",\n".join(fields) + "\n}\n"


def result_table(arrays: dict[str, np.ndarray]) -> str | None:
    """The per-column fields of a result as CSV text, one row per column of X (named by
    ``columns``), or None when the result has no per-column fields."""
    columns = arrays.get("columns")
    if columns is None or np.ndim(columns) != 1:
        return None
    d = len(columns)
    header, cells = ["column"], [[plain(c)] for c in columns]
    for name, array in arrays.items():
        array = np.asarray(array)
        if name == "columns" or name in NOT_BY_COLUMN or array.ndim not in (1, 2) or array.shape[0] != d:
            continue
        if array.ndim == 1:
            header.append(name)
        else:
            labels = arrays.get(LABELLED_BY.get(name, ""))
            labels = labels if labels is not None and np.shape(labels) == array.shape[1:] else range(array.shape[1])
            header += [f"{name}[{label}]" for label in plain(np.asarray(labels))]
        for row, values in zip(cells, array.reshape(d, -1).tolist(), strict=True):
            row += values
    if len(header) == 1:
        return None
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(header)
    writer.writerows([repr(v) if isinstance(v, float) else v for v in row] for row in cells)
    return text.getvalue()


def write_result_files(workdir: str, result: Any) -> list[str]:
    """Writes ``result.json``, and ``result.csv`` for a per-column result, into ``workdir``.

    Returns:
      the names of the files written.

    Raises:
      StorageError: the workdir refused a write (one line; result.npz and summary.json are intact).
    """
    arrays = {name: a for name, a in named_arrays(result).items() if STATE not in name.split(".")}
    files = {JSON: result_json(arrays), CSV: result_table(arrays)}
    written = [name for name, text in files.items() if text is not None]
    try:
        for name in written:
            write_atomically(workdir, name, lambda f, text=files[name]: f.write(text.encode()))
    except OSError as e:
        code = storage_reason(e)
        if code is None:
            raise
        raise storage_error(f"write {as_path(workdir) / name}", code, f"{RESULT} and {SUMMARY} are written",
                            sum(len(t) for t in files.values() if t)) from None
    return written
