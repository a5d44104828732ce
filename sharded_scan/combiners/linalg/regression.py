"""Linear (ridge) regression from a numerically stable factor of the data, solved on the host."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sharded_scan.combiners.base import Combiner
from sharded_scan.combiners.linalg.lstsq import check_has_rows, diagnostics, least_squares
from sharded_scan.combiners.linalg.solvers import (
    DEFAULT_SOLVER,
    Solver,
    SplitsCoMoments,
    WeightedFactored,
    check_solver,
)
from sharded_scan.combiners.results import frame
from sharded_scan.dtypes import accumulator_dtype, check_numeric
from sharded_scan.errors import UsageError


class LinearRegressionResult(NamedTuple):
    """Coefficients (``(d,)``, or ``(t, d)`` for ``t`` targets), the intercept, and what the solve saw.

    ``rank`` and ``cond`` are the rank and condition number of ``X`` (centred when an
    intercept is fitted) with its columns scaled to unit norm, as accumulated: an
    exactly singular ``X`` shows a ``cond`` of about 1/eps of the accumulator dtype (not
    inf), singular values below the accumulation's rounding do not count to ``rank``,
    and a rank-deficient ``X`` gets the minimum-norm solution.

    The diagnostics come from the same factor (no second pass), per target like
    ``intercept``, and read as statsmodels ``OLS``'s: ``r2`` its ``rsquared`` (``1 - RSS/TSS``,
    TSS about the mean with an intercept, about zero without; NaN for a constant ``y``),
    ``residual_std`` its ``sqrt(scale)`` (``√(RSS / (n - rank - intercept))``, the residual
    standard error), ``coef_stderr`` (shaped like ``coef``) and ``intercept_stderr`` its
    ``bse``. The standard errors are NaN for a ridge fit (``l2 > 0``: the OLS formula does
    not hold for a biased estimator, and the ridge one needs a choice of degrees of freedom;
    ``r2`` and ``residual_std`` still describe its residuals), for a rank-deficient ``X``, and
    when ``n <= rank + intercept`` (no degree of freedom; ``residual_std`` NaN too);
    ``intercept_stderr`` is NaN without ``fit_intercept`` (the intercept is fixed at 0).

    Rows holding NaN or inf (which ``nan_policy="propagate"``, the default, lets in) make every
    field NaN and ``rank`` -1, as any statistic computed from a row holding NaN: never a lower
    rank and finite coefficients; ``nan_policy="omit"`` (as ``"omit_rows"``) fits the other rows, as
    statsmodels' ``missing="drop"``: a fit needs whole rows.

    Weighted (``Weighted(LinearRegression())`` on ``(w, (X, y))``) the fit is scikit-learn's with
    ``sample_weight`` and the diagnostics statsmodels ``WLS(weights=)``'s on the rows of positive
    weight: a zero weight is an omitted row, so ``n`` above counts the rows of positive weight
    (statsmodels would count zero-weight rows in ``nobs``), RSS and TSS are weighted, and ``Σw``
    stands for ``n`` in the intercept's standard error.
    """

    coef: np.ndarray
    intercept: np.ndarray
    rank: np.ndarray
    cond: np.ndarray
    r2: np.ndarray
    residual_std: np.ndarray
    coef_stderr: np.ndarray
    intercept_stderr: np.ndarray
    columns: np.ndarray | None = None  # X's column names (a DataFrame, Parquet, CSV), else np.arange(d)

    def to_pandas(self):
        """A DataFrame: a row per column of X, its ``coef`` and ``coef_stderr`` (``coef_0..``,
        ``coef_stderr_0..`` per target), and the ``rank``, ``cond`` and (one target) ``intercept``,
        ``r2``, ``residual_std`` and ``intercept_stderr`` repeated."""
        if np.ndim(self.coef) == 1:
            return frame(self, ("coef", "coef_stderr", "intercept", "rank", "cond", "r2", "residual_std",
                                "intercept_stderr"))
        targets = range(np.shape(self.coef)[0])
        fields = (("coef", np.transpose(self.coef)), ("coef_stderr", np.transpose(self.coef_stderr)), "rank", "cond")
        spread = {"coef": [f"coef_{i}" for i in targets], "coef_stderr": [f"coef_stderr_{i}" for i in targets]}
        return frame(self, fields, spread=spread)


class RegressionAcc(NamedTuple):
    """The solver's accumulator of ``[X | y]``, and zeros shaped like one row of ``y``."""

    rows: Any
    targets: jax.Array  # () for y of shape (n,), else (t,): tells finalize which result shape


def stacked(x: jax.Array, y: jax.Array, dtype) -> jax.Array:
    """The rows ``[x | y]`` in ``dtype`` (``y`` of shape ``(n,)`` or ``(n, t)``)."""
    return jnp.concatenate([x.astype(dtype), y.reshape(y.shape[0], -1).astype(dtype)], axis=1)


