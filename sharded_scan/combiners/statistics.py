"""Stable second-order statistics: covariance and per-column moments.

Each device keeps ``(count, shift, mean, M2)``: ``mean`` is measured from ``shift``, a
value taken from the rows the accumulator saw, so that float32 keeps the digits of the
data's spread even when its mean is large (e.g. 1e4 + N(0, 1)). A micro-batch is folded
in one pass over its rows: shifted power sums of ``x - c`` (squares, or outer products
for the covariance), with ``c`` the accumulator's running mean, so that ``x - c`` is
small and the sums keep their digits; Chan's formula folds them in with O(d) work, and
partials are merged with it too. Nothing subtracts a square of sums of raw values from
a sum of their squares.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sharded_scan.combiners import wide
from sharded_scan.combiners.base import Combiner, accumulator_dtype, masked, row_count
from sharded_scan.combiners.results import frame, labels
from sharded_scan.combiners.sums import check_matrix_spec
from sharded_scan.errors import UsageError


class CenteredAcc(NamedTuple):
    """Rows seen, the reference point, the mean measured from it, and the centred M2."""

    count: wide.Wide  # rows, exact past 2^31
    shift: jax.Array  # (d,)
    mean: jax.Array   # (d,) mean - shift
    m2: jax.Array     # (d, d) sum of outer products of centred rows, or (d,) of squares, less m2_lost
    m2_lost: jax.Array  # Kahan compensation of m2 (many small micro-batches would drift by their count x eps)


def centered_init(d: int, dtype, full: bool) -> CenteredAcc:
    """The identity: no rows."""
    zeros = jnp.zeros((d,), dtype)
    m2 = jnp.zeros((d, d) if full else (d,), dtype)
    return CenteredAcc(wide.zeros(), zeros, zeros, m2, m2)


def _scatter(a: jax.Array, b: jax.Array, full: bool) -> jax.Array:
    return jnp.outer(a, b) if full else a * b


def centered_merge(a: CenteredAcc, b: CenteredAcc, full: bool) -> CenteredAcc:
    """Chan's pairwise combination; exact identity when either side has no rows."""
    n = wide.add(a.count, b.count)
    a_empty, b_empty = wide.is_zero(a.count), wide.is_zero(b.count)
    shift = jnp.where(a_empty, b.shift, a.shift)
    mean_a = a.mean + (a.shift - shift)   # the shifts are close, so their difference is exact
    mean_b = b.mean + (b.shift - shift)
    delta = mean_b - mean_a
    na, nb = wide.to_float(a.count, delta.dtype), wide.to_float(b.count, delta.dtype)
    nf = jnp.maximum(wide.to_float(n, delta.dtype), 1)
    mean = jnp.where(a_empty, mean_b, jnp.where(b_empty, mean_a, mean_a + delta * (nb / nf)))
    m2 = a.m2 + b.m2 + _scatter(delta, delta, full) * (na * (nb / nf))
    return CenteredAcc(n, shift, mean, m2, a.m2_lost + b.m2_lost)


def centered_fold(acc: CenteredAcc, x: jax.Array, mask: jax.Array, full: bool) -> CenteredAcc:
    """Folds a micro-batch's real rows into ``acc`` in one pass over them.

    The rows are measured from the accumulator's mean ``c = shift + mean`` as
    ``(x - shift) - mean``, so that ``c`` is never rounded (a fresh accumulator's
    ``shift`` is the mean of a few of the micro-batch's real rows; after each fold TwoSum moves it onto
    the running mean). With ``S1, S2`` their sum and sum of squares (outer products),
    ``delta = S1 / n_b`` is the micro-batch's mean minus ``c`` and Chan's formula gives
    ``M2 = M2_a + (S2 - S1 delta) + delta² n_a n_b / n``. An empty micro-batch
    (no real row) leaves ``acc`` exactly as it was.
    """
    dtype = acc.m2.dtype
    x = x.astype(dtype)
    nb = row_count(mask)
    fresh = wide.is_zero(acc.count)
    shift = jnp.where(fresh, reference_point(acc.shift, x, mask, nb), acc.shift)
    dev = masked((x - shift) - acc.mean, mask)
    n = wide.add_int32(acc.count, nb)
    before = wide.to_float(acc.count, dtype)
    s1 = jnp.sum(dev, axis=0)
    delta = s1 / jnp.maximum(nb, 1).astype(dtype)
    s2 = jnp.matmul(dev.T, dev, preferred_element_type=dtype) if full else jnp.sum(dev * dev, axis=0)
    weight = nb.astype(dtype) / jnp.maximum(before + nb.astype(dtype), 1)
    y = (s2 - _scatter(s1, delta, full)) + _scatter(delta, delta, full) * (before * weight) - acc.m2_lost
    m2 = acc.m2 + y
    lost = (m2 - acc.m2) - y
    moved, mean = _two_sum(shift, acc.mean + delta * weight)
    some = nb > 0
    return CenteredAcc(n, jnp.where(some, moved, acc.shift), jnp.where(some, mean, acc.mean), m2, lost)


