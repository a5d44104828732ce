"""Per-column results as pandas: the one helper behind every result's ``to_pandas()``.

A result of per-column values becomes a ``DataFrame`` with one row per column of the data
(the index: the result's ``columns``, the names when the data named them, else positions)
and one column per statistic, each keeping its dtype (counts stay integers). A statistic
with several values per column (``(d, m)``: the quantiles at each ``q``, the covariance with
every column) spreads over ``m`` columns labelled by what they are; ``long=`` turns such
statistics into rows instead (a ``(column, LABEL)`` index, e.g. ``TopK``'s ranks). A result of
rows of one value (a vector, not ``(rows, d)``) gives one row. pandas is needed only here.
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


def labels(result: Any, d: int) -> list:
    """The names of the data's ``d`` columns (the result's ``columns``; positions without them)."""
    names = getattr(result, "columns", None)
    if names is None or len(names) != d:
        return list(range(d))
    return np.asarray(names).tolist()


def frame(result: Any, fields: Sequence[str | tuple[str, Any]], *, spread: dict[str, Any] | None = None,
          long: tuple[str, Sequence[str]] | None = None):
    """``result``'s per-column ``fields`` as a DataFrame with a row per column of the data.

    Args:
      result: a result NamedTuple (its ``columns`` name the rows).
      fields: the statistics, in order: a field's name, or ``(label, array)`` for a value the
        result derives. Each is a scalar (the same for every column), ``(d,)``, or, when
        named in ``spread`` or ``long``, ``(d, m)`` (``(m,)`` for rows of one value).
      spread: labels of the ``m`` values of the ``(d, m)`` fields named here (the output's
        column labels, in the field's place).
      long: ``(label, names)``: the ``(d, m)`` fields ``names`` become ``m`` rows per column
        instead, indexed ``(column, label)`` with ``label`` running ``0..m-1``; the other
        fields repeat.
    """
    pd = pandas()
    spread = spread or {}
    label, tall = long or (None, ())
    arrays = {}
    for field in fields:
        name, value = (field, getattr(result, field)) if isinstance(field, str) else field
        value = np.asarray(value)
        arrays[name] = value[None] if (name in spread or name in tall) and value.ndim == 1 else value
    names = getattr(result, "columns", None)
    d = max([0 if names is None else len(names)] + [v.shape[0] for v in arrays.values() if v.ndim])
    index = labels(result, max(d, 1))
    if long:
        m = max((arrays[name].shape[1] for name in tall), default=1)
        rows = pd.MultiIndex.from_product([index, range(m)], names=[None, label])
        data = {name: (v.reshape(-1) if name in tall else np.repeat(np.broadcast_to(v, (len(index),)), m))
                for name, v in arrays.items()}
        return pd.DataFrame(data, index=rows)
    data = {}
    for name, value in arrays.items():
        if name in spread:
            for i, column in enumerate(np.asarray(spread[name]).tolist()):
                data[column] = value[:, i]
        else:
            data[name] = np.broadcast_to(value, (len(index),))
    return pd.DataFrame(data, index=index)
