"""Pairwise-complete covariance and correlation: what ``Covariance`` and ``Correlation`` run under
``nan_policy="omit"``, as pandas' ``df.cov()`` and ``df.corr()``.

Each pair of columns ``(i, j)`` is reduced over the rows where both hold a finite value: its count
``n_ij``, the means of ``x_i`` and ``x_j`` over those rows, their co-moment ``C_ij`` and the two sums
of squared deviations ``M2_i|ij``, ``M2_j|ij`` (a correlation divides by those of the pair's rows, as
pandas' does). Every entry folds and merges by Chan's pairwise formulas, entry by entry: a
micro-batch's sums about each column's running mean (its mean over its own finite values, kept per
column with its count, as ``Covariance``'s ``shift`` and ``mean``), by masked matrix products
(``devᵀ dev``, ``devᵀ m``, ``mᵀ m`` with ``m`` the finite mask), folded into the accumulated entries.

Weighted (:class:`WeightedPairwise`, ``Weighted(Covariance())`` on ``(w, X)``): each row's weight counts
for a pair only where both values are finite; every count above that weighs is then the weights' sum over
those rows (Chan's formulas with weights for counts, as ``WeightedCentred``), and the divisor of a weighted
covariance is the pair's ``Σw - ddof Σw²/Σw`` (``np.cov(aweights=)`` over the pair's rows).

On a mesh with a ``model`` axis of M devices every ``(d, d)`` matrix is split by columns as
``Covariance``'s co-moments (``(d, round_up(d, M))``, :func:`~.moments.own_columns`), the per-column
count, shift and mean whole on every device; the pair counts are exact (:class:`~.wide.Wide`).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sharded_scan.combiners import wide
from sharded_scan.combiners.base import Combiner
from sharded_scan.combiners.column_split import SplitsByColumns, padded_columns, round_up
from sharded_scan.combiners.statistics.comoments import CovarianceResult
from sharded_scan.combiners.statistics.correlation import CorrelationResult
from sharded_scan.combiners.statistics.moments import (
    WeightedForm,
    check_ddof,
    column_sum,
    own_columns,
    reference_point,
)
from sharded_scan.combiners.statistics.sums import check_matrix_spec
from sharded_scan.dtypes import accumulator_dtype
from sharded_scan.mesh import MODEL_AXIS

PAIR_FIELDS = ("pairs", "row_mean", "col_mean", "co", "row_m2", "col_m2")
WEIGHT_FIELDS = ("pair_weight", "pair_weight_sq")  # a weighted form's per-pair Σw, Σw² (None unweighted)


class PairAcc(NamedTuple):
    """Per column (``(d,)``, whole on every device): its finite values' count, a reference point and
    their mean less it. Per pair ``(i, j)`` (``(d, W)``, ``W`` the columns, split over ``model``): the
    rows where both are finite, the means of ``x_i`` and ``x_j`` over them (less ``x_i``'s and ``x_j``'s
    reference points), their co-moment and the sums of squared deviations of ``x_i`` and of ``x_j``."""

    count: wide.Wide
    shift: jax.Array
    mean: jax.Array
    pairs: wide.Wide
    row_mean: jax.Array
    col_mean: jax.Array
    co: jax.Array
    row_m2: jax.Array
    col_m2: jax.Array
    weight: jax.Array | None = None  # weighted: per column Σw of its finite values; per pair Σw, Σw²
    pair_weight: jax.Array | None = None
    pair_weight_sq: jax.Array | None = None


def pair_init(d: int, dtype, shards: int = 1, weighted: bool = False) -> PairAcc:
    width = round_up(d, shards)
    zeros, matrix = jnp.zeros((d,), dtype), jnp.zeros((d, width), dtype)
    weights = (zeros, matrix, matrix) if weighted else ()
    return PairAcc(wide.zeros((d,)), zeros, zeros, wide.zeros((d, width)), *(matrix,) * 5, *weights)


def _column_weight(acc: PairAcc, dtype) -> jax.Array:
    """What each column's mean weighs: its finite values' count, or their weights' sum."""
    return wide.to_float(acc.count, dtype) if acc.weight is None else acc.weight