HEAD_ROWS = 64  # a fresh accumulator's shift is the mean of at most this many real rows


def reference_point(shift: jax.Array, x: jax.Array, mask: jax.Array, nb: jax.Array) -> jax.Array:
    """A fresh accumulator's reference point, read from a few real rows, never padding.

    The micro-batch's first real row plus the masked mean of its first ``HEAD_ROWS``
    rows' differences from it (a slice, not a pass over the micro-batch): close to the
    mean, and exactly the value of a column whose rows are all equal, so a constant
    column's deviations are exactly 0 at any magnitude. With no real row, ``shift``.
    """
    # The barrier keeps XLA from constant-folding the argmax of an all-True mask (seconds of compile).
    first = jnp.where(nb > 0, x[jnp.argmax(jax.lax.optimization_barrier(mask))], shift)
    head, head_mask = x[:HEAD_ROWS], mask[:HEAD_ROWS]
    nh = row_count(head_mask)
    offset = jnp.sum(masked(head - first, head_mask), axis=0) / jnp.maximum(nh, 1).astype(x.dtype)
    return first + offset


def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(hi, lo)`` with ``hi = fl(a + b)`` and ``hi + lo == a + b`` exactly (Knuth's TwoSum).

    Moves ``shift`` onto the running mean, so the next micro-batch is measured from
    the mean, and ``mean`` keeps only the residual digits.
    """
    hi = a + b
    b_part = hi - a
    return hi, (a - (hi - b_part)) + (b - b_part)


def host_mean(acc: CenteredAcc) -> np.ndarray:
    """The mean in float64 on the host."""
    return np.asarray(acc.shift, np.float64) + np.asarray(acc.mean, np.float64)


def check_ddof(ddof, who: str) -> None:
    """Raises :class:`UsageError` unless ``ddof`` is a non-negative integer."""
    if isinstance(ddof, bool) or not isinstance(ddof, (int, np.integer)) or ddof < 0:
        raise UsageError(f"{who} ddof must be a non-negative integer (0 like np.var, 1 like np.cov), got {ddof!r}.")


def no_rows(count: int, who: str) -> bool:
    """True, with a warning, when ``count`` is 0: statistics of no rows are NaN (as numpy's)."""
    if count:
        return False
    warnings.warn(
        f"{who} of no rows (every row was padding or skipped by nan_policy='omit'): its statistics are NaN, "
        "as numpy's mean of no values is.", RuntimeWarning, stacklevel=3,
    )
    return True


def _divide(m2: np.ndarray, dof: float) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray(m2, np.float64) / (dof if dof > 0 else 0.0)


def host_m2(acc: CenteredAcc) -> np.ndarray:
    """The compensated M2 in float64, its variances (the diagonal, or every entry of a
    vector) at least 0: rounding can leave a sum of squared deviations a few ulps below
    zero. NaN stays."""
    m2 = np.asarray(acc.m2, np.float64) - np.asarray(acc.m2_lost, np.float64)
    diagonal = m2 if m2.ndim == 1 else np.einsum("ii->i", m2)
    diagonal[diagonal < 0] = 0.0
    return m2


class CovarianceResult(NamedTuple):
    """Row count, column means and the (d, d) covariance, like ``np.cov(x, rowvar=False)``."""

    count: np.ndarray
    mean: np.ndarray
    cov: np.ndarray
    columns: np.ndarray | None = None  # X's column names (a DataFrame, Parquet, CSV), else np.arange(d)

    def to_pandas(self):
        """The covariance matrix as a DataFrame named by the columns both ways, like ``df.cov()``."""
        return frame(self, ("cov",), spread={"cov": labels(self, np.shape(self.cov)[0])})


@dataclasses.dataclass(frozen=True)
class Covariance(Combiner):
    """The covariance matrix of rows X (n, d), stable for data far from zero.

    Args:
      ddof: delta degrees of freedom; the divisor is ``count - ddof`` (1, the default, like
        ``np.cov`` and ``df.cov()``; each built-in takes the default of the function it
        mirrors: ``Moments`` 0 like ``np.var``, ``Describe`` 1 like pandas).
    """

    ddof: int = 1

    def check_spec(self, spec):
        super().check_spec(spec)
        check_matrix_spec(spec, type(self).__name__)
        check_ddof(self.ddof, type(self).__name__)

    def init(self, spec):
        return centered_init(spec.shape[0], accumulator_dtype(spec.dtype), full=True)

    def add(self, acc, batch, mask):
        return centered_fold(acc, batch, mask, full=True)

    def merge(self, a, b):
        return centered_merge(a, b, full=True)

    def finalize(self, acc):
        count = wide.to_int(acc.count)
        if no_rows(count, "Covariance"):
            return CovarianceResult(count, *(np.full(np.shape(a), np.nan) for a in (acc.mean, acc.m2)))
        return CovarianceResult(count, host_mean(acc), _divide(host_m2(acc), count - self.ddof))


class MomentsResult(NamedTuple):
    """Per column: row count, mean, variance (``np.var`` with ``ddof``), min and max."""

    count: np.ndarray
    mean: np.ndarray
    var: np.ndarray
    min: np.ndarray
    max: np.ndarray
    columns: np.ndarray | None = None  # X's column names (a DataFrame, Parquet, CSV), else np.arange(d)

    def to_pandas(self):
        """A DataFrame: a row per column, ``count, mean, var, min, max`` (``df.agg([...]).T``)."""
        return frame(self, ("count", "mean", "var", "min", "max"))


class MomentsAcc(NamedTuple):
    centered: CenteredAcc
    min: jax.Array
    max: jax.Array


@dataclasses.dataclass(frozen=True)
class Moments(Combiner):
    """Per-column count, mean, variance, min and max of rows X (n, d).

    Args:
      ddof: delta degrees of freedom of the variance (0, the default, like ``np.var``; 1 like
        pandas' ``var()`` and ``Covariance``'s default).
    """

    ddof: int = 0

    def check_spec(self, spec):
        super().check_spec(spec)
        check_matrix_spec(spec, type(self).__name__)
        check_ddof(self.ddof, type(self).__name__)

    def init(self, spec):
        d, dtype = spec.shape[0], accumulator_dtype(spec.dtype)
        return MomentsAcc(
            centered_init(d, dtype, full=False), jnp.full((d,), jnp.inf, dtype), jnp.full((d,), -jnp.inf, dtype)
        )

    def add(self, acc, batch, mask):
        x = batch.astype(acc.min.dtype)
        return MomentsAcc(
            centered_fold(acc.centered, x, mask, full=False),
            jnp.minimum(acc.min, jnp.min(masked(x, mask, jnp.inf), axis=0)),
            jnp.maximum(acc.max, jnp.max(masked(x, mask, -jnp.inf), axis=0)),
        )

    def merge(self, a, b):
        return MomentsAcc(
            centered_merge(a.centered, b.centered, full=False), jnp.minimum(a.min, b.min), jnp.maximum(a.max, b.max)
        )

    def finalize(self, acc):
        count = wide.to_int(acc.centered.count)
        if no_rows(count, "Moments"):
            return MomentsResult(count, *(np.full(np.shape(acc.min), np.nan) for _ in range(4)))
        return MomentsResult(
            count,
            host_mean(acc.centered),
            _divide(host_m2(acc.centered), count - self.ddof),
            np.asarray(acc.min),
            np.asarray(acc.max),
        )
