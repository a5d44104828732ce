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
from typing import Any, NamedTuple

import numpy as np

from sharded_scan.combiners.results import json_text, json_value
from sharded_scan.combiners.statistics.describe import DESCRIBE_JSON, Describe, DescribeResult, describe_json
from sharded_scan.workdir import named_arrays

JSON, CSV = "result.json", "result.csv"
# Fields along another axis than X's columns: quantile levels, bin edges shared by every column,
# PCA's components and their variances (one per component).
NOT_BY_COLUMN = ("qs", "edges", "components", "explained_variance", "explained_variance_ratio", "singular_values")
# The sketches' state (result.sketch): kept in result.npz, for to_datasketches(); not a statistic.
STATE = "sketch"
# A 2-D field whose second axis another field labels, by level: percentiles (0.25, 0.5) as q25, q50.
LABELLED_BY = {"quantiles": "qs", "percentiles": "qs"}
# A (d, d) field of every pair of X's columns: its columns named by the other column, as pandas' df.corr() prints.
MATRICES = ("corr", "cov")
# Per-column fields whose header is the name a user knows (statsmodels' summary: coef, std err).
HEADERS = {"coef_stderr": "stderr"}
# A regression of t targets: these fields are (t, d) (per column of X, transposed into the table) or (t,) (per
# target: a value of each target); the header says the target: coef[0], r2[0].
PER_TARGET = ("coef", "coef_stderr", "intercept", "r2", "residual_std", "intercept_stderr")
# What starts a formula in a spreadsheet (OWASP's "CSV injection"): a text cell starting so is written after a single
# quote, "'=...", which spreadsheets show as text; numbers, negative ones too, are written as they are.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def result_json(arrays: dict[str, np.ndarray]) -> str:
    """The named arrays of a result as one JSON object, the keys of ``result.npz``, one a line."""
    fields = [f"  {json.dumps(name)}: {json_text(array)}" for name, array in arrays.items()]
    return "{\n" + ",\n".join(fields) + "\n}\n"


class Table(NamedTuple):
    """A result's per-column fields as a table, one row per column of X (:func:`column_table`)."""

    index: list[Any]         # the column names (``columns``), one a row
    header: list[Any]        # a label a column of values: a field, or one value of a 2-D field (q50, a, coef[1])
    rows: list[list[Any]]    # each row's values, as Python numbers, booleans or strings
    scalars: dict[str, Any]  # the fields of one value (count, intercept, r2): label -> value
    fields: set[str]         # the names of the arrays it holds, scalars too (the others are along another axis)


def column_table(arrays: dict[str, np.ndarray], prefix: str = "") -> Table | None:
    """The per-column fields of the arrays named ``prefix + NAME`` (a result's, or one part's of a pytree of them),
    or None when they hold no ``columns`` or no field by column.

    Headers say what a user knows: a field by its name (``coef_stderr`` as ``stderr``), a field by quantile level as
    ``q25``, ``q50`` (:data:`LABELLED_BY`), a correlation or covariance matrix (:data:`MATRICES`) by the other
    column's name when that name is free (one matrix, distinct names that clash with no other header; else
    ``corr[j]``), any other 2-D field as ``f[j]``; the fields of one value go to ``scalars``.
    """
    mine = {name[len(prefix):]: np.asarray(a) for name, a in arrays.items() if name.startswith(prefix)}
    mine = {name: a for name, a in mine.items() if "." not in name}
    columns = mine.get("columns")
    if columns is None or columns.ndim != 1:
        return None
    d = len(columns)
    per_target = np.ndim(mine.get("intercept")) == 1 and np.ndim(mine.get("coef")) == 2  # t targets: coef (t, d)
    parts: list[tuple[str, list[Any], np.ndarray]] = []  # (field, labels, its (d, m) values)
    fields = {"columns"}
    scalars: dict[str, Any] = {}
    for name, array in mine.items():
        label, used = HEADERS.get(name, name), len(parts) + len(scalars)
        if per_target and name in PER_TARGET:
            if array.ndim == 2:
                parts.append((name, [f"{label}[{t}]" for t in range(array.shape[0])], array.T))
            else:
                scalars.update((f"{label}[{t}]", v) for t, v in enumerate(array.tolist()))
        elif name == "columns" or name in NOT_BY_COLUMN:
            continue
        elif array.ndim == 0:
            scalars[label] = array.item()
        elif array.ndim == 1 and array.shape[0] == d:
            parts.append((name, [label], array[:, None]))
        elif array.ndim == 2 and array.shape[0] == d:
            parts.append((name, _labels(name, array, mine), array))
        if len(parts) + len(scalars) > used:
            fields.add(name)
    if not parts:
        return None
    _name_matrix_columns(parts, [json_value(c) for c in columns.tolist()])
    rows: list[list[Any]] = [[] for _ in range(d)]
    for _, _, values in parts:
        for row, more in zip(rows, values.reshape(d, -1).tolist(), strict=True):
            row += more
    header = [label for _, labels, _ in parts for label in labels]
    return Table(columns.tolist(), header, rows, scalars, fields)


def _labels(name: str, array: np.ndarray, arrays: dict[str, np.ndarray]) -> list[str]:
    """The headers of the ``m`` values a column of the 2-D field ``name`` holds: ``q25`` by quantile level, else
    ``name[j]``."""
    levels = arrays.get(LABELLED_BY.get(name, ""))
    if levels is not None and np.shape(levels) == array.shape[1:]:
        labels = [quantile_label(q) for q in np.asarray(levels, np.float64).tolist()]
        if len(set(labels)) == len(labels):
            return labels
    return [f"{HEADERS.get(name, name)}[{j}]" for j in range(array.shape[1])]


def quantile_label(q: float) -> str:
    """A quantile level as a header, by its percent: 0.25 as ``q25``, 0.999 as ``q99.9``, 1 as ``q100``."""
    return "q" + np.format_float_positional(round(q * 100, 10), trim="-")


def _name_matrix_columns(parts: list[tuple[str, list[Any], np.ndarray]], names: list[Any]) -> None:
    """Names the columns of the one (d, d) matrix in ``parts`` by the other column (``a``, ``b``), as ``df.corr()``
    does, where those names are distinct and clash with no other header (else they stay ``corr[j]``)."""
    matrices = [i for i, (name, _, values) in enumerate(parts) if name in MATRICES and values.shape[1] == len(names)]
    if len(matrices) != 1:
        return
    i = matrices[0]
    others = {"column", *(str(label) for j, (_, labels, _) in enumerate(parts) if j != i for label in labels)}
    texts = [str(n) for n in names]
    if len(set(texts)) == len(texts) and not others & set(texts):
        parts[i] = (parts[i][0], names, parts[i][2])


def result_table(arrays: dict[str, np.ndarray]) -> str | None:
    """The per-column fields of a result as CSV text, or None when the result has none (:func:`column_table`).

    One row per column of X: its name (``column``), the table's fields, then each field of one value (``count``,
    ``intercept``, ``r2``...) as a column holding that value on every row, as ``to_pandas()`` repeats them:
    ``pd.read_csv`` reads the file as one table."""
    table = column_table(arrays)
    if table is None:
        return None
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n", quoting=csv.QUOTE_NONNUMERIC)  # every text in quotes, as OWASP
    writer.writerow([csv_cell(v) for v in ["column", *table.header, *table.scalars]])  # says: a CR or tab in a
    for name, row in zip(table.index, table.rows, strict=True):                          # name stays in its cell
        writer.writerow([csv_cell(v) for v in [json_value(name), *row, *table.scalars.values()]])
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
