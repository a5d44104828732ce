"""Least squares and principal axes on the host, in float64, from a factor of the data.

The regression and PCA accumulators end as a :class:`Factor`: the row count, the column
means of ``Z = [X | Y]`` and a matrix ``F`` with ``FᵀF = (Z - mean)ᵀ(Z - mean)``, e.g. the
R of a QR of the centred rows. Everything here works on ``F``, never on ``FᵀF``, so a
problem keeps the digits its own conditioning allows.

Rank decisions are scale-invariant: singular values are those of ``F``'s ``X`` columns
scaled to unit norm, so a column measured in millimetres instead of kilometres never
looks "singular". A rank-deficient problem gets the minimum-norm solution, like
``numpy.linalg.lstsq``.

A factor of rows holding NaN or inf (``Factor.nonfinite``, under ``nan_policy="propagate"``) is
NaN throughout, and every result made from it is NaN (a rank of -1): never a finite number.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from sharded_scan.errors import UsageError


class Factor(NamedTuple):
    """What a regression or PCA accumulator knows about the data ``Z`` (rows ``z``).

    Attributes:
      count: rows.
      mean: ``(p,)`` column means.
      centred: ``(k, p)`` with ``centredᵀ centred = Σ (z - mean)(z - mean)ᵀ``.
      noise: the relative size below which singular values of the column-scaled
        factor are rounding noise of the accumulation.
      weight: ``Σw`` of weighted rows (then ``mean`` is the weighted mean and ``centred``
        factors ``Σ w (z - mean)(z - mean)ᵀ``; ``count`` the rows of positive weight); None:
        every row weighs 1.
      nonfinite: the rows holding NaN or inf among ``count``; when any, ``mean`` and ``centred``
        are NaN (:func:`nan_factor`) and so is everything solved from them.
    """

    count: int
    mean: np.ndarray
    centred: np.ndarray
    noise: float
    weight: float | None = None
    nonfinite: int = 0

    @property
    def total(self) -> float:
        """``Σw``, or the row count when unweighted."""
        return self.count if self.weight is None else self.weight


def nan_factor(count: int, p: int, nonfinite: int) -> Factor:
    """The factor of ``count`` rows of ``p`` values, ``nonfinite`` of which hold NaN or inf: NaN throughout."""
    return Factor(count, np.full(p, np.nan), np.full((p, p), np.nan), noise=0.0, nonfinite=nonfinite)


def check_finite(factor: Factor) -> None:
    """Raises ``np.linalg.LinAlgError`` when NaN or inf reached a factor of finite rows (an overflow):
    the engine words it as one line. A factor of rows holding NaN or inf (``nonfinite``) is NaN by
    design; the callers give NaN results for it before this."""
    if not (np.isfinite(factor.centred).all() and np.isfinite(factor.mean).all()):
        raise np.linalg.LinAlgError("NaN or inf values reached the solve")


def uncentred(factor: Factor) -> np.ndarray:
    """A factor of ``Σ z zᵀ`` (no intercept): the centred one with ``√n · mean`` stacked on."""
    return np.vstack([np.sqrt(factor.total) * factor.mean[None, :], factor.centred])


class Solution(NamedTuple):
    coef: np.ndarray       # (t, d)
    intercept: np.ndarray  # (t,)
    rank: np.ndarray       # () int64
    cond: np.ndarray       # () float64


def _unit_columns(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``a`` with every nonzero column scaled to unit norm, and the scales (1 for zero columns)."""
    scale = np.linalg.norm(a, axis=0)
    scale = np.where(scale > 0, scale, 1.0)
    return a / scale, scale


