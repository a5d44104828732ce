"""Per-column results as pandas: the one helper behind every result's ``to_pandas()``.

A result of per-column values becomes a ``DataFrame`` with one row per column of the data
(the index: the result's ``columns``, the names when the data named them, else positions)
and one column per statistic, each keeping its dtype (counts stay integers). A statistic
with several values per column (``(d, m)``: the quantiles at each ``q``, the covariance with
every column) spreads over ``m`` columns labelled by what they are; ``long=`` turns such
statistics into rows instead (a ``(column, LABEL)`` index, e.g. ``TopK``'s ranks). A result of
rows of one value (a vector, not ``(rows, d)``) gives one row. pandas is needed only here.

Also the one JSON spelling of every JSON file the project writes (``result.json``, ``describe.json``,
``summary.json``): :func:`json_value`, :func:`json_text`.
"""

from __future__ import annotations

import json
import math
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


# JSON has no NaN and no infinities: NaN is written null, the infinities these strings (Python's float() reads them).
INF, NEG_INF = "inf", "-inf"


def json_value(value: Any) -> Any:
    """``value`` in the values strict JSON has, spelt the one way every JSON file of the project spells them.

    numpy arrays become lists and numpy scalars numbers; NaN becomes null and the infinities the
    strings ``"inf"`` / ``"-inf"``; bytes UTF-8 text; dicts, lists and tuples are converted
    element by element; anything else is left as it is (for ``json.dumps``' ``default``).
    """
    if isinstance(value, np.ndarray | np.generic):
        return json_value(value.tolist())
    if isinstance(value, dict):
        return {k: json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_value(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else (INF if value > 0 else NEG_INF)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def json_text(value: Any, **dumps: Any) -> str:
    """``value`` as strict JSON text (:func:`json_value`'s spelling; ``dumps``: ``json.dumps``' ``indent``...):
    a reader that refuses NaN and Infinity (``json.loads(..., parse_constant=...)``, other languages) reads it."""
    return json.dumps(json_value(value), allow_nan=False, **dumps)


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