def _pair_weight(acc: PairAcc, dtype) -> jax.Array:
    """What each pair's entries weigh: its rows, or their weights' sum."""
    return wide.to_float(acc.pairs, dtype) if acc.pair_weight is None else acc.pair_weight


# Each column's reference point from its finite values in a micro-batch (``m``): ``statistics.reference_point``
# per column (a constant column's deviations exactly 0; ``shift`` where the column has none).
column_reference = jax.vmap(reference_point, in_axes=(0, 1, 1, 0))


def _entries(acc: PairAcc, na, nb, mr, mc, cb, vrb, vcb, ar, ac) -> dict:
    """The pair entries of ``acc`` (counts ``na``) with those of rows of counts ``nb`` merged in: means
    ``mr``, ``mc`` about the same points as ``ar``, ``ac`` (``acc``'s), co-moment ``cb``, sums of squares
    ``vrb``, ``vcb``. Returns the new means (about those points), co-moment and sums of squares."""
    n = na + nb
    share = nb / jnp.where(n > 0, n, 1)
    a_empty, b_empty = na == 0, nb == 0
    dr = jnp.where(a_empty | b_empty, 0, mr - ar)
    dc = jnp.where(a_empty | b_empty, 0, mc - ac)
    weight = na * share
    return dict(
        row_mean=jnp.where(a_empty, mr, ar + dr * share), col_mean=jnp.where(a_empty, mc, ac + dc * share),
        co=acc.co + cb + dr * dc * weight, row_m2=acc.row_m2 + vrb + dr * dr * weight,
        col_m2=acc.col_m2 + vcb + dc * dc * weight,
    )


def pair_fold(acc: PairAcc, x: jax.Array, m: jax.Array, shards: int = 1, w: jax.Array | None = None) -> PairAcc:
    """``acc`` with a micro-batch's finite values (``m``: ``(rows, d)``, True where kept) folded in;
    ``w``: the rows' weights ``(rows,)`` (a weighted ``acc``)."""
    dtype, width = acc.co.dtype, acc.co.shape[-1]
    x = x.astype(dtype)
    nbc = jnp.sum(m, axis=0, dtype=jnp.int32)
    shift = jnp.where(wide.is_zero(acc.count), column_reference(acc.shift, x, m, nbc), acc.shift)
    dev = jnp.where(m, (x - shift) - acc.mean, 0)  # from each column's running mean
    mf = m.astype(dtype)

    def own(v):
        return own_columns(v, width, shards)

    def product(a, b):
        return jnp.matmul(a.T, b, preferred_element_type=dtype)

    dev_o, mf_o = own(dev), own(mf)
    wf, wdev = (mf, dev) if w is None else (mf * w.astype(dtype)[:, None], dev * w.astype(dtype)[:, None])
    nb, sr, sc = product(wf, mf_o), product(wdev, mf_o), product(wf, dev_o)
    safe = jnp.where(nb > 0, nb, 1)
    mr, mc = sr / safe, sc / safe
    cb = product(wdev, dev_o) - mr * sc
    vrb, vcb = product(wdev * dev, mf_o) - mr * sr, product(wf, dev_o * dev_o) - mc * sc
    center = acc.mean
    entries = _entries(acc, _pair_weight(acc, dtype), nb, mr, mc, cb, vrb, vcb,
                       acc.row_mean - center[:, None], acc.col_mean - own(center)[None, :])
    entries["row_mean"] = entries["row_mean"] + center[:, None]
    entries["col_mean"] = entries["col_mean"] + own(center)[None, :]
    total = _column_weight(acc, dtype) + (nbc.astype(dtype) if w is None else column_sum(wf))
    mean = acc.mean + column_sum(wdev) / jnp.where(total > 0, total, 1)
    rows = nb if w is None else product(mf, mf_o)
    pairs = wide.add_int32(acc.pairs, jnp.round(rows).astype(jnp.int32))  # < 2^24 rows a micro-batch: exact
    if w is not None:
        entries.update(weight=total, pair_weight=acc.pair_weight + nb,
                       pair_weight_sq=acc.pair_weight_sq + product(wf * w.astype(dtype)[:, None], mf_o))
    return PairAcc(wide.add_int32(acc.count, nbc), shift, mean, pairs, **entries)