def least_squares(factor: Factor, d: int, l2: float = 0.0, fit_intercept: bool = True) -> Solution:
    """Minimises ``‖X b + intercept - Y‖² + l2 ‖b‖²`` for the data ``factor`` describes.

    Like ``sklearn.linear_model.Ridge(alpha=l2, fit_intercept=...)``; with ``l2 == 0``
    like ``numpy.linalg.lstsq`` (minimum norm when ``X`` is rank-deficient).

    Args:
      factor: of ``Z = [X | Y]``, whose first ``d`` columns are ``X``.
      d: the number of ``X`` columns.
      l2: ridge penalty on the coefficients (never on the intercept).
      fit_intercept: centre the data (fit an intercept) or not.

    Returns:
      Coefficients ``(t, d)``, intercepts ``(t,)``, the rank of the column-scaled
      (centred) ``X`` and its condition number (inf only for an exactly zero singular value).
      NaN coefficients, intercepts and condition number, and rank -1, for a factor of rows
      holding NaN or inf (``factor.nonfinite``).
    """
    if factor.nonfinite:
        t = factor.mean.size - d
        return Solution(np.full((t, d), np.nan), np.full(t, np.nan), np.int64(-1), np.float64(np.nan))
    check_finite(factor)
    f = _triangular(factor, fit_intercept)
    fx, fy = f[:, :d], f[:, d:]
    xs, scale = _unit_columns(fx)
    u, s, vt = np.linalg.svd(xs, full_matrices=False)
    top = s[0] if s.size else 0.0
    keep = s > factor.noise * top if top > 0 else np.zeros_like(s, bool)
    rank = int(keep.sum())
    cond = float(top / s[-1]) if s.size and s[-1] > 0 else float("inf")
    if l2 > 0:  # [X; √l2 I] b = [Y; 0], in scaled coordinates: full rank
        penalty = np.sqrt(l2) * np.diag(1.0 / scale)
        gamma = np.linalg.lstsq(np.vstack([xs, penalty]), np.vstack([fy, np.zeros((d, fy.shape[1]))]), rcond=None)[0]
        coef = gamma / scale[:, None]
    elif rank == d:  # back substitution: componentwise stable, a few tenths of a digit better than the SVD
        coef = _back_substitution(fx[:d], fy[:d])
    else:
        inverse = np.where(keep, 1.0 / np.where(keep, s, 1.0), 0.0)
        coef = (vt.T @ (inverse[:, None] * (u.T @ fy))) / scale[:, None]
        if rank < d:  # project out the null space (in the original coordinates): minimum norm
            null = np.linalg.qr(vt[rank:].T / scale[:, None])[0]
            coef = coef - null @ (null.T @ coef)
    mean_x, mean_y = factor.mean[:d], factor.mean[d:]
    intercept = mean_y - coef.T @ mean_x if fit_intercept else np.zeros(fy.shape[1])
    return Solution(coef.T, intercept, np.int64(rank), np.float64(cond))


def _triangular(factor: Factor, fit_intercept: bool) -> np.ndarray:
    """A triangular factor of the (centred when ``fit_intercept``) ``ZᵀZ`` (a triangular
    factor comes back as it was, up to signs)."""
    return np.linalg.qr(factor.centred if fit_intercept else uncentred(factor), mode="r")


class Diagnostics(NamedTuple):
    r2: np.ndarray                # (t,)
    residual_std: np.ndarray      # (t,)
    coef_stderr: np.ndarray       # (t, d)
    intercept_stderr: np.ndarray  # (t,)


