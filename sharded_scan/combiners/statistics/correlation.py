"""Pearson correlation from the stable centred co-moments :class:`Covariance` keeps."""

from __future__ import annotations

import dataclasses
import warnings
from typing import NamedTuple

import numpy as np

from sharded_scan.combiners import wide
from sharded_scan.combiners.results import frame, labels
from sharded_scan.combiners.statistics.comoments import CoMoments
from sharded_scan.combiners.statistics.moments import host_m2, host_mean, no_rows, real_columns


class CorrelationResult(NamedTuple):
    """Row count, column means and the (d, d) Pearson correlations, like ``np.corrcoef(x, rowvar=False)``.

    Under ``nan_policy="omit"`` (pandas' ``df.corr()``, pairwise complete): ``count`` and ``mean`` per
    column over its finite values, ``corr[i, j]`` over the rows where both columns are finite (NaN where
    fewer than 2), ``pair_count[i, j]`` counts them (None under the other policies); weighted, the rows of
    positive weight, each pair's correlation that of ``np.cov(aweights=)`` over them."""

    count: np.ndarray
    mean: np.ndarray
    corr: np.ndarray
    columns: np.ndarray | None = None  # X's column names (a DataFrame, Parquet, CSV), else np.arange(d)
    pair_count: np.ndarray | None = None  # (d, d) rows of each pair, under nan_policy="omit"

    def to_pandas(self):
        """The correlation matrix as a DataFrame named by the columns both ways, like ``df.corr()``."""
        return frame(self, ("corr",), spread={"corr": labels(self, np.shape(self.corr)[0])})


@dataclasses.dataclass(frozen=True)
class Correlation(CoMoments):
    """Pearson correlations of the columns of rows X (n, d), in one pass, stable far from zero.

    ``M2 / √(diag M2 diag M2ᵀ)`` of the centred co-moments (Chan's merge, as ``Covariance``),
    clipped to ``[-1, 1]`` with an exact 1 on the diagonal, like ``np.corrcoef``. A constant
    column (zero variance) has NaN correlations, with one ``RuntimeWarning`` naming it (numpy
    warns of the division). Weighted (``Weighted(Correlation())``): ``np.cov(aweights=)``'s
    correlations (the divisor cancels). Under ``nan_policy="omit"`` pairwise complete, as pandas'
    ``df.corr()``: each entry over the rows where both columns are finite (``pair_count``), NaN where
    fewer than 2 (:class:`~sharded_scan.combiners.statistics.pairwise.PairwiseCorrelation`); weighted too, each
    pair over its rows' weights.

    Attributes:
      model_shards: set by :meth:`for_mesh`: when above 1 the (d, d) co-moments are split by
        columns over the mesh's ``model`` axis (the means whole on every device).
    """

    model_shards: int = 1

    def omitting_values(self):
        """The pairwise-complete form (pandas' ``df.corr()``): each pair of columns over the rows where both
        are finite (:mod:`~sharded_scan.combiners.statistics.pairwise`)."""
        from sharded_scan.combiners.statistics.pairwise import PairwiseCorrelation  # it builds on this module

        return PairwiseCorrelation(model_shards=self.model_shards)

    def result(self, acc, weight=None, weight_sq=None):
        del weight, weight_sq  # the divisor cancels
        acc, count = real_columns(acc), wide.to_int(acc.count)
        if no_rows(count, "Correlation"):
            return CorrelationResult(count, *(np.full(np.shape(a), np.nan) for a in (acc.mean, acc.m2)))
        m2 = host_m2(acc)
        scale = np.sqrt(np.diagonal(m2))
        constant = np.flatnonzero(scale == 0)
        if constant.size:
            warnings.warn(
                f"Correlation: columns {constant.tolist()} are constant (zero variance): their correlations are NaN, "
                "as np.corrcoef's.", RuntimeWarning, stacklevel=2,
            )
        with np.errstate(divide="ignore", invalid="ignore"):
            corr = np.clip(m2 / np.outer(scale, scale), -1.0, 1.0)
        live = scale > 0
        corr[np.diag(live)] = 1.0
        return CorrelationResult(count, host_mean(acc), corr)
