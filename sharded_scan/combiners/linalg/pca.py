"""Principal component analysis from a stable factor of the data."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from sharded_scan.combiners.base import Combiner
from sharded_scan.combiners.linalg.lstsq import check_has_rows, principal_axes
from sharded_scan.combiners.linalg.solvers import (
    DEFAULT_SOLVER,
    Solver,
    SplitsCoMoments,
    WeightedFactored,
    check_solver,
)
from sharded_scan.combiners.results import frame
from sharded_scan.combiners.statistics.moments import divisor
from sharded_scan.combiners.statistics.sums import check_matrix_spec
from sharded_scan.dtypes import accumulator_dtype
from sharded_scan.errors import UsageError


class PCAResult(NamedTuple):
    """The top ``k`` principal axes (rows), their variances and ratios, the mean, and the
    singular values of the centred data (scikit-learn's ``singular_values_``).

    Weighted (``Weighted(PCA(k))`` on ``(w, X)``): the axes of the weighted covariance about the
    weighted mean, ``explained_variance`` divided by ``Σw - Σw²/Σw`` as ``np.cov(aweights=)``
    (ddof 1, as the unweighted ``n - 1``), the singular values those of the ``√w``-scaled rows."""

    components: np.ndarray
    explained_variance: np.ndarray
    explained_variance_ratio: np.ndarray
    mean: np.ndarray
    singular_values: np.ndarray
    columns: np.ndarray | None = None  # X's column names (a DataFrame, Parquet, CSV), else np.arange(d)

    def to_pandas(self):
        """The loadings as a DataFrame: a row per column, ``PC1..PCk`` (each axis's weights), ``mean``."""
        names = [f"PC{i + 1}" for i in range(len(self.explained_variance))]
        return frame(self, (("components", np.transpose(self.components)), "mean"), spread={"components": names})


@dataclasses.dataclass(frozen=True)
class PCA(SplitsCoMoments, Combiner):
    """Principal component analysis, like ``sklearn.decomposition.PCA(svd_solver="full")``.

    The devices accumulate a factor of the rows (by default the R of their QR, see
    ``solver``, as ``IncrementalPCA`` and ``dask.array.linalg.svd`` do); the singular
    values and right singular vectors of the centred data come from it in float64 on
    the host, never from a covariance matrix, so small components keep their digits.
    Components are rows, sorted by decreasing variance, each signed so that its
    largest-magnitude entry is positive (scikit-learn's ``svd_flip`` convention).

    Args:
      k: the number of components, ``1 <= k <= d``.
      solver: the accumulator, as for :class:`~sharded_scan.LinearRegression`.
      model_shards: set by :meth:`for_mesh` for ``solver="comoments"`` only: when above 1 the (d, d)
        co-moments are split by columns over the mesh's ``model`` axis, as ``Covariance``'s.
    """

    one_scan_per_step = True  # its add (by default a re-whitening fold) is slow to compile and cheap to mask

    k: int
    solver: str = DEFAULT_SOLVER
    model_shards: int = 1

    def __post_init__(self):
        check_solver("PCA", self.solver)

    def _solver(self) -> Solver:
        return self.solver_for(0)

    def check_spec(self, spec):
        super().check_spec(spec)
        check_matrix_spec(spec, "PCA")
        d = spec.shape[0]
        k = self.k
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= d:
            raise UsageError(f"PCA needs 1 <= k <= d = {d} (the number of columns), got k={k!r}.")

    def init(self, spec):
        return self._solver().init(spec.shape[0], accumulator_dtype(spec.dtype))

    def add(self, acc, batch, mask):
        return self._solver().add(acc, batch, mask)

    def merge(self, a, b):
        return self._solver().merge(a, b)

    def weighted(self):
        return WeightedFactored(self)

    def add_weighted(self, acc, batch, mask, w, before):
        """:meth:`add` of rows weighing ``w`` (``before``: ``Σw`` so far), for :class:`WeightedFactored`."""
        dtype = accumulator_dtype(batch.dtype)
        return self._solver().add_weighted(acc, batch, mask, w.astype(dtype), before.astype(dtype))

    def merge_weighted(self, a, b, wa, wb):
        return self._solver().merge_weighted(a, b, wa, wb)

    def finalize(self, acc):
        return self.result(acc)

    def result(self, acc, weight: float | None = None, weight_sq: float | None = None) -> PCAResult:
        """The host result; ``weight``, ``weight_sq``: ``Σw``, ``Σw²`` of a weighted run (None:
        every row weighs 1; the variances then divide by ``Σw - Σw²/Σw``, ``np.cov(aweights=)``'s)."""
        factor = self._solver().factor(acc)._replace(weight=weight)
        check_has_rows(factor, "PCA")
        axes = principal_axes(factor)
        squares = axes.singular_values**2
        with np.errstate(divide="ignore", invalid="ignore"):
            variance = squares / divisor(factor.count, 1, weight, weight_sq)
            ratio = squares / squares.sum()
        k = self.k
        return PCAResult(axes.components[:k], variance[:k], ratio[:k], factor.mean, axes.singular_values[:k])