def pair_merge(a: PairAcc, b: PairAcc, shards: int = 1) -> PairAcc:
    """Chan's combination of two accumulators, entry by entry (an empty side adds nothing)."""
    dtype, width = a.co.dtype, a.co.shape[-1]
    a_empty, b_empty = wide.is_zero(a.count), wide.is_zero(b.count)
    shift = jnp.where(a_empty, b.shift, a.shift)
    ua, ub = a.shift - shift, b.shift - shift  # the shifts are close, so their difference is exact

    def own(v):
        return own_columns(v, width, shards)

    na, nb = _column_weight(a, dtype), _column_weight(b, dtype)
    ma, mb = a.mean + ua, b.mean + ub
    mean = jnp.where(a_empty, mb, jnp.where(b_empty, ma, ma + (mb - ma) * (nb / jnp.where(na + nb > 0, na + nb, 1))))
    ra, ca = a.row_mean + ua[:, None], a.col_mean + own(ua)[None, :]
    rb, cbm = b.row_mean + ub[:, None], b.col_mean + own(ub)[None, :]
    entries = _entries(a, _pair_weight(a, dtype), _pair_weight(b, dtype), rb, cbm, b.co, b.row_m2, b.col_m2, ra, ca)
    if a.weight is not None:
        entries.update(weight=a.weight + b.weight, pair_weight=a.pair_weight + b.pair_weight,
                       pair_weight_sq=a.pair_weight_sq + b.pair_weight_sq)
    return PairAcc(wide.add(a.count, b.count), shift, mean, wide.add(a.pairs, b.pairs), **entries)


