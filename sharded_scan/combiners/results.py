"""Per-column results as pandas: the one helper behind every result's ``to_pandas()``.

A result of per-column values becomes a ``DataFrame`` with one row per column of the data
(the index: the result's ``columns``, the names when the data named them, else positions)
and one column per statistic, each keeping its dtype (counts stay integers). A statistic
with several values per column (``(d, m)``: the quantiles at each ``q``, the covariance with
every column) spreads over ``m`` columns labelled by what they are; ``long=`` turns such
statistics into rows instead (a ``(column, LABEL)`` index, e.g. ``TopK``'s ranks). Results of
rows of one value (a vector, not ``(rows, d)``) give one row. pandas is needed only here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from sharded_scan.errors import UsageError


def pandas():
    """The pandas module, or one line saying how to install it."""
    try:
        import pandas as pd
    except ImportError:
        raise UsageError("to_pandas() needs pandas; pip install pandas.") from None
    return pd


def labels(result: Any, d: int) -> Any:
    """The names of the data's ``d`` columns (the result's ``columns``; positions without them)."""
    names = getattr(result, "columns", None)
    if names is None or len(names) != d:
        return list(range(d))
    return np.asarray(names).tolist()


def frame(result: Any, fields: Sequence[str | tuple[str, Any]], *, spread: dict[str, Any] | None = None,
          long: str | None = None):
    """``result``'s per-column ``fields`` as a DataFrame with a row per column of the data.

    Args:
      result: a result NamedTuple (its ``columns`` name the rows).
      fields: the statistics, in order: a field's name, or ``(label, array)`` for a value the
        result derives. Each is a scalar (the same for every column), ``(d,)``, or ``(d, m)``;
        with rows of one value (``columns`` empty), ``()`` or ``(m,)``.
      spread: labels of the ``m`` values of the ``(d, m)`` fields named here (the output's
        column labels).
      long: instead of spreading, the ``(d, m)`` fields become ``m`` rows per column, indexed
        ``(column, long)`` with ``long`` running ``0..m-1``; the other fields repeat.
    """
    pd = pandas()
    spread = spread or {}
    named = [(f, getattr(result, f)) if isinstance(f, str) else f for f in fields]
    columns = getattr(result, "columns", None)
    one = columns is not None and len(columns) == 0  # rows of one value: every field unnested
    arrays = {}
    for name, value in named:
        value = np.asarray(value)
        if one and value.ndim:
            value = value[None]
        arrays[name] = value
    wide = {name for name, v in arrays.items() if v.ndim == 2} if long else set(spread)
    per_column = [v for v in arrays.values() if v.ndim]
    d = per_column[0].shape[0] if per_column else 1
    index = labels(result, d) if not one else [0]
    if long:
        m = max((arrays[name].shape[1] for name in wide), default=1)
        rows = pd.MultiIndex.from_product([index, range(m)], names=[None, long])
        data = {name: (v.reshape(-1) if name in wide else np.repeat(np.broadcast_to(v, (d,)), m))
                for name, v in arrays.items()}
        return pd.DataFrame(data, index=rows)
    data = {}
    for name, value in arrays.items():
        if name in spread:
            for i, label in enumerate(np.asarray(spread[name]).tolist()):
                data[label] = value[:, i]
        else:
            data[name] = np.broadcast_to(value, (d,))
    return pd.DataFrame(data, index=index)
