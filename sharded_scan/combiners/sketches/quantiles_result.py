"""What a quantile sketch holds and answers: its accumulator, its result, the result from keys.

Shared by the one-pass sketch (``quantiles.py``), the exact passes (``quantiles_exact.py``)
and ``Describe``. ``method`` is numpy's: the answer for ``q`` over ``n`` values sits at the
virtual index ``h = q (n - 1)`` of the sorted values ``v``; ``"linear"`` (numpy's and pandas'
default) is ``v[floor h] + (h - floor h) (v[ceil h] - v[floor h])``, ``"lower"`` ``v[floor h]``,
``"higher"`` ``v[ceil h]``, ``"nearest"`` ``v[round h]`` (halves to even, as ``np.around``),
``"midpoint"`` the mean of ``v[floor h]`` and ``v[ceil h]``; ``"inverted_cdf"`` ``v[max(ceil(q n) - 1, 0)]``,
the smallest value whose share of the rows at or below it is at least ``q``, and the one method of
weighted quantiles (as ``np.quantile(..., weights=w)``): the smallest value whose share of the total
weight at or below it is at least ``q``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import numpy as np

from sharded_scan.combiners import wide
from sharded_scan.combiners.results import frame
from sharded_scan.combiners.sketches import kll, kll_weighted
from sharded_scan.combiners.sketches.datasketches import kll_sketches
from sharded_scan.combiners.sketches.keys import decode, is_float, nan_key
from sharded_scan.errors import UsageError

METHODS = ("linear", "lower", "higher", "nearest", "midpoint", "inverted_cdf")
# The methods that answer with one of the values, never a mix of two: an integer column's answers are its integers.
DISCONTINUOUS = ("lower", "higher", "nearest", "inverted_cdf")


class QuantilesResult(NamedTuple):
    """Per column, the value at each ``q`` and how far its rank may be from ``q (n - 1)``.

    ``quantiles`` is ``(d, len(qs))`` float64 (``(len(qs),)`` for rows of one value; a
    :data:`DISCONTINUOUS` method's over integer rows: the rows' own integers, int64, uint64 for
    uint64 columns, as ``np.quantile``'s), each answer read at the ranks ``method`` names
    (``np.quantile``'s; see the module docstring),
    NaN for a column that holds NaN (numpy's ``np.quantile`` does the same) or has no
    rows (``nan_policy="omit"``: no finite values, ``count`` then per column, each column's finite
    values); ``rank_error`` bounds ``|rank - q (n - 1)| / n`` of every answer with
    probability ``0.99`` each (0: exact); ``passes`` counts the passes over the data;
    ``sketch`` the merged sketch, a record per column (:func:`~.datasketches.kll_state_dtype`;
    None after exact passes), what :meth:`to_datasketches` writes.
    """

    quantiles: np.ndarray
    qs: np.ndarray
    count: np.ndarray
    rank_error: np.ndarray
    passes: np.ndarray
    sketch: np.ndarray | None = None
    columns: np.ndarray | None = None  # X's column names (a DataFrame, Parquet, CSV), else np.arange(d)

    def to_pandas(self):
        """A DataFrame like ``df.quantile(qs).T``: a row per column, a column per ``q``."""
        return frame(self, ("quantiles",), spread={"quantiles": self.qs})

    def to_datasketches(self) -> list[bytes] | bytes:
        """Per column, the bytes of an Apache DataSketches KLL sketch of the column's sketch.

        ``datasketches.kll_floats_sketch.deserialize`` reads a float32 column's,
        ``kll_doubles_sketch.deserialize`` any other's (integers as doubles); NaN is left out, as
        DataSketches does. A list of ``d`` bytes (one bytes for rows of one value).
        """
        blobs = kll_sketches(self.sketch)
        return blobs[0] if np.ndim(self.quantiles) == 1 else blobs


class WeightedQuantilesAcc(NamedTuple):
    """The weighted sketch, the rows of positive weight, the total weight, the smallest and largest key."""

    sketch: kll_weighted.WeightedSketch
    count: wide.Wide
    weight: jax.Array  # float (): the total weight
    low: jax.Array
    high: jax.Array
    kind: jax.Array


class QuantilesAcc(NamedTuple):
    """The sketch, the row count, each column's smallest and largest key, the key kind."""

    sketch: kll.Sketch
    count: wide.Wide
    low: jax.Array   # uint32 or uint64 keys (d,) or (): the smallest key (the filler with no rows)
    high: jax.Array  # the same: the largest key (keys.nan_key once a NaN was seen)
    kind: jax.Array  # int32 (): keys.kind_code, so that finalize can turn keys back into values


def check_method(method, who: str) -> str:
    """``method`` when it is one of numpy's :data:`METHODS`, else one line naming them."""
    if method not in METHODS:
        raise UsageError(f"{who} method must be one of {', '.join(map(repr, METHODS))} (as np.quantile), "
                         f"got method={method!r}.")
    return method


def method_ranks(qs: np.ndarray, n, method: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ranks ``(low, high)`` (int64) whose values ``method`` mixes for each ``q`` over ``n`` values,
    and the weight of the high one; ``n`` may be an array ``(d, 1)`` (per column)."""
    h = np.asarray(qs, np.float64) * (np.maximum(np.asarray(n, np.float64), 1) - 1)
    low, high = np.floor(h), np.ceil(h)
    weight = np.zeros_like(h)
    if method == "linear":
        weight = h - low
    elif method == "lower":
        high = low
    elif method == "higher":
        low = high
    elif method == "nearest":
        low = high = np.around(h)
    elif method == "inverted_cdf":
        low = high = np.maximum(np.ceil(np.asarray(qs, np.float64) * np.maximum(np.asarray(n, np.float64), 1)) - 1, 0)
    else:  # midpoint
        weight = np.where(high > low, 0.5, 0.0)
    return low.astype(np.int64), high.astype(np.int64), weight


def interpolate(low: np.ndarray, high: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """``low + weight (high - low)`` as numpy's quantiles compute it (from ``high`` for weights of
    one half or more); exactly ``low`` where the weight is 0 or the values are equal (infinities too).
    Finite ends further apart than the largest float or int64 (``high - low`` overflows, or wraps
    below 0: numpy answers -inf, NaN or past ``high``) mix as ``low (1 - weight) + high weight`` in
    float64, which cannot overflow: the value between them."""
    with np.errstate(invalid="ignore", over="ignore"):  # infinities, and finite ends further apart than the largest
        diff = high - low
        mixed = np.where(weight >= 0.5, high - diff * (1 - weight), low + diff * weight)
        apart = (np.isinf(diff) | (diff < 0)) & np.isfinite(low) & np.isfinite(high)  # high >= low: sorted
        mixed = np.where(apart, low * (1 - weight) + high * weight, mixed)
    return np.where((weight == 0) | (low == high), low, mixed)


def values_at(acc: QuantilesAcc, qs: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Per column and q (``(d, len(qs))``), the values of ``keys`` (the column's own: int64, uint64 for
    uint64 columns, float64), ``q = 0`` and ``q = 1`` the column's exact smallest and largest."""
    first, last = np.asarray(acc.low).reshape(-1)[:, None], np.asarray(acc.high).reshape(-1)[:, None]
    return decode(np.where(qs[None, :] == 0, first, np.where(qs[None, :] == 1, last, keys)), acc.kind)


def values_from_keys(acc: QuantilesAcc, qs: np.ndarray, low: np.ndarray, high: np.ndarray,
                     weight: np.ndarray) -> np.ndarray:
    """Per column and q (``(d, len(qs))``), the value between the keys ``low`` and ``high`` at
    ``weight`` (float64); ``q = 0`` and ``q = 1`` are the column's exact smallest and largest keys."""
    return interpolate(values_at(acc, qs, low), values_at(acc, qs, high), weight)


def result_from_keys(acc: QuantilesAcc, qs: np.ndarray, picks: tuple[np.ndarray, np.ndarray, np.ndarray],
                     rows: int, bound: float, passes: int, method: str):
    """Builds the result from per-column keys ``(d, len(qs))`` at the ranks ``method_ranks`` gave for
    ``method`` and its weights (``picks``: the keys at the low ranks, at the high ones, the weights):
    exact ends, NaN columns, shape. A :data:`DISCONTINUOUS` method's answers over integer rows are
    the rows' own integers (int64; uint64 for uint64 columns), else float64 (NaN with no rows)."""
    low, high, weight = picks
    rows = np.asarray(rows)  # per column ``(d,)`` under ``nan_policy="omit"`` (each column's finite values)
    if method in DISCONTINUOUS and not is_float(acc.kind) and np.all(rows > 0):
        values = values_at(acc, qs, low)  # such a method reads one rank: low and high are the same keys
    else:
        values = values_from_keys(acc, qs, low, high, np.broadcast_to(weight, low.shape)).astype(np.float64)
    high = np.asarray(acc.high).reshape(-1)
    nan = (high == nan_key(high.dtype)) & is_float(acc.kind)
    if values.dtype.kind == "f":
        values[nan | (rows == 0)] = np.nan
    if np.ndim(acc.low) == 0:
        values, rows = values[0], rows.reshape(-1)[0]
    bound = 0.0 if math.isnan(bound) else bound
    return QuantilesResult(values, qs.copy(), rows.astype(np.int64)[()], np.float64(bound), np.int64(passes))


def finite_weight(host: kll.HostSketch, kind) -> np.ndarray:
    """Per column ``(d, 1)``: the sketch's weight of finite values (below NaN's key; every item for integers)."""
    if host.keys.shape[1] == 0:
        return np.ones((host.keys.shape[0], 1))
    if not is_float(kind):
        return host.cumulative[:, -1:]
    items = np.sum(host.keys < nan_key(host.keys.dtype), axis=1)
    at = np.take_along_axis(host.cumulative, np.maximum(items - 1, 0)[:, None], axis=1)
    return np.where(items[:, None] > 0, at, 0.0)
