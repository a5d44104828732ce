"""Stable second-order statistics: covariance, per-column moments, principal components.

Each device keeps ``(count, shift, mean, M2)``: ``mean`` is measured from ``shift``, a
value taken from the first rows the accumulator saw, so that float32 keeps the digits
of the data's spread even when its mean is large (e.g. 1e4 + N(0, 1)). A micro-batch is
centred on its own masked mean and combined with Chan's pairwise formula; partials are
merged the same way. Nothing subtracts a square of sums from a sum of squares.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sharded_scan.combiners.base import Combiner, accumulator_dtype, masked, row_count
from sharded_scan.combiners.sums import check_matrix_spec
from sharded_scan.errors import UsageError


class CenteredAcc(NamedTuple):
    """Rows seen, the reference point, the mean measured from it, and the centred M2."""

    count: jax.Array  # int32 ()
    shift: jax.Array  # (d,)
    mean: jax.Array   # (d,) mean - shift
    m2: jax.Array     # (d, d) sum of outer products of centred rows, or (d,) of squares


def centered_init(d: int, dtype, full: bool) -> CenteredAcc:
    """The identity: no rows."""
    zeros = jnp.zeros((d,), dtype)
    return CenteredAcc(jnp.zeros((), jnp.int32), zeros, zeros, jnp.zeros((d, d) if full else (d,), dtype))


def _scatter(a: jax.Array, b: jax.Array, full: bool) -> jax.Array:
    return jnp.outer(a, b) if full else a * b


def centered_merge(a: CenteredAcc, b: CenteredAcc, full: bool) -> CenteredAcc:
    """Chan's pairwise combination; exact identity when either side has no rows."""
    n = a.count + b.count
    a_empty, b_empty = a.count == 0, b.count == 0
    shift = jnp.where(a_empty, b.shift, a.shift)
    mean_a = a.mean + (a.shift - shift)   # the shifts are close, so their difference is exact
    mean_b = b.mean + (b.shift - shift)
    delta = mean_b - mean_a
    na, nb = a.count.astype(delta.dtype), b.count.astype(delta.dtype)
    nf = jnp.maximum(n, 1).astype(delta.dtype)
    mean = jnp.where(a_empty, mean_b, jnp.where(b_empty, mean_a, mean_a + delta * (nb / nf)))
    m2 = a.m2 + b.m2 + _scatter(delta, delta, full) * (na * (nb / nf))
    return CenteredAcc(n, shift, mean, m2)


def centered_batch(x: jax.Array, mask: jax.Array, dtype, full: bool) -> CenteredAcc:
    """One micro-batch's accumulator, centred on its own masked mean."""
    x = x.astype(dtype)
    count = row_count(mask)
    nf = jnp.maximum(count, 1).astype(dtype)
    shift = jnp.sum(masked(x, mask), axis=0) / nf          # rough mean: the reference point
    centred = masked(x - shift, mask)
    mean = jnp.sum(centred, axis=0) / nf                     # small and precise
    dev = masked(centred - mean, mask)
    m2 = jnp.matmul(dev.T, dev, preferred_element_type=dtype) if full else jnp.sum(dev * dev, axis=0)
    return CenteredAcc(count, shift, mean, m2)


def host_mean(acc: CenteredAcc) -> np.ndarray:
    """The mean in float64 on the host."""
    return np.asarray(acc.shift, np.float64) + np.asarray(acc.mean, np.float64)


def _divide(m2: np.ndarray, dof: float) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray(m2, np.float64) / (dof if dof > 0 else 0.0)


class CovarianceResult(NamedTuple):
    """Row count, column means and the (d, d) covariance, like ``np.cov(x, rowvar=False)``."""

    count: np.ndarray
    mean: np.ndarray
    cov: np.ndarray


