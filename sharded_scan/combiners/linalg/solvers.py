"""The accumulators LinearRegression and PCA can run on, by name, each ending in a Factor.

- ``"whitened"`` (the default): a streaming QR kept as a Gram matrix in a whitening
  basis (:mod:`.whitened`): TSQR's accuracy, at the cost of one or two matmuls.
- ``"tsqr"``: Householder TSQR (:mod:`.tsqr`), the R of ``[1 | z - shift]``.
- ``"comoments"``: the centred co-moments ``Σ (z - mean)(z - mean)ᵀ`` of
  :class:`~sharded_scan.combiners.statistics.moments.Covariance` (Chan's merge). Its factor is
  a square root of the co-moments, so it carries their rounding: errors grow with the
  square of the condition number instead of with it. The only solver whose state splits over a
  mesh's ``model`` axis (:class:`SplitsCoMoments`): the co-moments by columns, as Covariance's.

Every solver's state is a :class:`SolverAcc`: the named accumulator and how many real rows
holding NaN or inf it folded (``nan_policy="propagate"`` lets them in; ``"omit"`` and
``"raise"`` never do). Such a row leaves the factor NaN (:func:`~.lstsq.nan_factor`), so the
fit is NaN, never a finite number the re-whitening or a rank decision made of it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sharded_scan.combiners import wide
from sharded_scan.combiners.base import Combiner, masked
from sharded_scan.combiners.column_split import SplitsByColumns
from sharded_scan.combiners.linalg import tsqr, whitened
from sharded_scan.combiners.linalg.lstsq import Factor, nan_factor
from sharded_scan.combiners.statistics import comoments
from sharded_scan.combiners.statistics import moments as statistics
from sharded_scan.errors import UsageError


class Solver(NamedTuple):
    """``init(p, dtype)``, ``add(acc, z, mask)``, ``merge(a, b)`` on devices; ``factor(host acc)``;
    weighted: ``add_weighted(acc, z, mask, w, before)``, ``merge_weighted(a, b, wa, wb)`` (``w``
    per row, 0 where ``mask`` is False; ``before``, ``wa``, ``wb`` the accumulators' ``Σw``)."""

    init: Callable[[int, Any], Any]
    add: Callable
    merge: Callable
    factor: Callable[[Any], Factor]
    add_weighted: Callable
    merge_weighted: Callable


class SolverAcc(NamedTuple):
    """A solver's accumulator (``value``: a ``WhitenedAcc``, ``TSQRAcc`` or ``CenteredAcc``) and the real
    rows holding NaN or inf it folded (exact)."""

    value: Any
    nonfinite: wide.Wide


def _nonfinite_rows(count: wide.Wide, z: jax.Array, mask: jax.Array) -> wide.Wide:
    """``count`` plus the rows of ``z`` where ``mask`` that hold a NaN or an inf."""
    return wide.count_rows(count, mask & ~jnp.all(jnp.isfinite(z), axis=1))


def _counting(solver: Solver) -> Solver:
    """``solver`` on :class:`SolverAcc`: the same accumulator, and the NaN/inf rows it folded counted beside it.

    Counted from the rows, not read off the accumulator: a re-whitening, a deflated direction or
    a ``where`` can turn a NaN there into a zero, and an overflow of finite rows is no NaN row."""

    def factor(acc: SolverAcc) -> Factor:
        bad = int(wide.to_int(acc.nonfinite))
        if bad:  # the factor's numbers are what NaN made of them: none is used
            return nan_factor(int(wide.to_int(acc.value.count)), np.shape(acc.value.shift)[-1], bad)
        return solver.factor(acc.value)

    return Solver(
        lambda p, dtype: SolverAcc(solver.init(p, dtype), wide.zeros()),
        lambda acc, z, mask: SolverAcc(solver.add(acc.value, z, mask), _nonfinite_rows(acc.nonfinite, z, mask)),
        lambda a, b: SolverAcc(solver.merge(a.value, b.value), wide.add(a.nonfinite, b.nonfinite)),
        factor,
        lambda acc, z, mask, w, before: SolverAcc(solver.add_weighted(acc.value, z, mask, w, before),
                                                  _nonfinite_rows(acc.nonfinite, z, mask)),
        lambda a, b, wa, wb: SolverAcc(solver.merge_weighted(a.value, b.value, wa, wb),
                                       wide.add(a.nonfinite, b.nonfinite)),
    )


def _comoments_factor(acc: statistics.CenteredAcc) -> Factor:
    acc = statistics.real_columns(acc)  # without the padding of a split over model
    m2 = statistics.host_m2(acc)
    scale = np.sqrt(np.maximum(np.diag(m2), 0.0))
    scale = np.where(scale > 0, scale, 1.0)
    values, vectors = np.linalg.eigh((m2 + m2.T) / 2 / np.outer(scale, scale))  # correlations: column-scale free
    root = (np.sqrt(np.maximum(values, 0.0))[:, None] * vectors.T) * scale
    eps = np.finfo(np.asarray(acc.m2).dtype).eps
    return Factor(int(wide.to_int(acc.count)), statistics.host_mean(acc), root, noise=np.sqrt(eps * max(len(m2), 10)))


@functools.cache
def _whitened(targets: int) -> Solver:
    # Jitted (once per `targets`): a direct call compiles one program instead of running
    # the loops op by op; inside the engine's step it is inlined like any function.
    merge = jax.jit(functools.partial(whitened.merge, targets=targets))
    return Solver(
        whitened.init,
        jax.jit(functools.partial(whitened.add, targets=targets)),
        merge,
        whitened.factor,
        jax.jit(lambda acc, z, mask, w, before: whitened.add(acc, z, mask, targets, w)),
        lambda a, b, wa, wb: merge(a, b),  # the √w-scaled rows carry their weights
    )


def _tsqr(targets: int) -> Solver:
    del targets
    return Solver(tsqr.init, tsqr.add, tsqr.merge, tsqr.factor,
                  lambda acc, z, mask, w, before: tsqr.add(acc, z, mask, w), lambda a, b, wa, wb: tsqr.merge(a, b))


def _comoments(targets: int, shards: int = 1) -> Solver:
    """``shards``: the co-moments split by columns over that many ``model`` devices."""
    del targets
    return Solver(
        lambda p, dtype: statistics.centered_init(p, dtype, full=True, shards=shards),
        lambda acc, z, mask: statistics.centered_fold(acc, z, mask, full=True, shards=shards),
        lambda a, b: statistics.centered_merge(a, b, full=True, shards=shards),
        _comoments_factor,
        lambda acc, z, mask, w, before: statistics.centered_fold(acc, z, mask, full=True, weights=w, before=before,
                                                                 shards=shards),
        lambda a, b, wa, wb: statistics.merged(a, b, wa, wb, full=True, shards=shards)[0],
    )


# name -> (the number of target columns at the end of z -> Solver)
SOLVERS: dict[str, Callable[[int], Solver]] = {"whitened": _whitened, "tsqr": _tsqr, "comoments": _comoments}
DEFAULT_SOLVER = "whitened"


def check_solver(who: str, solver: str) -> None:
    """Raises :class:`UsageError` unless ``solver`` names one of :data:`SOLVERS`."""
    if solver not in SOLVERS:
        raise UsageError(f"{who} solver must be one of {', '.join(map(repr, SOLVERS))}; got {solver!r}.")


class SplitsCoMoments(SplitsByColumns):
    """Mixin of ``LinearRegression`` and ``PCA`` (dataclasses with ``solver`` and ``model_shards``):
    with ``solver="comoments"`` :meth:`for_mesh` sets ``model_shards`` to the mesh's ``model`` size and
    the co-moments split by columns over it, as :class:`~.comoments.Covariance`'s (the means whole on
    every device); the other solvers' states stay whole. :meth:`partition` and :meth:`convert` are
    those of an accumulator that is the co-moments (``LinearRegression`` wraps them)."""

    def for_mesh(self, mesh):
        return super().for_mesh(mesh) if self.solver == "comoments" else self

    def solver_for(self, targets: int) -> Solver:
        """The solver of ``targets`` target columns, split over ``model_shards`` devices."""
        make = SOLVERS[self.solver]
        return _counting(make(targets, self.model_shards) if self.model_shards > 1 else make(targets))

    def partition(self, mesh):
        parts = comoments.split_partition(self.model_shards)
        return None if parts is None else SolverAcc(parts, P())

    def convert(self, acc, source):
        """Between whole co-moments and ones split over ``model`` (a resume on a mesh with other axes)."""
        if self.solver != "comoments":
            return super().convert(acc, source)
        return acc._replace(value=comoments.laid_out(acc.value, self.model_shards))


@dataclasses.dataclass(frozen=True)
class WeightedFactored(statistics.WeightSums):
    """The weighted form of ``LinearRegression`` and ``PCA``, on rows ``(w, data)``: the solver's
    factor of ``Σ w (z - mean)(z - mean)ᵀ`` about the weighted mean (rows scaled by ``√w``
    after centring; the co-moments merged with ``Σw`` for counts), and ``Σw``, ``Σw²``.

    ``unweighted`` gives ``add_weighted(acc, data, mask, w, before)``, ``merge_weighted(a, b,
    wa, wb)`` and ``result(acc, weight, weight_sq)``. ``Weighted`` hands it rows of ``w > 0``
    only: a zero weight is an omitted row, so the factor's ``count`` is the rows of positive weight.
    """

    unweighted: Combiner

    def add(self, acc, batch, mask):
        w, data = batch
        w = masked(w, mask).astype(acc.weights.dtype)
        value = self.unweighted.add_weighted(acc.value, data, mask, w, acc.weights[0] - acc.lost[0])
        return statistics.WeightedCentredAcc(value, *statistics.kahan_add(acc.weights, acc.lost,
                                                                          jnp.stack([jnp.sum(w), jnp.sum(w * w)])))

    def merge(self, a, b):
        wa, wb = a.weights[0] - a.lost[0], b.weights[0] - b.lost[0]
        return statistics.WeightedCentredAcc(self.unweighted.merge_weighted(a.value, b.value, wa, wb),
                                             a.weights + b.weights, a.lost + b.lost)