def diagnostics(factor: Factor, solution: Solution, l2: float = 0.0, fit_intercept: bool = True) -> Diagnostics:
    """The fit's R², residual standard error and standard errors, as statsmodels ``OLS`` reports them.

    From the same factor as the fit: the residual sum of squares of ``solution``'s
    coefficients is ``‖F_y - F_x coef‖²`` (``FᵀF`` the centred co-moments, or the uncentred
    ones without an intercept), so no second pass over the data.

    Args:
      factor: of ``Z = [X | Y]``, as given to :func:`least_squares`.
      solution: what :func:`least_squares` found for the same ``l2`` and ``fit_intercept``.
      l2: the ridge penalty of the fit.
      fit_intercept: whether the fit centred the data.

    Returns:
      Per target: ``r2`` (``1 - RSS / TSS``; TSS about the mean with an intercept, about
      zero without one, as statsmodels; NaN for a ``y`` with TSS 0), ``residual_std``
      (``√(RSS / (n - rank - intercept))``, statsmodels' ``√scale``; NaN when that is no
      degree of freedom), and the standard errors of the coefficients and intercept
      (statsmodels' ``bse``): NaN for a ridge fit (the OLS formula does not hold for a
      biased estimator), a rank-deficient ``X``, no degree of freedom, and, without an
      intercept, for the intercept (fixed at 0, not estimated). All NaN for a factor of rows
      holding NaN or inf.
    """
    d = solution.coef.shape[1]
    if factor.nonfinite:
        t = solution.coef.shape[0]
        return Diagnostics(np.full(t, np.nan), np.full(t, np.nan), np.full((t, d), np.nan), np.full(t, np.nan))
    f = _triangular(factor, fit_intercept)
    fx, fy = f[:, :d], f[:, d:]
    rss = np.sum((fy - fx @ solution.coef.T) ** 2, axis=0)
    tss = np.sum(fy**2, axis=0)
    r2 = 1 - rss / np.where(tss > 0, tss, 1.0)
    r2 = np.where(tss > 0, r2, np.nan)
    dof = factor.count - int(solution.rank) - int(fit_intercept)
    residual_std = np.sqrt(rss / dof) if dof > 0 else np.full(rss.shape, np.nan)
    coef_stderr = np.full(solution.coef.shape, np.nan)
    intercept_stderr = np.full(rss.shape, np.nan)
    if l2 == 0 and solution.rank == d and dof > 0:
        inverse = _back_substitution(fx[:d], np.eye(d))  # R⁻¹: (XᵀX)⁻¹ = R⁻¹R⁻ᵀ
        coef_stderr = residual_std[:, None] * np.linalg.norm(inverse, axis=1)[None, :]
        if fit_intercept:  # Var = σ² (1/n + x̄ᵀ(XᵀX)⁻¹x̄), X centred
            spread = np.linalg.norm(inverse.T @ factor.mean[:d])
            intercept_stderr = residual_std * np.sqrt(1 / factor.total + spread**2)
    return Diagnostics(r2, residual_std, coef_stderr, intercept_stderr)


def _back_substitution(r: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """Solves ``r x = rhs`` for an upper-triangular ``r`` with a nonzero diagonal."""
    x = np.zeros((r.shape[1], rhs.shape[1]))
    for i in reversed(range(r.shape[0])):
        x[i] = (rhs[i] - r[i, i + 1 :] @ x[i + 1 :]) / r[i, i]
    return x


class Axes(NamedTuple):
    components: np.ndarray       # (d, d), rows, largest variance first
    singular_values: np.ndarray  # (d,) of the centred data


def principal_axes(factor: Factor) -> Axes:
    """The right singular vectors and singular values of the centred data.

    Each component is signed so that its largest-magnitude entry is positive
    (scikit-learn's ``svd_flip`` convention for PCA). NaN for a factor of rows holding NaN or inf.
    """
    if factor.nonfinite:
        d = factor.mean.size
        return Axes(np.full((d, d), np.nan), np.full(d, np.nan))
    check_finite(factor)
    _, s, vt = np.linalg.svd(factor.centred, full_matrices=False)
    d = factor.centred.shape[1]
    if vt.shape[0] < d:  # fewer factor rows than columns: the rest has zero variance
        vt = np.linalg.svd(np.vstack([factor.centred, np.zeros((d - vt.shape[0], d))]))[2]
        s = np.concatenate([s, np.zeros(d - s.size)])
    biggest = np.argmax(np.abs(vt), axis=1)
    vt = vt * np.sign(vt[np.arange(d), biggest])[:, None]
    return Axes(vt, s)


def check_has_rows(factor: Factor, who: str) -> None:
    """Raises :class:`UsageError` when ``factor`` holds no rows: there is nothing to fit."""
    if factor.count == 0:
        raise UsageError(
            f"{who} has no rows to fit: every row was padding or skipped by nan_policy='omit' (a NaN or Inf "
            "in any of its values); check the data, or run with nan_policy='propagate' to see them."
        )