@dataclasses.dataclass(frozen=True)
class LinearRegression(SplitsCoMoments, Combiner):
    """Least squares (ridge when ``l2 > 0``) of ``y`` on ``X``; data is the pair ``(X, y)``.

    Each device accumulates a factor of the rows ``[X | y]`` (by default the R of their
    QR, see ``solver``); partials merge once, and the problem is solved from the factor
    in float64 on the host, never from normal equations. With ``fit_intercept`` the
    intercept is not penalised, like ``sklearn.linear_model.Ridge(alpha=l2)``; with
    ``l2 == 0`` a rank-deficient ``X`` gets the minimum-norm solution, like
    ``numpy.linalg.lstsq``, and the result reports the rank and condition number.

    Args:
      l2: the ridge penalty ``alpha`` on the coefficients, ``>= 0``.
      fit_intercept: fit an unpenalised intercept.
      solver: ``"tsqr"`` (Householder QR of each micro-batch under the running R) or
        ``"comoments"`` (centred co-moments: faster, but errors grow with the square
        of the condition number). The ``"comoments"`` state splits by columns over a mesh's
        ``model`` axis (``[X | y]``'s co-moments, as ``Covariance``'s): the solver of a wide ``X``.
      model_shards: set by :meth:`for_mesh` for ``solver="comoments"`` only.
    """

    one_scan_per_step = True  # its add (by default a re-whitening fold) is slow to compile and cheap to mask

    l2: float = 0.0
    fit_intercept: bool = True
    solver: str = DEFAULT_SOLVER
    model_shards: int = 1

    def __post_init__(self):
        if not np.isfinite(self.l2) or self.l2 < 0:
            raise UsageError(f"LinearRegression needs l2 >= 0, got l2={self.l2!r}.")
        check_solver("LinearRegression", self.solver)

    def check_spec(self, spec):
        if not (isinstance(spec, tuple) and len(spec) == 2 and all(isinstance(s, jax.ShapeDtypeStruct) for s in spec)):
            raise UsageError(
                f"LinearRegression takes the pair (X, y) of arrays, got data shaped like {jax.tree.structure(spec)}; "
                "pass data=(X, y)."
            )
        x, y = spec
        for leaf in spec:
            check_numeric(leaf.dtype, "LinearRegression")
        if len(x.shape) != 1:
            raise UsageError(f"LinearRegression needs X of shape (n, d), got rows of X of shape {x.shape}; reshape X.")
        if len(y.shape) > 1:
            raise UsageError(
                f"LinearRegression needs y of shape (n,) or (n, t), got rows of y of shape {y.shape}; reshape y."
            )

    def init(self, spec):
        x, y = spec
        dtype = accumulator_dtype(np.result_type(x.dtype, y.dtype))
        rows = self._solver(y.shape).init(x.shape[0] + int(np.prod(y.shape)), dtype)
        return RegressionAcc(rows, jnp.zeros(y.shape, dtype))

    def _solver(self, y_shape) -> Solver:
        return self.solver_for(int(np.prod(y_shape)))

    def partition(self, mesh):
        parts = super().partition(mesh)
        return None if parts is None else RegressionAcc(parts, P())

    def convert(self, acc, source):
        if self.solver != "comoments":
            return super().convert(acc, source)
        return acc._replace(rows=super().convert(acc.rows, source))

    def add(self, acc, batch, mask):
        x, y = batch
        rows = self._solver(acc.targets.shape).add(acc.rows, stacked(x, y, acc.targets.dtype), mask)
        return acc._replace(rows=rows)

    def merge(self, a, b):
        return a._replace(rows=self._solver(a.targets.shape).merge(a.rows, b.rows))

    def weighted(self):
        return WeightedFactored(self)

    def add_weighted(self, acc, batch, mask, w, before):
        """:meth:`add` of rows weighing ``w`` (``before``: ``Σw`` so far), for :class:`WeightedFactored`."""
        x, y = batch
        dtype = acc.targets.dtype
        rows = self._solver(acc.targets.shape).add_weighted(acc.rows, stacked(x, y, dtype), mask, w.astype(dtype),
                                                            before.astype(dtype))
        return acc._replace(rows=rows)

    def merge_weighted(self, a, b, wa, wb):
        dtype = a.targets.dtype
        return a._replace(rows=self._solver(a.targets.shape).merge_weighted(a.rows, b.rows, wa.astype(dtype),
                                                                            wb.astype(dtype)))

    def finalize(self, acc):
        return self.result(acc)

    def result(self, acc: RegressionAcc, weight: float | None = None, weight_sq: float | None = None):
        """The host result; ``weight`` ``Σw`` of a weighted run (None: every row weighs 1)."""
        del weight_sq
        factor = self._solver(np.shape(acc.targets)).factor(acc.rows)._replace(weight=weight)
        check_has_rows(factor, "LinearRegression")
        t = int(np.prod(np.shape(acc.targets)))
        solution = least_squares(factor, factor.mean.size - t, self.l2, self.fit_intercept)
        fit = diagnostics(factor, solution, self.l2, self.fit_intercept)
        per_target = (solution.coef, solution.intercept, fit.r2, fit.residual_std, fit.coef_stderr,
                      fit.intercept_stderr)
        if np.ndim(acc.targets) == 0:  # y of shape (n,): coef (d,), scalars per target
            per_target = tuple(v[0] if v.ndim > 1 else np.float64(v[0]) for v in per_target)
        coef, intercept, r2, residual_std, coef_stderr, intercept_stderr = per_target
        return LinearRegressionResult(coef, intercept, solution.rank, solution.cond, r2, residual_std, coef_stderr,
                                      intercept_stderr)
