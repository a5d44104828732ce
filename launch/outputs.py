"""The result in formats other programs read, beside ``result.npz``: ``result.json`` (every named
array as JSON), for a result of per-column values ``result.csv`` (one row per column), and for
``Describe`` ``describe.json``.

:func:`result_files` gives :func:`sharded_scan.run_in_workdir` the files to write: it writes them
on process 0 before ``summary.json``, whose ``outputs_sha256`` covers each one (a workdir missing
one, or holding a damaged one, is not done: a rerun writes them again from the final checkpoint).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from sharded_scan.combiners.describe import DESCRIBE_JSON, Describe, DescribeResult, describe_json
from sharded_scan.combiners.results import json_text, json_value
from sharded_scan.workdir import named_arrays

JSON, CSV = "result.json", "result.csv"
# Fields along another axis than X's columns: quantile levels, bin edges shared by every column,
# PCA's components and their variances (one per component).
NOT_BY_COLUMN = ("qs", "edges", "components", "explained_variance", "explained_variance_ratio", "singular_values")
# The sketches' state (result.sketch): kept in result.npz, for to_datasketches(); not a statistic.
STATE = "sketch"
# A 2-D field whose second axis another field labels: quantiles[0.5] rather than quantiles[4].
LABELLED_BY = {"quantiles": "qs"}
# What starts a formula in a spreadsheet (OWASP's "CSV injection"): a text cell starting so is written after a single
# quote, "'=...", which spreadsheets show as text; numbers, negative ones too, are written as they are.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def result_json(arrays: dict[str, np.ndarray]) -> str:
    """The named arrays of a result as one JSON object, the keys of ``result.npz``, one a line."""
    fields = [f"  {json.dumps(name)}: {json_text(array)}" for name, array in arrays.items()]
    return "{\n" + ",\n".join(fields) + "\n}\n"


def result_table(arrays: dict[str, np.ndarray]) -> str | None:
    """The per-column fields of a result as CSV text, one row per column of X (named by
    ``columns``), or None when the result has no per-column fields."""
    columns = arrays.get("columns")
    if columns is None or np.ndim(columns) != 1:
        return None
    d = len(columns)
    header, cells = ["column"], [[json_value(c)] for c in columns]
    for name, array in arrays.items():
        array = np.asarray(array)
        if name == "columns" or name in NOT_BY_COLUMN or array.ndim not in (1, 2) or array.shape[0] != d:
            continue
        if array.ndim == 1:
            header.append(name)
        else:
            labels = arrays.get(LABELLED_BY.get(name, ""))
            labels = labels if labels is not None and np.shape(labels) == array.shape[1:] else range(array.shape[1])
            header += [f"{name}[{label}]" for label in json_value(np.asarray(labels))]
        for row, values in zip(cells, array.reshape(d, -1).tolist(), strict=True):
            row += values
    if len(header) == 1:
        return None
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n", quoting=csv.QUOTE_NONNUMERIC)  # every text in quotes, as OWASP
    writer.writerow([csv_cell(v) for v in header])  # says: a CR or tab in a name stays in its cell
    writer.writerows([csv_cell(v) for v in row] for row in cells)
    return text.getvalue()


def csv_cell(value: Any) -> Any:
    """One cell of ``result.csv``: a text a spreadsheet would run (:data:`FORMULA_STARTS`) after a single quote;
    anything else as it is (numbers unquoted, a float as ``repr`` writes it: ``-1.5``, ``-inf``, ``nan``)."""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value


def result_files(combiner: Any) -> dict[str, Callable[[Any], str | None]]:
    """The files :func:`sharded_scan.run_in_workdir` writes beside ``result.npz`` for a job of ``combiner``
    (its ``outputs``): each name's text from the result, None where the result has none (``result.csv`` of a
    result that is not per column; ``describe.json`` of a ``Describe`` of a pytree)."""
    files = {JSON: lambda result: result_json(_statistics(result)),
             CSV: lambda result: result_table(_statistics(result))}
    if isinstance(combiner, Describe):
        files[DESCRIBE_JSON] = lambda result: describe_json(result) if isinstance(result, DescribeResult) else None
    return files


def _statistics(result: Any) -> dict[str, np.ndarray]:
    """The named arrays of ``result`` but the sketches' state."""
    return {name: a for name, a in named_arrays(result).items() if STATE not in name.split(".")}
