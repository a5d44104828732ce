"""What a quantile sketch holds and answers: its accumulator, its result, the result from keys.

Shared by the one-pass sketch (``quantiles.py``) and the exact passes (``quantiles_exact.py``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import numpy as np

from sharded_scan.combiners import kll, wide
from sharded_scan.combiners.keys import decode, is_float, nan_key


class QuantilesResult(NamedTuple):
    """Per column, the value at each ``q`` and how far its rank may be from ``q (n - 1)``.

    ``quantiles`` is ``(d, len(qs))`` float64 (``(len(qs),)`` for rows of one value),
    NaN for a column that holds NaN (numpy's ``np.quantile`` does the same) or has no
    rows; ``rank_error`` bounds ``|rank - q (n - 1)| / n`` of every answer with
    probability ``0.99`` each (0: exact); ``passes`` counts the passes over the data.
    """

    quantiles: np.ndarray
    qs: np.ndarray
    count: np.ndarray
    rank_error: np.ndarray
    passes: np.ndarray
    columns: np.ndarray | None = None  # X's column names (a DataFrame, Parquet, CSV), else np.arange(d)


class QuantilesAcc(NamedTuple):
    """The sketch, the row count, each column's smallest and largest key, the key kind."""

    sketch: kll.Sketch
    count: wide.Wide
    low: jax.Array   # uint32 or uint64 keys (d,) or (): the smallest key (the filler with no rows)
    high: jax.Array  # the same: the largest key (keys.nan_key once a NaN was seen)
    kind: jax.Array  # int32 (): keys.kind_code, so that finalize can turn keys back into values


def result_from_keys(acc: QuantilesAcc, qs: np.ndarray, keys: np.ndarray, rows: int, bound: float, passes: int):
    """Builds the result from per-column keys ``(d, len(qs))``: exact ends, NaN columns, shape."""
    low, high = np.asarray(acc.low).reshape(-1), np.asarray(acc.high).reshape(-1)
    keys = np.where(qs[None, :] == 0, low[:, None], np.where(qs[None, :] == 1, high[:, None], keys))
    values = decode(keys, acc.kind).astype(np.float64)
    nan = (high == nan_key(high.dtype)) & is_float(acc.kind)
    values[nan | (rows == 0)] = np.nan
    if np.ndim(acc.low) == 0:
        values = values[0]
    bound = 0.0 if math.isnan(bound) else bound
    return QuantilesResult(values, qs.copy(), np.int64(rows), np.float64(bound), np.int64(passes))
