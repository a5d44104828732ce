"""The co-moments family: ``Covariance`` (and ``Correlation``, :mod:`.correlation`, on the same state), the
centred co-moments of rows X (n, d) kept in the accumulator of :mod:`.moments` (``full=True``).

On a mesh with a ``model`` axis of M devices the co-moment matrix is split by columns
(``(d, round_up(d, M))``, each device ``d x ceil(d / M)``) while ``count``, ``shift`` and ``mean`` stay
whole on every device: every device folds and merges the same means, and the outer products of its own
block of columns (:func:`~.moments.own_columns`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
from jax.sharding import PartitionSpec as P

from sharded_scan.combiners import wide
from sharded_scan.combiners.base import Combiner
from sharded_scan.combiners.column_split import SplitsByColumns, padded_columns, round_up
from sharded_scan.combiners.results import frame, labels
from sharded_scan.combiners.statistics.moments import (
    CenteredAcc,
    WeightedCentred,
    _divide,
    centered_fold,
    centered_fold_keyed,
    centered_init,
    centered_merge,
    check_ddof,
    divisor,
    host_m2,
    host_mean,
    merged,
    no_rows,
    real_columns,
)
from sharded_scan.combiners.statistics.sums import OUTER_PRODUCTS_AT_ONCE, check_matrix_spec
from sharded_scan.dtypes import accumulator_dtype
from sharded_scan.mesh import MODEL_AXIS


class CovarianceResult(NamedTuple):
    """Row count, column means and the (d, d) covariance, like ``np.cov(x, rowvar=False)``.

    Under ``nan_policy="omit"`` (pandas' ``df.cov()``, pairwise complete): ``count`` holds each column's
    count of finite values, ``mean`` each column's mean of them, ``cov[i, j]`` is over the rows where
    both columns are finite, ``pair_count[i, j]`` counts them (None under the other policies: every
    entry is over ``count`` rows). Weighted, ``count`` and ``pair_count`` count the rows of positive weight,
    ``mean`` is ``np.average`` and ``cov[i, j]`` ``np.cov(aweights=)`` over those rows."""

    count: np.ndarray
    mean: np.ndarray
    cov: np.ndarray
    columns: np.ndarray | None = None  # X's column names (a DataFrame, Parquet, CSV), else np.arange(d)
    pair_count: np.ndarray | None = None  # (d, d) rows of each pair, under nan_policy="omit"

    def to_pandas(self):
        """The covariance matrix as a DataFrame named by the columns both ways, like ``df.cov()``."""
        return frame(self, ("cov",), spread={"cov": labels(self, np.shape(self.cov)[0])})


def split_partition(shards: int) -> CenteredAcc | None:
    """The partition of full co-moments split by columns over ``shards`` ``model`` devices (the
    means whole on each), or None when ``shards`` is 1 (whole)."""
    split = P(None, MODEL_AXIS)
    return CenteredAcc(P(), P(), P(), split, split) if shards > 1 else None


def laid_out(acc: CenteredAcc, shards: int) -> CenteredAcc:
    """Full co-moments, whole or split over ``model``, laid out for ``shards`` ``model`` devices (a
    resume on a mesh with other axes): the real columns, padded with zeros to that many blocks."""
    d = acc.mean.shape[-1]
    return acc._replace(**{name: padded_columns(getattr(acc, name), d, round_up(d, shards), axis=1)
                           for name in ("m2", "m2_lost")})


class CoMoments(SplitsByColumns, Combiner):
    """The centred co-moments of rows X (n, d), and their keyed and weighted forms: what
    :class:`Covariance` and :class:`~sharded_scan.Correlation` accumulate; a subclass says what
    its :meth:`result` makes of them (of the real columns: :func:`real_columns`). A subclass is a
    dataclass with a ``model_shards`` field (set by :meth:`for_mesh`): above 1 the co-moment
    matrix is split by columns over ``model``."""

    def check_spec(self, spec):
        super().check_spec(spec)
        check_matrix_spec(spec, type(self).__name__)

    def partition(self, mesh):
        return split_partition(self.model_shards)

    def convert(self, acc, source):
        del source
        return laid_out(acc, self.model_shards)

    def init(self, spec):
        return centered_init(spec.shape[0], accumulator_dtype(spec.dtype), full=True, shards=self.model_shards)

    def add(self, acc, batch, mask):
        return centered_fold(acc, batch, mask, full=True, shards=self.model_shards)

    def folds_keyed_at_once(self, x) -> bool:
        """Whether a keyed micro-batch ``x`` folds in one go: not when its per-row outer products are too many."""
        return x.shape[0] * x.shape[1] ** 2 <= OUTER_PRODUCTS_AT_ONCE

    def add_keyed(self, acc, batch, mask, keys, num_keys):
        if not self.folds_keyed_at_once(batch):
            return super().add_keyed(acc, batch, mask, keys, num_keys)
        return centered_fold_keyed(acc, batch, mask, keys, num_keys, full=True, shards=self.model_shards)

    def fold_weighted(self, acc, x, keep, seen, weights, before, keyed=None):
        """The co-moments of rows weighing ``weights`` (:class:`WeightedCentred`), ``before`` the ``Σw``
        folded; ``keyed``: ``(keys, num_keys)``. Whole rows are kept or skipped: ``seen`` is not needed."""
        del seen
        if keyed:
            return centered_fold_keyed(acc, x, keep, *keyed, full=True, weights=weights, before=before,
                                       shards=self.model_shards)
        return centered_fold(acc, x, keep, full=True, weights=weights, before=before, shards=self.model_shards)

    def merge(self, a, b, na=None, nb=None):
        """Chan's merge; of weights ``na``, ``nb`` (a weighted run's ``Σw``) when given, else of the counts."""
        if na is None:
            return centered_merge(a, b, full=True, shards=self.model_shards)
        return merged(a, b, na, nb, full=True, shards=self.model_shards)[0]

    def weighted(self):
        return WeightedCentred(self)

    def finalize(self, acc):
        return self.result(acc)

    def result(self, acc: CenteredAcc, weight: float | None = None, weight_sq: float | None = None):
        """The host result of the merged co-moments; ``weight``, ``weight_sq``: ``Σw``, ``Σw²`` of
        a weighted run (None: every row weighed 1)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Covariance(CoMoments):
    """The covariance matrix of rows X (n, d), stable for data far from zero.

    Weighted (``Weighted(Covariance())`` on ``(w, X)``), like ``np.cov(X, rowvar=False,
    aweights=w, ddof=ddof)``: the divisor is ``Σw - ddof Σw²/Σw`` (reliability weights; at
    ``ddof=0``, ``Σw``).

    Under ``nan_policy="omit"`` pairwise complete, as pandas' ``df.cov()``: each entry over the rows
    where both columns are finite (``pair_count``), NaN where a pair has ``ddof`` rows or fewer
    (:class:`~sharded_scan.combiners.statistics.pairwise.PairwiseCovariance`); weighted too, each pair over its
    rows' weights (``np.cov(aweights=)`` of the pair's rows).

    Args:
      ddof: delta degrees of freedom; the divisor is ``count - ddof`` (1, the default, like
        ``np.cov`` and ``df.cov()``; each built-in takes the default of the function it
        mirrors: ``Moments`` 0 like ``np.var``, ``Describe`` 1 like pandas).
      model_shards: set by :meth:`for_mesh`: when above 1 the (d, d) co-moments are split by
        columns over the mesh's ``model`` axis (the means whole on every device).
    """

    ddof: int = 1
    model_shards: int = 1

    def check_spec(self, spec):
        super().check_spec(spec)
        check_ddof(self.ddof, type(self).__name__)

    def omitting_values(self):
        """The pairwise-complete form (pandas' ``df.cov()``): each pair of columns over the rows where both
        are finite (:mod:`~sharded_scan.combiners.statistics.pairwise`)."""
        from sharded_scan.combiners.statistics.pairwise import PairwiseCovariance  # it builds on this module

        return PairwiseCovariance(ddof=self.ddof, model_shards=self.model_shards)

    def result(self, acc, weight=None, weight_sq=None):
        acc, count = real_columns(acc), wide.to_int(acc.count)
        if no_rows(count, "Covariance"):
            return CovarianceResult(count, *(np.full(np.shape(a), np.nan) for a in (acc.mean, acc.m2)))
        cov = _divide(host_m2(acc), divisor(count, self.ddof, weight, weight_sq))
        return CovarianceResult(count, host_mean(acc), cov)
