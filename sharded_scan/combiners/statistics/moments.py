"""Stable second-order statistics: the centred accumulator (of :mod:`.comoments` too), per-column moments,
and the weighted form of both.

Each device keeps ``(count, shift, mean, M2)``: ``mean`` is measured from ``shift``, a
value taken from the rows the accumulator saw, so that float32 keeps the digits of the
data's spread even when its mean is large (e.g. 1e4 + N(0, 1)). A micro-batch is folded
in one pass over its rows: shifted power sums of ``x - c`` (squares, or outer products
for the covariance), with ``c`` the accumulator's running mean, so that ``x - c`` is
small and the sums keep their digits; Chan's formula folds them in with O(d) work, and
partials are merged with it too. Nothing subtracts a square of sums of raw values from
a sum of their squares.

The co-moments of ``Covariance`` and ``Correlation`` (:mod:`.comoments`) are this accumulator with
``full=True``; on a ``model`` axis split by columns (:func:`own_columns`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sharded_scan.combiners import wide
from sharded_scan.combiners.base import Combiner, masked, row_count
from sharded_scan.combiners.column_split import (
    SplitsEachColumn,
    column_block,
    padded_columns,
    round_up,
)
from sharded_scan.combiners.keyed_sums import keyed_sum
from sharded_scan.combiners.results import frame
from sharded_scan.combiners.statistics.sums import check_matrix_spec, key_counts
from sharded_scan.combiners.wrappers.policies import kahan_add, kahan_total
from sharded_scan.dtypes import accumulator_dtype
from sharded_scan.errors import UsageError


class CenteredAcc(NamedTuple):
    """Rows seen, the reference point, the mean measured from it, and the centred M2."""

    count: wide.Wide  # rows, exact past 2^31
    shift: jax.Array  # (d,)
    mean: jax.Array   # (d,) mean - shift
    m2: jax.Array     # (d, d) sum of outer products of centred rows, or (d,) of squares, less m2_lost
    #                   (split over model: (d, round_up(d, M)), each device its columns)
    m2_lost: jax.Array  # Kahan compensation of m2 (many small micro-batches would drift by their count x eps)


def centered_init(d: int, dtype, full: bool, shards: int = 1) -> CenteredAcc:
    """The identity: no rows (``shards``: the full co-moments split by columns over that many
    ``model`` devices, their columns padded to a multiple of it)."""
    zeros = jnp.zeros((d,), dtype)
    m2 = jnp.zeros((d, round_up(d, shards)) if full else (d,), dtype)
    return CenteredAcc(wide.zeros(), zeros, zeros, m2, m2)


def own_columns(v: jax.Array, width: int, shards: int) -> jax.Array:
    """The entries of ``v`` (``(..., d)``) along the columns of a co-moment matrix ``width`` wide, split
    over ``shards`` ``model`` devices: all of them, padded with zeros, where ``width`` is
    ``round_up(d, shards)`` (the matrix whole: e.g. a checkpoint's split partials folded on one device),
    else this device's block (inside ``shard_map``)."""
    d = v.shape[-1]
    if width == d:
        return v
    if width == round_up(d, shards):
        return padded_columns(v, d, width, axis=v.ndim - 1)
    return column_block(v, shards, axis=v.ndim - 1)


def _scatter(a: jax.Array, b: jax.Array, full: bool, width: int = 0, shards: int = 1) -> jax.Array:
    """``a`` times ``b``: when ``full`` their outer product, of ``b``'s entries in a matrix ``width`` wide."""
    return jnp.outer(a, own_columns(b, width, shards)) if full else a * b


def centered_merge(a: CenteredAcc, b: CenteredAcc, full: bool, shards: int = 1) -> CenteredAcc:
    """Chan's pairwise combination; exact identity when either side has no rows."""
    dtype = a.m2.dtype
    return merged(a, b, wide.to_float(a.count, dtype), wide.to_float(b.count, dtype), full, shards)[0]


def merged(a: CenteredAcc, b: CenteredAcc, na, nb, full: bool,
           shards: int = 1) -> tuple[CenteredAcc, jax.Array, jax.Array]:
    """:func:`centered_merge` of accumulators of weights ``na`` and ``nb`` (their row counts when
    unweighted; ``shards``: the co-moments split over that many ``model`` devices); also returns
    ``delta``, ``b``'s mean minus ``a``'s, and ``nb / (na + nb)``."""
    n = wide.add(a.count, b.count)
    a_empty, b_empty = wide.is_zero(a.count), wide.is_zero(b.count)
    shift = jnp.where(a_empty, b.shift, a.shift)
    mean_a = a.mean + (a.shift - shift)   # the shifts are close, so their difference is exact
    mean_b = b.mean + (b.shift - shift)
    # An empty side's shift may lie anywhere (far from the other's: a delta of inf, then inf * 0): no delta.
    delta = jnp.where(a_empty | b_empty, 0, mean_b - mean_a)
    total = na + nb
    share = nb / jnp.where(total > 0, total, 1)
    mean = jnp.where(a_empty, mean_b, jnp.where(b_empty, mean_a, mean_a + delta * share))
    # Finite means further apart than the largest float overflow delta: their convex combination instead.
    center_a, center_b = a.shift + a.mean, b.shift + b.mean
    over = ~jnp.isfinite(mean) & jnp.isfinite(center_a) & jnp.isfinite(center_b)
    shift = jnp.where(over, center_a * (1 - share) + center_b * share, shift)
    mean = jnp.where(over, 0, mean)
    m2 = a.m2 + b.m2 + _scatter(delta, delta, full, a.m2.shape[-1], shards) * (na * share)
    return CenteredAcc(n, shift, mean, m2, a.m2_lost + b.m2_lost), delta, share


def centered_fold(acc: CenteredAcc, x: jax.Array, mask: jax.Array, full: bool, weights=None,
                  before=None, shards: int = 1) -> CenteredAcc:
    """Folds a micro-batch's real rows into ``acc`` in one pass over them.

    The rows are measured from the accumulator's mean ``c = shift + mean`` as
    ``(x - shift) - mean`` (:func:`deviations`), so that ``c`` is never rounded (a fresh
    accumulator's ``shift`` is the mean of a few of the micro-batch's real rows; after each
    fold TwoSum moves it onto the running mean). With ``S1, S2`` their sum and sum of squares
    (outer products), :func:`folded` adds them by Chan's formula. An empty micro-batch (no
    real row) leaves ``acc`` exactly as it was. ``weights`` (per row, 0 where ``mask`` is
    False) and ``before`` (``acc``'s weight) for a weighted fold; else every row weighs 1.
    ``shards``: the full co-moments split by columns over that many ``model`` devices.
    """
    shift, dev, nb = deviations(acc, x, mask)
    wdev = dev if weights is None else dev * weights[:, None]
    if full and weights is None and acc.m2.shape[-1] == dev.shape[-1]:
        s1, s2 = column_sums_and_gram(dev)
    elif full:
        s1 = column_sum(wdev)
        s2 = jnp.matmul(wdev.T, own_columns(dev, acc.m2.shape[-1], shards), preferred_element_type=dev.dtype)
    else:
        s1, s2 = column_sum(wdev), column_sum(wdev * dev)
    weight = nb.astype(dev.dtype) if weights is None else jnp.sum(weights)
    before = wide.to_float(acc.count, dev.dtype) if before is None else before
    mean = batch_mean(x.astype(dev.dtype), mask, nb, weights)
    return folded(acc, shift, nb, before, weight, s1, s2, full, shards, mean)[0]


# column_sum adds rows in lines of about this many values (a whole number of rows).
SUM_LINE_VALUES = 256


def column_sum(v: jax.Array) -> jax.Array:
    """The column sums of ``v`` ``(rows, d)``, read as lines of ``g`` whole rows (``g`` the largest
    power of two dividing the row count with ``g * d`` at most :data:`SUM_LINE_VALUES`): the lines
    are added (vectorized along them), then their ``g`` rows. XLA:CPU vectorizes a column sum of
    narrow rows along the ``d`` columns only: ``d = 8``, 16384 rows, 0.067 ms, and 0.029 ms
    so (the Covariance ``add`` 0.185 -> 0.141 ms a micro-batch on 2 cores)."""
    rows, d = v.shape
    g = math.gcd(rows, 1 << (max(SUM_LINE_VALUES // max(d, 1), 1).bit_length() - 1))
    if g == 1:
        return jnp.sum(v, axis=0)
    return jnp.sum(jnp.sum(v.reshape(rows // g, g * d), axis=0).reshape(g, d), axis=0)


def _column_sums_and_gram(v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(column_sum(v), vᵀv)``: a call of its own, which ``fixed_order`` knows by its name (``TOGETHER``) and, under
    ``logical_shards`` on CPU, computes from the Gram's pass for each column's largest (the sums of the values
    rounded to 44 bits below it, exact), not a pairwise tree of its own: a Covariance ``add`` 0.99-1.05 -> 0.87
    CPU-ms a 256-row micro-batch at d=256, 0.20-0.21 -> 0.17 at d=96; XLA inlines it elsewhere."""
    return column_sum(v), jnp.matmul(v.T, v, preferred_element_type=v.dtype)


_column_sums_and_gram.__name__ = "sharded_scan.column_sums_and_gram"  # the name fixed_order.TOGETHER knows
column_sums_and_gram = jax.jit(_column_sums_and_gram)


def keyed_deviations(acc: CenteredAcc, x: jax.Array, mask: jax.Array, keys: jax.Array, num_keys: int):
    """:func:`deviations` per key (``acc`` with a leading ``num_keys`` axis): ``(shift, dev, nb,
    keys)``, a fresh key's reference point its first real row in the micro-batch (a constant
    column's deviations are still exactly 0), ``nb`` the real rows per key and ``keys`` clipped
    into range (padding rows may hold any key)."""
    x = x.astype(acc.m2.dtype)
    keys = jnp.clip(keys, 0, num_keys - 1)
    nb = key_counts(mask, keys, num_keys)
    shift = keyed_shift(acc, x, jnp.where(mask, keys, num_keys), nb, num_keys)
    return shift, masked((x - shift[keys]) - acc.mean[keys], mask), nb, keys


def keyed_shift(acc: CenteredAcc, x: jax.Array, kept: jax.Array, nb: jax.Array, num_keys: int,
                keep: jax.Array | None = None) -> jax.Array:
    """Each key's reference point: a fresh key's its first row of ``x`` whose key index (``kept``) is in range,
    found only while some key has none (an index past the last: no key). ``keep`` ``(mb, d)``: each column's
    first value of those (:class:`FiniteMoments`, a count per key and column)."""
    fresh = wide.is_zero(acc.count)
    rows = x.shape[0]

    def first():
        if keep is None:
            at = jax.ops.segment_min(jnp.arange(rows), kept, num_keys)
            return jnp.where((fresh & (nb > 0))[:, None], x[jnp.minimum(at, rows - 1)], acc.shift)
        at = jax.ops.segment_min(jnp.where(keep, jax.lax.broadcasted_iota(jnp.int32, keep.shape, 0), rows), kept,
                                 num_keys)
        return jnp.where(fresh & (nb > 0), jnp.take_along_axis(x, jnp.minimum(at, rows - 1), axis=0), acc.shift)

    return jax.lax.cond(jnp.any(fresh), first, lambda: acc.shift)


def centered_fold_keyed(acc: CenteredAcc, x, mask, keys, num_keys: int, full: bool, weights=None, before=None,
                        shards: int = 1):
    """:func:`centered_fold` per key: the sums of each key's rows by segment sums (per-row outer
    products for the full co-moments), folded into each key's accumulator by the same formulas."""
    shift, dev, nb, keys = keyed_deviations(acc, x, mask, keys, num_keys)
    wdev = dev if weights is None else dev * weights[:, None]
    s1 = keyed_sum(wdev, keys, num_keys)
    if full:
        right = own_columns(dev, acc.m2.shape[-1], shards)
        s2 = keyed_sum(wdev[:, :, None] * right[:, None, :], keys, num_keys)
    else:
        s2 = keyed_sum(wdev * dev, keys, num_keys)
    weight = nb.astype(dev.dtype) if weights is None else keyed_sum(weights, keys, num_keys)
    before = wide.to_float(acc.count, dev.dtype) if before is None else before
    out = jax.vmap(lambda *a: folded(*a, full, shards)[0])(acc, shift, nb, before, weight, s1, s2)
    return keyed_without_overflow(acc, out, before, weight, x.astype(dev.dtype), mask, keys, weights)


def deviations(acc: CenteredAcc, x: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(shift, dev, nb)``: the reference point (a fresh accumulator's from the real rows),
    the real rows measured from the accumulator's mean (0 where ``mask`` is False), and how
    many real rows there are (int32; ``mask`` ``(mb, d)``, each column's own values: a count per column,
    as ``acc``'s, :class:`FiniteMoments`)."""
    x = x.astype(acc.m2.dtype)
    nb = values_count(mask)
    fresh = wide.is_zero(acc.count)
    shift = jnp.where(fresh, reference_point(acc.shift, x, mask, nb), acc.shift)
    return shift, values_masked((x - shift) - acc.mean, mask), nb


def folded(acc: CenteredAcc, shift, rows, before, weight, s1, s2, full: bool,
           shards: int = 1, batch_mean=None) -> tuple[CenteredAcc, jax.Array, ...]:
    """``acc`` with a micro-batch added by Chan's formula, from the batch's sums about ``acc``'s mean.

    ``rows`` real rows (int32) of total weight ``weight`` (their number when unweighted) were
    measured from the mean with reference point ``shift`` (:func:`deviations`); ``before`` is
    ``acc``'s weight, ``s1, s2`` the (weighted) sums of the deviations and of their squares
    (outer products). ``delta = S1 / w_b`` is the batch's mean minus ``acc``'s and
    ``M2 = M2_a + (S2 - S1 delta) + delta² w_a w_b / w`` (split over ``shards`` ``model`` devices:
    the columns of ``acc``'s M2 and of ``s2``, :func:`own_columns`). Also returns ``delta`` and
    ``w_b / w`` (what the higher moments' update needs). ``batch_mean``: a callable giving the
    batch's mean without overflow (:func:`_without_overflow`), or None.
    """
    dtype, width = acc.m2.dtype, acc.m2.shape[-1]
    delta = s1 / jnp.where(weight > 0, weight, 1)
    share = weight / jnp.where(before + weight > 0, before + weight, 1)
    cross, square = _scatter(s1, delta, full, width, shards), _scatter(delta, delta, full, width, shards)
    m2, lost = kahan_add(acc.m2, acc.m2_lost, (s2 - cross) + square * (before * share))
    moved, mean = _two_sum(shift, acc.mean + delta * share)
    if batch_mean is not None:
        moved, mean = _without_overflow(acc, moved, mean, before, share, batch_mean)
    some = rows > 0
    out = CenteredAcc(wide.add_int32(acc.count, rows), jnp.where(some, moved, acc.shift),
                      jnp.where(some, mean, acc.mean), m2, lost)
    return out, delta.astype(dtype), share


def _without_overflow(acc: CenteredAcc, moved, mean, before, share, batch_mean):
    """``(shift, mean)`` of :func:`folded`, where they overflowed from finite rows, replaced by the
    convex combination of ``acc``'s mean and ``batch_mean()``.

    Finite rows further apart than the largest float (e.g. ``1e308`` and ``-1e308``) overflow their
    deviations from the reference point and their sums: the mean turns inf or NaN though its true
    value, between the least and the greatest row, is finite. Only then (``lax.cond``: clean data
    never pays) the batch's mean is taken as ``Σ x / n`` term by term (no partial sum leaves the
    rows' range) and weighed with ``acc``'s; the co-moments of such rows overflow (inf or NaN),
    as they truly do. Rows holding inf or NaN keep their inf or NaN mean.
    """
    old = acc.shift + acc.mean
    over = ~jnp.isfinite(moved) & ((before <= 0) | jnp.isfinite(old))

    def convex():
        new = batch_mean().astype(moved.dtype)
        new = jnp.where(before > 0, old * (1 - share) + new * share, new)
        use = over & jnp.isfinite(new)
        return jnp.where(use, new, moved), jnp.where(use, 0, mean)

    return jax.lax.cond(jnp.any(over), convex, lambda: (moved, mean))


def batch_mean(x: jax.Array, keep: jax.Array, nb: jax.Array, weights=None):
    """A callable: the mean of the rows ``keep`` of ``x`` (weighted by ``weights``, 0 where not kept; ``keep``
    ``(mb, d)``: each column's values, ``nb`` and ``weights`` theirs),
    each row divided before the sum, so that no partial sum overflows (:func:`_without_overflow`)."""
    def mean():
        scale = 1 / jnp.maximum(nb, 1).astype(x.dtype) if weights is None else by_row(weights / jnp.sum(weights, 0))
        return jnp.sum(values_masked(x, keep) * scale, axis=0)
    return mean


def keyed_without_overflow(acc: CenteredAcc, out: CenteredAcc, before, weight, x, keep, keys, weights=None):
    """:func:`_without_overflow` per key: ``out``, each key's ``acc`` (leading ``num_keys`` axis, of
    weights ``before``) with its rows of ``x`` (``keep``; ``keys`` in range) of weights ``weight`` folded
    in, with the means that overflowed from finite rows replaced by the convex combination."""
    num_keys = before.shape[0]
    total = before + weight
    per_key = (lambda v: v[:, None]) if keep.ndim == 1 else (lambda v: v)  # (mb, d): a weight per key and column
    share = per_key(weight / jnp.where(total > 0, total, 1))

    def batch_means():
        per_row = jnp.where(weight > 0, weight, 1)[keys] if weights is not None else (
            jnp.maximum(jax.ops.segment_sum(keep.astype(jnp.int32), keys, num_keys), 1)[keys].astype(x.dtype))
        scale = (weights if weights is not None else 1) / per_row
        return jax.ops.segment_sum(values_masked(x, keep) * by_row(scale), keys, num_keys)

    shift, mean = _without_overflow(acc, out.shift, out.mean, per_key(before), share, batch_means)
    return out._replace(shift=shift, mean=mean)


HEAD_ROWS = 64  # a fresh accumulator's shift is the mean of at most this many real rows


def reference_point(shift: jax.Array, x: jax.Array, mask: jax.Array, nb: jax.Array) -> jax.Array:
    """A fresh accumulator's reference point, read from a few real rows, never padding.

    The micro-batch's first real row plus the masked mean of its first ``HEAD_ROWS``
    rows' differences from it (a slice, not a pass over the micro-batch): close to the
    mean, and exactly the value of a column whose rows are all equal, so a constant
    column's deviations are exactly 0 at any magnitude. With no real row, ``shift``.
    ``mask`` ``(mb, d)``: each column's own first values.
    """
    # The barrier keeps XLA from constant-folding the argmax of an all-True mask (seconds of compile).
    if mask.ndim == 1:
        first = x[jnp.argmax(jax.lax.optimization_barrier(mask))]
    else:
        first = jnp.take_along_axis(x, jnp.argmax(jax.lax.optimization_barrier(mask), axis=0)[None], axis=0)[0]
    first = jnp.where(nb > 0, first, shift)
    head, head_mask = x[:HEAD_ROWS], mask[:HEAD_ROWS]
    nh = values_count(head_mask)
    offset = jnp.sum(values_masked(head - first, head_mask), axis=0) / jnp.maximum(nh, 1).astype(x.dtype)
    return first + offset


def values_count(mask: jax.Array) -> jax.Array:
    """The real rows of a mask of rows ``(mb,)`` (int32); of a mask per column ``(mb, d)``, each column's ``(d,)``."""
    return row_count(mask) if mask.ndim == 1 else jnp.sum(mask, axis=0, dtype=jnp.int32)


def values_masked(x: jax.Array, mask: jax.Array, fill: Any = 0) -> jax.Array:
    """:func:`~sharded_scan.combiners.base.masked` of a mask of rows ``(mb,)``; of a mask per column ``(mb, d)``,
    each value where it stands."""
    return masked(x, mask, fill) if mask.ndim == 1 else jnp.where(mask, x, jnp.asarray(fill, x.dtype))


def by_row(weights: jax.Array) -> jax.Array:
    """Weights ``(mb,)`` one a row, as broadcasting over a micro-batch's columns ``(mb, 1)``; ``(mb, d)``, one a
    value (a mask per column), as they are."""
    return weights[:, None] if weights.ndim == 1 else weights


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


def _divide(m2: np.ndarray, dof) -> np.ndarray:
    """``m2 / dof`` (NaN or inf where ``dof`` is not positive); ``dof`` an array: one a row of ``m2`` (stacked)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        if np.ndim(dof):
            dof = np.asarray(dof, np.float64)
            return np.asarray(m2, np.float64) / np.where(dof > 0, dof, 0.0)[..., None]
        return np.asarray(m2, np.float64) / (dof if dof > 0 else 0.0)


def real_columns(acc: CenteredAcc) -> CenteredAcc:
    """``acc`` (host arrays) with the real columns of its co-moment matrix, without the padding of a split."""
    d = np.shape(acc.mean)[0]
    return acc._replace(m2=acc.m2[:, :d], m2_lost=acc.m2_lost[:, :d])


def host_m2(acc: CenteredAcc, full: bool | None = None) -> np.ndarray:
    """The compensated M2 in float64, its variances (the diagonal, or every entry of a
    vector) at least 0: rounding can leave a sum of squared deviations a few ulps below
    zero. NaN stays. ``full``: a matrix (None: when not a vector); False: vectors, stacked too."""
    m2 = kahan_total(np.asarray(acc.m2, np.float64), np.asarray(acc.m2_lost, np.float64))
    diagonal = m2 if m2.ndim == 1 or full is False else np.einsum("ii->i", m2)
    diagonal[diagonal < 0] = 0.0
    return m2


def divisor(count: int, ddof: int, weight: float | None, weight_sq: float | None) -> float:
    """The divisor of a (co)variance of ``count`` rows: ``count - ddof``; weighted, as
    ``np.cov(aweights=)``: ``Σw - ddof Σw² / Σw``."""
    if weight is None:
        return count - ddof
    return weight - ddof * weight_sq / weight if weight > 0 else 0.0


class WeightedCentredAcc(NamedTuple):
    """The unweighted combiner's accumulator, and ``Σw``, ``Σw²`` (less ``lost``, their Kahan terms)."""

    value: Any
    weights: jax.Array  # (2,)
    lost: jax.Array     # (2,)


class WeightedForm(Combiner):
    """The weighted form of ``unweighted`` (a dataclass field), on rows ``(w, X)``: named, checked and laid
    out for a mesh as ``unweighted``."""

    unweighted: Combiner

    def fingerprint(self):
        return {**self.unweighted.fingerprint(), "weighted": "True"}

    def check_spec(self, spec):
        self.unweighted.check_spec(spec[1])

    def for_mesh(self, mesh):
        return dataclasses.replace(self, unweighted=self.unweighted.for_mesh(mesh))


class WeightSums(WeightedForm):
    """A weighted form that keeps ``Σw`` and ``Σw²`` (Kahan-compensated) beside ``unweighted``'s
    accumulator (:class:`WeightedCentredAcc`) and ends in ``unweighted.result(acc, Σw, Σw²)``."""

    def partition(self, mesh):
        parts = self.unweighted.partition(mesh)
        return None if parts is None else WeightedCentredAcc(parts, P(), P())

    def convert(self, acc, source):
        return acc._replace(value=self.unweighted.convert(acc.value, source.unweighted))

    def init(self, spec):
        dtype = accumulator_dtype(np.result_type(*(leaf.dtype for leaf in jax.tree.leaves(spec[1]))))
        zeros = jnp.zeros((2,), dtype)
        return WeightedCentredAcc(self.unweighted.init(spec[1]), zeros, zeros)

    def finalize(self, acc):
        weight, weight_sq = np.asarray(acc.weights, np.float64) - np.asarray(acc.lost, np.float64)
        return self.unweighted.result(acc.value, float(weight), float(weight_sq))


@dataclasses.dataclass(frozen=True)
class WeightedCentred(WeightSums):
    """The weighted form of :class:`Moments`, :class:`Covariance` and ``Correlation``, on rows ``(w, X)``.

    Each row weighs ``w`` (``Weighted`` hands it rows of ``w > 0`` only; a zero weight omits a
    row): the means ``Σ w x / Σw`` (``np.average``), the centred moments ``Σ w (x - mean)^k``
    by the unweighted formulas with weights for counts (Chan's, Pébay's). Variances divide by
    ``Σw - ddof Σw²/Σw``, as ``np.cov(aweights=)`` (at ``ddof=0``: ``Σw``, as
    ``np.average`` and scikit-learn's ``StandardScaler(sample_weight)``); skewness and kurtosis
    are those of the weighted central moments (integer weights: scipy's of the repeated rows).
    ``count`` counts the rows of positive weight.
    """

    unweighted: Combiner

    def _fold(self, acc, batch, mask, keyed=None, seen=None):
        w, x = batch
        dtype = acc.weights.dtype
        w = masked(w, mask).astype(dtype)
        if keyed is None:
            before = acc.weights[0] - acc.lost[0]
            sums = jnp.stack([jnp.sum(w), jnp.sum(w * w)])
            return self.unweighted.fold_weighted(acc.value, x, mask, seen, w, before), sums
        keys, num_keys = keyed
        before = acc.weights[:, 0] - acc.lost[:, 0]
        keys = jnp.clip(keys, 0, num_keys - 1)
        sums = jax.ops.segment_sum(jnp.stack([w, w * w], axis=1), keys, num_keys)
        return self.unweighted.fold_weighted(acc.value, x, mask, seen, w, before, (keys, num_keys)), sums

    def add(self, acc, batch, mask):
        return self.add_omitting(acc, batch, mask, mask)

    def add_omitting(self, acc, batch, mask, keep):
        value, sums = self._fold(acc, batch, keep, seen=mask)
        return WeightedCentredAcc(value, *kahan_add(acc.weights, acc.lost, sums))

    def add_keyed(self, acc, batch, mask, keys, num_keys):
        return self.add_keyed_omitting(acc, batch, mask, mask, keys, num_keys)

    def add_keyed_omitting(self, acc, batch, mask, keep, keys, num_keys):
        if not self.unweighted.folds_keyed_at_once(batch[1]):
            return super().add_keyed(acc, batch, keep, keys, num_keys)
        value, sums = self._fold(acc, batch, keep, (keys, num_keys), seen=mask)
        return WeightedCentredAcc(value, *kahan_add(acc.weights, acc.lost, sums))

    def merge(self, a, b):
        na, nb = a.weights[0] - a.lost[0], b.weights[0] - b.lost[0]
        value = self.unweighted.merge(a.value, b.value, na, nb)
        return WeightedCentredAcc(value, a.weights + b.weights, a.lost + b.lost)


class MomentsResult(NamedTuple):
    """Per column: row count, mean, variance (``np.var`` with ``ddof``), min and max, skewness and
    excess kurtosis (``scipy.stats.skew``/``kurtosis`` with their defaults: biased, Fisher's),
    the real rows holding NaN (``nan_count``, also those ``nan_policy="omit"`` skipped) and 0
    (``zeros``, of the rows counted), ``norm_l1`` (``Σ|x|``) and ``norm_l2`` (``√Σx²``). Under
    ``nan_policy="omit"`` every field is of each column's finite values, ``count`` too (``(d,)``)."""

    count: np.ndarray
    mean: np.ndarray
    var: np.ndarray
    min: np.ndarray
    max: np.ndarray
    skewness: np.ndarray
    kurtosis: np.ndarray
    nan_count: np.ndarray
    zeros: np.ndarray
    norm_l1: np.ndarray
    norm_l2: np.ndarray
    columns: np.ndarray | None = None  # X's column names (a DataFrame, Parquet, CSV), else np.arange(d)

    def to_pandas(self):
        """A DataFrame: a row per column, a column per statistic computed (``df.agg([...]).T``)."""
        return frame(self, [f for f in MomentsResult._fields[:-1] if getattr(self, f) is not None])


# What Moments(fields=...) may ask for: every statistic of MomentsResult.
MOMENT_FIELDS = MomentsResult._fields[:-1]


class MomentParts(NamedTuple):
    """What a :class:`Moments` state keeps beside the count, mean and M2 (:func:`moment_parts`)."""

    extremes: bool = True  # min and max of every row; False: only of micro-batches holding a NaN or inf
    higher: bool = True    # M3 and M4 (skewness, kurtosis)
    l1: bool = True        # Σ|x| (norm_l1)
    l2: bool = True        # Σ(x s)² (norm_l2)
    zeros: bool = True     # the rows holding 0


ALL_PARTS = MomentParts()


def moment_parts(fields) -> MomentParts:
    """The parts of the state the result ``fields`` need (None: every field)."""
    if fields is None:
        return ALL_PARTS
    asked = set(fields)
    return MomentParts(bool(asked & {"min", "max"}), bool(asked & {"skewness", "kurtosis"}), "norm_l1" in asked,
                       "norm_l2" in asked, "zeros" in asked)


def higher_rows(parts: MomentParts) -> tuple[str, ...]:
    """The rows of a state's ``higher`` (and ``higher_lost``): of M3, M4, Σ|x| and Σ(x s)², those kept."""
    return ("m3", "m4") * parts.higher + ("l1",) * parts.l1 + ("l2",) * parts.l2


class MomentsAcc(NamedTuple):
    centered: CenteredAcc
    min: jax.Array
    max: jax.Array
    higher: jax.Array       # (4, d): M3, M4 (about the mean), Σ|x| and Σ(x s)² (s: squares_scale), less higher_lost;
    #                         of a MomentParts, its higher_rows (one unused row of zeros where none)
    higher_lost: jax.Array  # (4, d) Kahan compensation of higher
    counts: wide.Wide       # (2, d): real rows holding NaN, rows counted holding 0 (without zeros: (1, d))


def squares_scale(dtype) -> float:
    """``s``, the power of two by which :class:`Moments` scales the rows in its second sum of squares ``Σ(x s)²``,
    from which ``norm_l2`` is read where ``Σx²`` overflows (``dtype``'s largest float ``2^e``: ``s = 2^(-3e/4)``).
    Each ``(x s)²`` is at most ``2^(e/2)``, so that sum never overflows; where ``Σx²`` does (at least ``2^e``)
    it is at least ``2^(-e/2)``, a normal float: the values whose scaled squares underflow change it by far less
    than a rounding."""
    return 2.0 ** -(3 * np.finfo(dtype).maxexp // 4)


def moments_init(d: int, dtype, parts: MomentParts = ALL_PARTS) -> MomentsAcc:
    """The identity of :class:`Moments` of ``d`` columns keeping ``parts``: no rows."""
    higher = jnp.zeros((max(len(higher_rows(parts)), 1), d), dtype)  # orbax saves no empty array: a row unused
    return MomentsAcc(centered_init(d, dtype, full=False), jnp.full((d,), jnp.inf, dtype),
                      jnp.full((d,), -jnp.inf, dtype), higher, higher, wide.zeros((1 + parts.zeros, d)))


def batch_moments(s1, s2, s3, s4, delta):
    """M3, M4 of a micro-batch about its own mean, from its (weighted) power sums about another
    point (``delta``: the batch's mean from there, small, so nothing cancels)."""
    return jnp.stack([s3 - delta * (3 * s2 - 2 * s1 * delta),
                      s4 - delta * (4 * s3 - delta * (6 * s2 - 3 * s1 * delta))])


def pebay(before, share, delta, m2a, m2b, m3a, m3b) -> jax.Array:
    """``(2, d)``: what Pébay's pairwise formulas add to ``M3a + M3b`` and ``M4a + M4b``.

    Two sets of rows of weights ``wa, wb`` (``before = wa``, ``share = wb / (wa + wb)``), whose
    means differ by ``delta``, with central moments ``M2, M3`` (Pébay 2008, eqs. 2.1-2.2)::

        M3 = M3a + M3b + δ³ c (pa - pb) + 3 δ (pa M2b - pb M2a)
        M4 = M4a + M4b + δ⁴ c (pa² - pa pb + pb²) + 6 δ² (pa² M2b + pb² M2a) + 4 δ (pa M3b - pb M3a)

    with ``pa, pb`` the two shares of the weight and ``c = wa pb`` (``wa wb / w``).
    """
    pb = share
    pa = jnp.where(before > 0, 1 - share, 0)
    c = before * share
    d2 = delta * delta
    m3 = d2 * delta * c * (pa - pb) + 3 * delta * (pa * m2b - pb * m2a)
    m4 = (d2 * d2 * c * (pa * pa - pa * pb + pb * pb) + 6 * d2 * (pa * pa * m2b + pb * pb * m2a)
          + 4 * delta * (pa * m3b - pb * m3a))
    return jnp.stack([m3, m4])


def moments_fold(acc: MomentsAcc, x, keep, seen=None, weights=None, before=None,
                 parts: MomentParts = ALL_PARTS) -> MomentsAcc:
    """``acc`` with the rows ``keep`` folded in, in one pass: the centred moments by Chan's and
    Pébay's formulas from the power sums of the rows' deviations from ``acc``'s mean, Σ|x|
    and the counts (of them, what ``parts`` keeps). ``seen`` (a superset of ``keep``: the real rows,
    also those a ``nan_policy`` skips; None: ``keep``) counts the NaNs. ``weights`` (per row, 0 where
    ``keep`` is False) and ``before`` (``acc``'s weight) for a weighted fold; else every row weighs 1.
    ``keep`` ``(mb, d)``: each column's own values (``weights`` one a value), folded into a state that counts
    each column's (:class:`FiniteMoments`)."""
    c = acc.centered
    x = x.astype(c.m2.dtype)
    shift, dev, nb = deviations(c, x, keep)
    kept = values_masked(x, keep)
    # A mask per column (FiniteMoments) in one pass at any width: each column's sums rounded as one column's alone.
    one_pass = keep.ndim == 2
    if parts.extremes:
        *sums, low, high = column_reductions(_powers(dev, kept, weights, parts), values_masked(x, keep, jnp.inf),
                                            values_masked(x, keep, -jnp.inf), one_pass)
    else:
        sums = column_reductions(_powers(dev, kept, weights, parts), one_pass=one_pass)
        # Only where a row kept is NaN or inf (then the sum of the deviations is not finite): what the
        # result reads the infinities from (with_infinities); clean data never pays.
        low, high = jax.lax.cond(~jnp.all(jnp.isfinite(sums[0])),
                                 lambda: (jnp.min(values_masked(x, keep, jnp.inf), axis=0),
                                          jnp.max(values_masked(x, keep, -jnp.inf), axis=0)),
                                 lambda: (jnp.full_like(sums[0], jnp.inf), jnp.full_like(sums[0], -jnp.inf)))
    weight = nb.astype(x.dtype) if weights is None else jnp.sum(weights, 0)
    # A NaN among the rows kept makes its column's sum NaN; rows seen but not kept may hold some:
    # only then are the NaNs counted (a pass over the rows that clean data never pays).
    skipped = None if seen is None else by_row(seen) & ~keep if keep.ndim == 2 else seen & ~keep
    maybe = jnp.any(jnp.isnan(sums[0])) if seen is None else jnp.any(jnp.isnan(sums[0])) | jnp.any(skipped)
    rows = keep if seen is None else seen
    nans = jax.lax.cond(maybe, lambda: jnp.sum(values_masked(jnp.isnan(x), rows), axis=0, dtype=jnp.int32),
                        lambda: jnp.zeros_like(sums[0], jnp.int32))  # zeros_like: varying like the sums in shard_map
    counts = [nans]
    if parts.zeros:
        zeros = sums[-1] - (x.shape[0] - nb).astype(x.dtype)  # the rows not kept are 0 in `kept`
        counts.append(zeros.astype(jnp.int32))  # < 2^24 rows a micro-batch: exact
        sums = sums[:-1]
    before = wide.to_float(c.count, x.dtype) if before is None else before
    return moments_update(acc, shift, nb, before, weight, sums, jnp.stack(counts), low, high,
                          batch_mean(x, keep, nb, weights), parts)


def moments_fold_keyed(acc: MomentsAcc, x, keep, keys, num_keys: int, weights=None, before=None,
                       seen=None, parts: MomentParts = ALL_PARTS) -> MomentsAcc:
    """:func:`moments_fold` per key (``acc`` with a leading ``num_keys`` axis): each key's power
    sums, counts, minima and maxima by segment reductions, folded by the same formulas.

    The rows not kept go to no key (an index past the last: the scatters drop them) rather than adding
    their identity (0, +inf, -inf) to one, the same sums (a scatter-add starts at +0.0, so adding +0.0
    changes none of its values) without a select per value; the NaNs are counted only where the rows
    hold one (as :func:`moments_fold`; clean data never pays). ``keep`` ``(mb, d)``: each column's values, into a
    state that counts each key's and column's (:class:`FiniteMoments`); the others add +0.0 (0 for the rows'
    counts, +-inf for the extremes) to their key's sums, which changes none, as a scatter-add starts at +0.0."""
    c = acc.centered
    x = x.astype(c.m2.dtype)
    keys = jnp.clip(keys, 0, num_keys - 1)
    if keep.ndim == 1:
        kept = jnp.where(keep, keys, num_keys)  # the rows not kept: dropped by every scatter below
        nb = keyed_sum(jnp.ones(keys.shape, jnp.int32), kept, num_keys)
        shift = keyed_shift(c, x, kept, nb, num_keys)
        dev = (x - shift[kept]) - c.mean[kept]  # rows not kept: any value (index num_keys: the last key's), dropped
        values = _powers(dev, x, weights, parts)  # of the rows not kept too: dropped
        low_x = high_x = x
    else:  # each column's values keep: the others 0 (a scatter-add starts at +0.0: adding +0.0 changes none)
        kept = keys
        nb = keyed_sum(keep.astype(jnp.int32), keys, num_keys)
        shift = keyed_shift(c, x, kept, nb, num_keys, keep)
        dev = (x - shift[kept]) - c.mean[kept]
        values = [values_masked(v, keep) for v in _powers(dev, x, weights, parts)]
        low_x, high_x = values_masked(x, keep, jnp.inf), values_masked(x, keep, -jnp.inf)
    sums = keyed_sum(stacked(values), kept, num_keys)

    def extremes():
        return jax.ops.segment_min(low_x, kept, num_keys), jax.ops.segment_max(high_x, kept, num_keys)

    if parts.extremes:
        low, high = extremes()
    else:  # as moments_fold: only where a row kept is NaN or inf
        low, high = jax.lax.cond(~jnp.all(jnp.isfinite(sums[:, 0])), extremes,
                                 lambda: (jnp.full_like(sums[:, 0], jnp.inf), jnp.full_like(sums[:, 0], -jnp.inf)))
    # A NaN among the rows kept makes its key's sum NaN; rows seen but not kept may hold some: only then are
    # the NaNs counted (as moments_fold), and without zeros the counts (wide integers) added only then.
    skipped = None if seen is None else by_row(seen) & ~keep if keep.ndim == 2 else seen & ~keep
    maybe = jnp.any(jnp.isnan(sums[:, 0])) if seen is None else jnp.any(jnp.isnan(sums[:, 0])) | jnp.any(skipped)
    counted = kept if seen is None else jnp.where(seen, keys, num_keys)
    k = len(values) - parts.zeros
    zeros = [sums[:, k].astype(jnp.int32)] if parts.zeros else []

    def nans():
        nan = jnp.isnan(x) if seen is not None or keep.ndim == 1 else jnp.isnan(x) & keep
        return jax.ops.segment_sum(nan.astype(jnp.int32), counted, num_keys)

    def with_counts(nans):
        return wide.add_int32(acc.counts, jnp.stack([nans, *zeros], axis=1))

    if parts.zeros:
        counts = with_counts(jax.lax.cond(maybe, nans, lambda: jnp.zeros_like(zeros[0])))  # varying like the sums
    else:
        counts = jax.lax.cond(maybe, lambda: with_counts(nans()), lambda: acc.counts)
    weight = nb.astype(x.dtype) if weights is None else jax.ops.segment_sum(weights, keys, num_keys)
    before = wide.to_float(c.count, x.dtype) if before is None else before
    out = jax.vmap(lambda *a: moments_update(*a, parts=parts))(acc, shift, nb, before, weight, sums[:, :k],
                                                               jnp.zeros_like(counts.limbs[..., 0]), low, high)
    return out._replace(centered=keyed_without_overflow(c, out.centered, before, weight, x, keep, keys, weights),
                        counts=counts)


# stacked() builds the rows of at most this many values by selects, more by a concatenation.
SELECT_STACK = 2


def stacked(values: list[jax.Array]) -> jax.Array:
    """``jnp.stack(values, axis=1)`` (the same values): of two arrays ``(rows, d)``, as one select of the rows'
    entries by an iota, which XLA:CPU fuses into one vectorized loop, where its concatenation computes each
    entry in a loop of its own (0.18 against 0.31 CPU-ms for the deviations and their squares of 16384 x 4
    values, gathered per key); of more, each value computed once for every entry of a select, a stack."""
    if len(values) > SELECT_STACK:
        return jnp.stack(values, axis=1)
    which = jax.lax.broadcasted_iota(jnp.int32, (values[0].shape[0], len(values), *values[0].shape[1:]), 1)
    out = values[-1][:, None]
    for i in reversed(range(len(values) - 1)):
        out = jnp.where(which == i, values[i][:, None], out)
    return out


def _powers(dev, kept, weights, parts: MomentParts = ALL_PARTS):
    """Per row: the (weighted) deviations and their squares, and of the cubes, fourth powers, ``|x|``,
    ``(x s)²`` (:func:`squares_scale`) and whether ``x`` is 0 those ``parts`` keeps (arrays ``(rows, d)``;
    ``kept``: the rows, 0 where not kept)."""
    wdev = dev if weights is None else dev * by_row(weights)
    w2 = wdev * dev
    out = [wdev, w2]
    if parts.higher:
        out += [w2 * dev, w2 * w2 if weights is None else w2 * dev * dev]
    per_row = []
    if parts.l1:
        per_row.append(jnp.abs(kept))
    if parts.l2:
        scaled = kept * squares_scale(kept.dtype)
        per_row.append(scaled * scaled)
    if weights is not None:
        per_row = [v * by_row(weights) for v in per_row]
    return (*out, *per_row, *([(kept == 0).astype(kept.dtype)] if parts.zeros else []))


def moments_update(acc: MomentsAcc, shift, nb, before, weight, sums, counts, low, high,
                   batch_mean=None, parts: MomentParts = ALL_PARTS) -> MomentsAcc:
    """``acc`` (of weight ``before``) with a micro-batch of ``nb`` real rows of weight ``weight``:
    ``sums``, the (weighted) power sums of their deviations from ``acc``'s mean, then (what ``parts``
    keeps) those of the cubes and fourth powers, Σ|x| and Σ(x s)²; ``counts`` ``(k, d)`` int32 NaNs and
    zeros; ``low``, ``high`` their minima and maxima (``batch_mean``: :func:`folded`'s)."""
    c = acc.centered
    s1, s2, *rest = sums
    centered, delta, share = folded(c, shift, nb, before, weight, s1, s2, full=False, batch_mean=batch_mean)
    some = nb > 0
    higher, lost = acc.higher, acc.higher_lost
    if rest:
        new = []
        if parts.higher:
            s3, s4, *rest = rest
            m34b = batch_moments(s1, s2, s3, s4, delta)
            m2a, m3a = kahan_total(c.m2, c.m2_lost, jnp), kahan_total(acc.higher[0], acc.higher_lost[0], jnp)
            new.append(m34b + pebay(before, share, delta, m2a, s2 - s1 * delta, m3a, m34b[0]))
        new += [v[None] for v in rest]
        higher, lost = kahan_add(acc.higher, acc.higher_lost, jnp.concatenate(new))
        higher, lost = jnp.where(some, higher, acc.higher), jnp.where(some, lost, acc.higher_lost)
    return MomentsAcc(centered, jnp.minimum(acc.min, low), jnp.maximum(acc.max, high), higher, lost,
                      wide.add_int32(acc.counts, counts))


# column_reductions folds at most this many rows one after another, then adds the partials by jnp.sum.
SEQUENTIAL_ROWS = 512
# Columns from which XLA:CPU's separate reductions (vectorized along the columns) beat one
# variadic pass (measured on 2 cores: one pass 4.2x faster at d=4, 2.5x at 8, 1.3x at 16; 0.8x at 32).
ONE_PASS_BELOW_WIDTH = 32


def column_reductions(sums, low: jax.Array | None = None, high: jax.Array | None = None,
                      one_pass: bool = False) -> list[jax.Array]:
    """The column sums of each of ``sums``, the column minima of ``low`` and maxima of ``high``
    (``(rows, d)`` each; None: the sums alone).

    Narrow rows (``d <`` :data:`ONE_PASS_BELOW_WIDTH`; any with ``one_pass``) in one pass over the micro-batch, a
    variadic ``lax.reduce``, where separate reductions would read it once each: it folds groups
    of ``g`` rows (``g`` the largest power of two dividing the row count, at most
    :data:`SEQUENTIAL_ROWS`) one after another into ``rows / g`` partials, which ``jnp.sum``
    adds, so the rounding stays that of short sums.
    """
    rows, d = sums[0].shape
    extremes = () if low is None else (low, high)
    if d >= ONE_PASS_BELOW_WIDTH and not one_pass:
        return [*(jnp.sum(v, axis=0) for v in sums),
                *((jnp.min(low, axis=0), jnp.max(high, axis=0)) if extremes else ())]
    seq = math.gcd(rows, SEQUENTIAL_ROWS)
    values = [v.reshape(seq, rows // seq, d) for v in (*sums, *extremes)]
    k = len(sums)

    def fold(a, b):
        return (*(p + q for p, q in zip(a[:k], b[:k], strict=True)),
                *((jnp.minimum(a[k], b[k]), jnp.maximum(a[k + 1], b[k + 1])) if extremes else ()))

    inits = tuple(jnp.asarray(i, sums[0].dtype) for i in (*(0,) * k, *((jnp.inf, -jnp.inf) if extremes else ())))
    partial = jax.lax.reduce(tuple(values), inits, fold, (0,))
    return [*(jnp.sum(p, axis=0) for p in partial[:k]),
            *((jnp.min(partial[k], axis=0), jnp.max(partial[k + 1], axis=0)) if extremes else ())]


def moments_merge(a: MomentsAcc, b: MomentsAcc, na=None, nb=None, parts: MomentParts = ALL_PARTS) -> MomentsAcc:
    """Two :class:`Moments` accumulators as one (of weights ``na``, ``nb``: their counts when None)."""
    dtype = a.min.dtype
    na = wide.to_float(a.centered.count, dtype) if na is None else na
    nb = wide.to_float(b.centered.count, dtype) if nb is None else nb
    centered, delta, share = merged(a.centered, b.centered, na, nb, full=False)
    higher = a.higher + b.higher  # Σ|x|, Σ(x s)²: added
    if parts.higher:
        cross = pebay(na, share, delta, a.centered.m2, b.centered.m2, a.higher[0], b.higher[0])
        either_empty = wide.is_zero(a.centered.count) | wide.is_zero(b.centered.count)
        cross = jnp.where(either_empty, 0, cross)  # exactly the other side (no inf·0 from a far shift)
        higher = higher + jnp.concatenate([cross, jnp.zeros_like(higher[2:])])
    return MomentsAcc(centered, jnp.minimum(a.min, b.min), jnp.maximum(a.max, b.max), higher,
                      a.higher_lost + b.higher_lost, wide.add(a.counts, b.counts))


def moments_result(acc: MomentsAcc, ddof: int, weight=None, dof=None, fields=None) -> MomentsResult:
    """The host result of a merged :class:`Moments` accumulator (``columns`` None). ``weight``
    (float64) and ``dof`` (the variance's divisor) of a weighted one; else from the count. ``fields``:
    those asked (:func:`moment_parts`; None: every one), the others None.

    Stacked: a leading axis on every leaf (``GroupBy``'s keys, ``Describe``'s columns; unweighted) gives the
    results along it in one call, each the same, element for element, as its own call's (a result of no rows:
    NaN statistics, the norms 0); min and max in float64 where an entry is of no rows, as such calls' joined."""
    parts = moment_parts(fields)
    count = wide.to_int(acc.centered.count)
    counts = wide.to_int(acc.counts)
    dims = np.shape(acc.min)
    higher = kahan_total(np.asarray(acc.higher, np.float64), np.asarray(acc.higher_lost, np.float64))
    rows = {name: higher[..., i, :] for i, name in enumerate(higher_rows(parts))}
    nan = np.full(dims, np.nan)
    zeros = counts[..., 1, :] if parts.zeros else None
    empty = np.asarray(count == 0, bool)
    if empty.any():
        no_rows(0, "Moments")  # one warning, as a call of no rows gives
    if empty.all():
        return asked(MomentsResult(count, nan, nan, nan, nan, nan, nan, counts[..., 0, :], zeros, np.zeros(dims),
                                   np.zeros(dims)), fields)
    if weight is None:
        weight = float(count) if np.ndim(count) == 0 else np.asarray(count, np.float64)[..., None]
    m2 = host_m2(acc.centered, full=False)
    mean = host_mean(acc.centered)
    low, high = np.asarray(acc.min), np.asarray(acc.max)
    # Every row kept finite (a NaN kept makes both NaN); also where only the micro-batches holding a NaN or
    # an inf were read (MomentParts.extremes False: both stay at their identity, +inf and -inf, without one).
    finite = ~((low == -np.inf) | (high == np.inf) | np.isnan(low) | np.isnan(high))
    # Finite rows whose squared deviations overflowed (rows far apart near the largest float): an
    # infinite M2, never NaN; the mean stays finite (_without_overflow).
    m2 = np.where(finite & np.isnan(m2), np.inf, m2)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        m2n = m2 / weight
        shape = (m2 > 0) & np.isfinite(m2)
        skewness = np.where(shape, rows["m3"] / weight / m2n**1.5, np.nan) if parts.higher else nan
        kurtosis = np.where(shape, rows["m4"] / weight / (m2n * m2n) - 3.0, np.nan) if parts.higher else nan
        l2 = norm_l2(m2, weight * mean * mean, rows["l2"], finite, low.dtype) if parts.l2 else nan
        result = MomentsResult(
            count, mean, _divide(m2, count - ddof if dof is None else dof), low, high,
            skewness, kurtosis, counts[..., 0, :], zeros, rows.get("l1", nan), l2,
        )
    result = with_infinities(result)
    if empty.any():  # stacked: the entries of no rows as one call's (above; min and max then float64, as joined)
        empty = empty[..., None]
        result = result._replace(**{f: np.where(empty, 0.0 if f.startswith("norm") else np.nan,
                                                np.asarray(getattr(result, f), np.float64))
                                    for f in ("mean", "var", "min", "max", "skewness", "kurtosis", "norm_l1",
                                              "norm_l2")})
    return asked(result, fields)


def asked(result: MomentsResult, fields) -> MomentsResult:
    """``result`` with the fields not in ``fields`` (None: every field is) None."""
    if fields is None:
        return result
    return result._replace(**{f: None for f in MOMENT_FIELDS if f not in fields and f != "count"})


def norm_l2(m2: np.ndarray, squared_mean: np.ndarray, scaled: np.ndarray, finite: np.ndarray, dtype) -> np.ndarray:
    """``√(M2 + w mean²)``, the L2 norm of the rows (float64); where that overflowed though every row
    was finite (``finite``), from ``Σ(x s)²`` (``scaled``, :func:`squares_scale`): ``√Σ(x s)² / s``,
    inf only past ``dtype``'s (the accumulator's) largest float, as the sums'."""
    with np.errstate(over="ignore", invalid="ignore"):
        norm = np.sqrt(m2 + squared_mean)
        rescued = (np.sqrt(scaled) / squares_scale(dtype)).astype(dtype).astype(np.float64)
    return np.where(finite & ~np.isfinite(norm), rescued, norm)


def with_infinities(result: MomentsResult) -> MomentsResult:
    """``result`` with the columns holding an infinity (seen by their min and max) as numpy's: a
    mean of +inf, -inf, or NaN when both; variance, skewness and kurtosis NaN; the norms inf. The
    accumulated moments of such a column are inf or NaN whatever the order (inf - inf)."""
    up, down = result.max == np.inf, result.min == -np.inf
    infinite = up | down
    if not infinite.any():
        return result
    mean = np.where(up & down, np.nan, np.where(up, np.inf, -np.inf))
    nan, inf = np.float64(np.nan), np.float64(np.inf)
    return result._replace(
        mean=np.where(infinite, mean, result.mean), var=np.where(infinite, nan, result.var),
        skewness=np.where(infinite, nan, result.skewness), kurtosis=np.where(infinite, nan, result.kurtosis),
        norm_l1=np.where(infinite, inf, result.norm_l1), norm_l2=np.where(infinite, inf, result.norm_l2),
    )


@dataclasses.dataclass(frozen=True)
class Moments(SplitsEachColumn, Combiner):
    """Per-column count, mean, variance, min, max, skewness, kurtosis, NaN and zero counts and
    L1/L2 norms of rows X (n, d), in one pass; the centred moments merge by Chan's and Pébay's
    pairwise formulas, as exactly as the variance.

    On a mesh with a ``model`` axis of size M (set by :meth:`for_mesh`, ``model_shards``) the
    state is split by columns (``column_split``): each device folds and merges ``ceil(d / M)``
    columns, the row count whole on every device.

    Under ``nan_policy="omit"`` each NaN or Inf is skipped where it stands, as pandas' ``skipna``:
    every field is per column over its finite values, ``count`` too (``(d,)``; per key under
    ``GroupBy``: ``df.groupby(keys).count()``); ``"omit_rows"`` skips every row holding one.

    Args:
      ddof: delta degrees of freedom of the variance (0, the default, like ``np.var``; 1 like
        pandas' ``var()`` and ``Covariance``'s default).
      fields: the statistics to compute, names of :class:`MomentsResult`'s fields (e.g.
        ``("mean", "var")``); the others are None in the result and cost nothing: the third and fourth
        moments only for ``skewness``/``kurtosis``, ``Σ|x|`` for ``norm_l1``, a scaled ``Σx²`` for
        ``norm_l2``, the zeros for ``zeros``, the minima and maxima for ``min``/``max`` (without them
        only the micro-batches holding a NaN or inf are read for them, so a mean is still numpy's at
        the infinities). ``count`` always comes; a string names them with commas (``"mean,var"``). None
        (the default): every field.
    """

    ddof: int = 0
    fields: tuple[str, ...] | None = None
    model_shards: int = 1  # set by for_mesh: above 1 each model device holds its block of the columns
    state_type, row_field = MomentsAcc, "min"

    def __post_init__(self):
        fields = self.fields
        if fields is None:
            return
        names = [f.strip() for f in fields.split(",")] if isinstance(fields, str) else fields
        if not isinstance(names, (tuple, list)) or not all(isinstance(f, str) for f in names) or (
                set(names) - set(MOMENT_FIELDS)):
            raise UsageError(f"Moments fields must be names among {', '.join(MOMENT_FIELDS)} (None: all of them), "
                             f"got {fields!r}.")
        # In MomentsResult's order, once each; all of them is the default (the same job as before the option).
        asked = tuple(f for f in MOMENT_FIELDS if f in names)
        object.__setattr__(self, "fields", None if set(asked) >= set(MOMENT_FIELDS) - {"count"} else asked)

    @property
    def parts(self) -> MomentParts:
        """What the state keeps for :attr:`fields`."""
        return moment_parts(self.fields)

    @property
    def finalizes_stacked(self) -> bool:
        """Every key's result in one call under ``GroupBy`` (:func:`moments_result`), whole columns only."""
        return self.model_shards == 1

    def fingerprint(self):
        named = super().fingerprint()
        if self.fields is None:  # as before the option: a checkpoint written then resumes
            del named["fields"]
        return named

    def column_axes(self):
        return MomentsAcc(CenteredAcc(None, 0, 0, 0, 0), 0, 0, 1, 1, 1)

    def columns_spec(self, acc, n):
        return jax.ShapeDtypeStruct((n,), acc.min.dtype)

    def check_spec(self, spec):
        super().check_spec(spec)
        check_matrix_spec(spec, type(self).__name__)
        check_ddof(self.ddof, type(self).__name__)

    def init(self, spec):
        acc = moments_init(spec.shape[0], accumulator_dtype(spec.dtype), self.parts)
        return self.split(acc) if self.model_shards > 1 else acc

    def fold(self, acc, x, keep, seen=None, weights=None, before=None, keyed=()):
        """:func:`moments_fold` (``keyed``: ``(keys, num_keys)``, :func:`moments_fold_keyed`), split
        over ``model``: of this device's block of the columns."""
        split = self.model_shards > 1
        value, x = (acc.value, self.own(x)) if split else (acc, x)
        if keyed:
            value = moments_fold_keyed(value, x, keep, *keyed, weights=weights, before=before, seen=seen,
                                       parts=self.parts)
        else:
            value = moments_fold(value, x, keep, seen, weights, before, self.parts)
        return acc._replace(value=value) if split else value

    def fold_weighted(self, acc, x, keep, seen, weights, before, keyed=()):
        """:meth:`fold` of rows weighing ``weights`` (:class:`WeightedCentred`), ``before`` the ``Σw`` folded."""
        return self.fold(acc, x, keep, seen, weights, before, keyed)

    def folds_keyed_at_once(self, x) -> bool:
        """Whether a keyed micro-batch ``x`` folds in one go (:class:`WeightedCentred`): always."""
        return True

    def add(self, acc, batch, mask):
        return self.fold(acc, batch, mask)

    def add_omitting(self, acc, batch, mask, keep):
        return self.fold(acc, batch, keep, mask)

    def add_keyed(self, acc, batch, mask, keys, num_keys):
        return self.fold(acc, batch, mask, keyed=(keys, num_keys))

    def omitting_values(self):
        """:class:`FiniteMoments`: under ``nan_policy="omit"`` a column's count is its own count of finite values."""
        return FiniteMoments(self.ddof, self.fields)

    def add_keyed_omitting(self, acc, batch, mask, keep, keys, num_keys):
        return self.fold(acc, batch, keep, mask, keyed=(keys, num_keys))

    def merge(self, a, b, na=None, nb=None):
        """:func:`moments_merge` (of weights ``na``, ``nb``: their counts when None), block by block when split."""
        if self.model_shards > 1:
            return a._replace(value=moments_merge(a.value, b.value, na, nb, self.parts))
        return moments_merge(a, b, na, nb, self.parts)

    def weighted(self):
        return WeightedCentred(self)

    def finalize(self, acc):
        return self.result(acc)

    def result(self, acc: MomentsAcc, weight: float | None = None, weight_sq: float | None = None) -> MomentsResult:
        """The host result (``columns`` None; of the real columns when split); ``weight``,
        ``weight_sq``: ``Σw``, ``Σw²`` of a weighted run (None: every row weighed 1)."""
        acc = self.unsplit(acc) if self.model_shards > 1 else acc
        count = wide.to_int(acc.centered.count)
        if np.ndim(count):  # stacked (finalizes_stacked): unweighted
            return moments_result(acc, self.ddof, dof=count - self.ddof, fields=self.fields)
        count = int(count)
        return moments_result(acc, self.ddof, weight, divisor(count, self.ddof, weight, weight_sq), self.fields)


def finite_cells(x: jax.Array, keep: jax.Array) -> jax.Array:
    """Each column's finite values ``(mb, d)`` of the rows ``keep`` of ``x`` ``(mb, d)``: what
    :class:`FiniteMoments` folds under ``nan_policy="omit"``."""
    return by_row(keep) & jnp.isfinite(x)


def column_states(acc: MomentsAcc, xp: Any = jnp) -> MomentsAcc:
    """A :class:`FiniteMoments` state (any leading axes, then its columns) as stacked one-column states of
    :class:`Moments` (the leading axes, the columns, then a state of one column; ``xp``: numpy on the host)."""
    c = acc.centered
    one = [v[..., None] for v in (c.shift, c.mean, c.m2, c.m2_lost, acc.min, acc.max)]
    higher = [xp.moveaxis(v, -1, -2)[..., None] for v in (acc.higher, acc.higher_lost)]  # (..., h, d) -> (..., d, h, 1)
    counts = wide.Wide(xp.moveaxis(acc.counts.limbs, -2, -3)[..., None, :])  # (..., k, d, L) -> (..., d, k, 1, L)
    return MomentsAcc(CenteredAcc(c.count, *one[:4]), *one[4:], *higher, counts)


def one_state(stacked: MomentsAcc) -> MomentsAcc:
    """:func:`column_states`' inverse: stacked one-column states of :class:`Moments` (the columns, then a state of
    one column) as one :class:`FiniteMoments` state of every column."""
    c = stacked.centered
    one = [v[..., 0] for v in (c.shift, c.mean, c.m2, c.m2_lost, stacked.min, stacked.max)]
    higher = [jnp.moveaxis(v[..., 0], -1, -2) for v in (stacked.higher, stacked.higher_lost)]  # (d, h, 1) -> (h, d)
    counts = wide.Wide(jnp.moveaxis(stacked.counts.limbs[..., 0, :], -3, -2))  # (d, k, 1, L) -> (k, d, L)
    return MomentsAcc(CenteredAcc(c.count, *one[:4]), *one[4:], *higher, counts)


@dataclasses.dataclass(frozen=True)
class FiniteMoments(Moments):
    """:class:`Moments` under ``nan_policy="omit"`` (:meth:`Moments.omitting_values`), as pandas' ``skipna``: each
    NaN or inf skipped where it stands, every field of each column's finite values.

    Its state counts each column's values (``centered.count`` ``(d,)``, per key ``(num_keys, d)``; the weighted
    form ``Σw`` and ``Σw²`` too, :class:`WeightedFiniteMoments`), and a micro-batch folds by
    :func:`moments_fold` with a mask per column ``(mb, d)`` where :class:`Moments` takes one per row: the same
    sums, reductions and ``lax.cond``s as ``"propagate"``, each column's values the same as a one-column state
    of its own would fold them alone (per key too, :func:`moments_fold_keyed`: the values skipped add +0.0). Its
    state is whole on every device of a ``model`` axis (each folds every column).
    """

    def for_mesh(self, mesh):
        return self

    def init(self, spec):
        acc = moments_init(spec.shape[0], accumulator_dtype(spec.dtype), self.parts)
        return acc._replace(centered=acc.centered._replace(count=wide.zeros(spec.shape)))

    def fold(self, acc, x, keep, seen=None, weights=None, before=None, keyed=()):
        """:func:`moments_fold` of each column's values ``keep`` (``(mb, d)``; a mask of rows ``(mb,)``: each
        column's values of those rows); ``weights`` one a value ``(mb, d)``, ``before`` ``Σw`` per column.
        ``keyed``: ``(keys, num_keys)``, :func:`moments_fold_keyed` with the same mask."""
        keep = jnp.broadcast_to(by_row(keep), x.shape) if keep.ndim == 1 else keep
        if not keyed:
            return moments_fold(acc, x, keep, seen, weights, before, self.parts)
        return moments_fold_keyed(acc, x, keep, *keyed, weights=weights, before=before, seen=seen, parts=self.parts)

    def add_finite(self, acc, batch, mask, keep):
        """``nan_policy="omit"``: each column's finite values of the rows ``keep`` (``mask``: the real rows,
        whose NaNs ``nan_count`` counts)."""
        return self.fold(acc, batch, finite_cells(batch, keep), mask)

    def add_keyed_finite(self, acc, batch, mask, keep, keys, num_keys):
        return self.fold(acc, batch, finite_cells(batch, keep), mask, keyed=(keys, num_keys))

    def finite_keep(self, batch, keep):
        """Every row of ``keep`` is folded: its NaN and inf values are skipped where they stand."""
        return keep

    def omitting_values(self):
        return self

    def weighted(self):
        return WeightedFiniteMoments(self)

    def result(self, acc: MomentsAcc, weight=None, weight_sq=None) -> MomentsResult:
        """The host result, each field a value a column (any leading axes: ``GroupBy``'s keys): the stacked
        :func:`moments_result` of the columns' one-column states, each column's the same, element for element,
        as a one-column :class:`Moments`' own. ``weight``, ``weight_sq``: ``Σw``, ``Σw²`` per column of a
        weighted run (None: every value weighed 1)."""
        one = column_states(jax.tree.map(np.asarray, acc), np)
        count = wide.to_int(one.centered.count)
        if weight is None:
            out = moments_result(one, self.ddof, dof=count - self.ddof, fields=self.fields)
        else:
            with np.errstate(divide="ignore", invalid="ignore"):  # divisor's, a column at a time
                dof = np.where(weight > 0, weight - self.ddof * weight_sq / weight, 0.0)
            out = moments_result(one, self.ddof, weight[..., None], dof, self.fields)
        return out._replace(**{f: np.asarray(v)[..., 0] for f, v in zip(out._fields, out, strict=True)
                               if v is not None and f not in ("count", "columns")})


@dataclasses.dataclass(frozen=True)
class WeightedFiniteMoments(WeightedCentred):
    """The weighted form of :class:`FiniteMoments`: ``Σw`` and ``Σw²`` per column (``(2, d)``), of the rows
    whose value in that column is folded; a row's weight weighs each of its values."""

    unweighted: Combiner

    def init(self, spec):
        acc = super().init(spec)
        zeros = jnp.zeros((2, *spec[1].shape), acc.weights.dtype)
        return acc._replace(weights=zeros, lost=zeros)

    def _fold(self, acc, batch, mask, keyed=None, seen=None):
        w, x = batch
        cells = jnp.broadcast_to(by_row(mask), x.shape) if mask.ndim == 1 else mask
        w = jnp.where(cells, w[:, None], jnp.asarray(0, w.dtype)).astype(acc.weights.dtype)  # one a value
        if keyed is None:
            before = acc.weights[0] - acc.lost[0]
            sums = jnp.stack([jnp.sum(w, 0), jnp.sum(w * w, 0)])
            return self.unweighted.fold_weighted(acc.value, x, cells, seen, w, before), sums
        keys, num_keys = keyed
        before = acc.weights[:, 0] - acc.lost[:, 0]
        sums = jax.ops.segment_sum(jnp.stack([w, w * w], axis=1), jnp.clip(keys, 0, num_keys - 1), num_keys)
        return self.unweighted.fold_weighted(acc.value, x, cells, seen, w, before, keyed), sums

    def add_finite(self, acc, batch, mask, keep):
        return self.add_omitting(acc, batch, mask, finite_cells(batch[1], keep))

    def add_keyed_finite(self, acc, batch, mask, keep, keys, num_keys):
        return self.add_keyed_omitting(acc, batch, mask, finite_cells(batch[1], keep), keys, num_keys)

    def finite_keep(self, batch, keep):
        return keep

    def finalize(self, acc):
        weight, weight_sq = np.asarray(acc.weights, np.float64) - np.asarray(acc.lost, np.float64)
        return self.unweighted.result(acc.value, weight, weight_sq)