@dataclasses.dataclass(frozen=True)
class Covariance(Combiner):
    """The covariance matrix of rows X (n, d), stable for data far from zero.

    Args:
      ddof: delta degrees of freedom; the divisor is ``count - ddof`` (1 like ``np.cov``).
    """

    ddof: int = 1

    def check_spec(self, spec):
        super().check_spec(spec)
        check_matrix_spec(spec, type(self).__name__)

    def init(self, spec):
        return centered_init(spec.shape[0], accumulator_dtype(spec.dtype), full=True)

    def add(self, acc, batch, mask):
        return centered_merge(acc, centered_batch(batch, mask, acc.m2.dtype, full=True), full=True)

    def merge(self, a, b):
        return centered_merge(a, b, full=True)

    def finalize(self, acc):
        count = int(acc.count)
        return CovarianceResult(np.int64(count), host_mean(acc), _divide(acc.m2, count - self.ddof))


class MomentsResult(NamedTuple):
    """Per column: row count, mean, variance (``np.var`` with ``ddof``), min and max."""

    count: np.ndarray
    mean: np.ndarray
    var: np.ndarray
    min: np.ndarray
    max: np.ndarray


class MomentsAcc(NamedTuple):
    centered: CenteredAcc
    min: jax.Array
    max: jax.Array


@dataclasses.dataclass(frozen=True)
class Moments(Combiner):
    """Per-column count, mean, variance, min and max of rows X (n, d).

    Args:
      ddof: delta degrees of freedom of the variance (0 like ``np.var``).
    """

    ddof: int = 0

    def check_spec(self, spec):
        super().check_spec(spec)
        check_matrix_spec(spec, type(self).__name__)

    def init(self, spec):
        d, dtype = spec.shape[0], accumulator_dtype(spec.dtype)
        return MomentsAcc(
            centered_init(d, dtype, full=False), jnp.full((d,), jnp.inf, dtype), jnp.full((d,), -jnp.inf, dtype)
        )

    def add(self, acc, batch, mask):
        x = batch.astype(acc.min.dtype)
        part = MomentsAcc(
            centered_batch(x, mask, acc.min.dtype, full=False),
            jnp.min(masked(x, mask, jnp.inf), axis=0),
            jnp.max(masked(x, mask, -jnp.inf), axis=0),
        )
        return self.merge(acc, part)

    def merge(self, a, b):
        return MomentsAcc(
            centered_merge(a.centered, b.centered, full=False), jnp.minimum(a.min, b.min), jnp.maximum(a.max, b.max)
        )

    def finalize(self, acc):
        count = int(acc.centered.count)
        return MomentsResult(
            np.int64(count),
            host_mean(acc.centered),
            _divide(acc.centered.m2, count - self.ddof),
            np.asarray(acc.min),
            np.asarray(acc.max),
        )


class PCAResult(NamedTuple):
    """The top ``k`` principal axes (rows), their variances and ratios, and the mean."""

    components: np.ndarray
    explained_variance: np.ndarray
    explained_variance_ratio: np.ndarray
    mean: np.ndarray


@dataclasses.dataclass(frozen=True)
class PCA(Combiner):
    """Principal component analysis from the stable covariance, like ``sklearn.decomposition.PCA``.

    The covariance (divisor ``n - 1``) is accumulated on the devices; its symmetric
    eigen-decomposition runs in float64 on the host. Components are rows, sorted by
    decreasing variance, each signed so that its largest-magnitude entry is positive
    (scikit-learn's ``svd_flip`` convention).

    Args:
      k: the number of components, ``1 <= k <= d``.
    """

    k: int

    @property
    def _cov(self) -> Covariance:
        return Covariance(ddof=1)

    def check_spec(self, spec):
        self._cov.check_spec(spec)
        d = spec.shape[0]
        k = self.k
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= d:
            raise UsageError(f"PCA needs 1 <= k <= d = {d} (the number of columns), got k={k!r}.")

    def init(self, spec):
        return self._cov.init(spec)

    def add(self, acc, batch, mask):
        return self._cov.add(acc, batch, mask)

    def merge(self, a, b):
        return self._cov.merge(a, b)

    def finalize(self, acc):
        cov = self._cov.finalize(acc)
        values, vectors = np.linalg.eigh(cov.cov)
        order = np.argsort(values)[::-1][: self.k]
        components = vectors[:, order].T
        biggest = np.argmax(np.abs(components), axis=1)
        components *= np.sign(components[np.arange(self.k), biggest])[:, None]
        variance = np.maximum(values[order], 0.0)
        total = float(np.trace(cov.cov))
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = variance / total
        return PCAResult(components, variance, ratio, cov.mean)