class PairwiseCoMoments(SplitsByColumns, Combiner):
    """The pairwise-complete co-moments of rows X (n, d): each pair of columns over the rows where both
    are finite (the module's docstring); a NaN or Inf skipped where it stands. A subclass (a dataclass
    with a ``model_shards`` field) says what its :meth:`result` makes of them."""

    def check_spec(self, spec):
        super().check_spec(spec)
        check_matrix_spec(spec, type(self).__name__)

    def partition(self, mesh, weighted: bool = False):
        if self.model_shards == 1:
            return None
        split = P(None, MODEL_AXIS)
        return PairAcc(P(), P(), P(), *(split,) * len(PAIR_FIELDS), *((P(), split, split) if weighted else ()))

    def convert(self, acc, source):
        del source
        d = np.shape(acc.mean)[0]
        width = round_up(d, self.model_shards)
        return acc._replace(**{f: jax.tree.map(lambda x: padded_columns(x, d, width, axis=1), getattr(acc, f))
                               for f in PAIR_FIELDS + WEIGHT_FIELDS})

    def init(self, spec):
        return pair_init(spec.shape[0], accumulator_dtype(spec.dtype), self.model_shards)

    def add(self, acc, batch, mask):
        cells = mask[:, None] & (jnp.isfinite(batch) if jnp.issubdtype(batch.dtype, jnp.inexact) else True)
        return pair_fold(acc, batch, cells, self.model_shards)

    def finite_values(self, batch):
        return batch  # add skips each NaN or inf where it stands (per key too: GroupBy's add_keyed is add's)

    def merge(self, a, b):
        return pair_merge(a, b, self.model_shards)

    def weighted(self):
        return WeightedPairwise(self)

    def finalize(self, acc):
        d = np.shape(acc.mean)[0]
        host = {f: np.asarray(getattr(acc, f), np.float64)[:, :d] for f in PAIR_FIELDS + WEIGHT_FIELDS
                if f != "pairs" and getattr(acc, f) is not None}
        pairs = wide.to_int(jax.tree.map(lambda x: np.asarray(x)[:, :d], acc.pairs))
        count = wide.to_int(acc.count)
        mean = np.where(count > 0, np.asarray(acc.shift, np.float64) + np.asarray(acc.mean, np.float64), np.nan)
        for f in ("row_m2", "col_m2"):
            host[f] = np.maximum(host[f], 0.0)  # rounding leaves a sum of squares a few ulps below 0
        return self.result(count, mean, pairs, host)

    def result(self, count, mean, pairs, host):
        """The result from the finished state: ``host`` holds the float fields of the real columns (a
        weighted form's ``pair_weight`` and ``pair_weight_sq`` too)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class WeightedPairwise(WeightedForm):
    """The weighted form of a :class:`PairwiseCoMoments`, on rows ``(w, X)`` (``Weighted`` hands it rows
    of ``w > 0``): each pair over the rows where both values are finite, those rows' weights as counts
    (the module's docstring). ``count`` and ``pair_count`` count rows (of positive weight), as
    ``WeightedCentred``'s ``count``; ``mean`` is each column's ``np.average`` of its finite values."""

    unweighted: PairwiseCoMoments

    def partition(self, mesh):
        return self.unweighted.partition(mesh, weighted=True)

    def convert(self, acc, source):
        return self.unweighted.convert(acc, source.unweighted)

    def init(self, spec):
        w, x = spec
        dtype = accumulator_dtype(np.result_type(w.dtype, x.dtype))
        return pair_init(x.shape[0], dtype, self.unweighted.model_shards, weighted=True)

    def add(self, acc, batch, mask):
        w, x = batch
        cells = mask[:, None] & (jnp.isfinite(x) if jnp.issubdtype(x.dtype, jnp.inexact) else True)
        return pair_fold(acc, x, cells, self.unweighted.model_shards, jnp.where(mask, w, 0))

    def finite_values(self, batch):
        return batch  # add skips each NaN or inf where it stands

    def merge(self, a, b):
        return pair_merge(a, b, self.unweighted.model_shards)

    def finalize(self, acc):
        return self.unweighted.finalize(acc)


@dataclasses.dataclass(frozen=True)
class PairwiseCovariance(PairwiseCoMoments):
    """``Covariance`` under ``nan_policy="omit"``: pandas' ``df.cov(ddof=ddof)``, each entry over the rows
    where both columns are finite; NaN where a pair has ``ddof`` rows or fewer. ``count`` is each
    column's count of finite values, ``pair_count`` each pair's rows, ``mean`` each column's mean of its
    finite values (``df.mean()``)."""

    ddof: int = 1
    model_shards: int = 1

    def check_spec(self, spec):
        super().check_spec(spec)
        check_ddof(self.ddof, "Covariance")

    def result(self, count, mean, pairs, host):
        dof = pairs - self.ddof
        with np.errstate(divide="ignore", invalid="ignore"):
            if "pair_weight" in host:  # weighted: np.cov(aweights=) over each pair's rows
                weight = host["pair_weight"]
                dof = np.where((weight > 0) & (pairs > self.ddof),
                               weight - self.ddof * host["pair_weight_sq"] / np.where(weight > 0, weight, 1), 0.0)
            cov = np.where(dof > 0, host["co"] / np.where(dof > 0, dof, 1), np.nan)
        np.fill_diagonal(cov, np.where(np.diagonal(dof) > 0, np.maximum(np.diagonal(cov), 0.0), np.nan))
        return CovarianceResult(count, mean, cov, pair_count=pairs)


@dataclasses.dataclass(frozen=True)
class PairwiseCorrelation(PairwiseCoMoments):
    """``Correlation`` under ``nan_policy="omit"``: pandas' ``df.corr()``, each entry the Pearson
    correlation over the rows where both columns are finite (its co-moment over the square root of the
    two sums of squared deviations over those rows); NaN where a pair has fewer than 2 rows or either
    column is constant over them (one ``RuntimeWarning`` naming the constant columns); clipped to
    ``[-1, 1]``, an exact 1 on the diagonal of a column that is not constant."""

    model_shards: int = 1

    def result(self, count, mean, pairs, host):
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.sqrt(host["row_m2"] * host["col_m2"])
            corr = np.where((pairs >= 2) & (scale > 0), np.clip(host["co"] / scale, -1.0, 1.0), np.nan)
        diagonal = np.diagonal(scale) > 0
        constant = np.flatnonzero((count >= 2) & ~diagonal)
        if constant.size:
            warnings.warn(
                f"Correlation: columns {constant.tolist()} are constant (zero variance) over their finite values: "
                "their correlations are NaN, as df.corr()'s.", RuntimeWarning, stacklevel=2,
            )
        np.fill_diagonal(corr, np.where(diagonal, 1.0, np.nan))
        return CorrelationResult(count, mean, corr, pair_count=pairs)
