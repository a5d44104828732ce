"""Weighted reductions: any combiner that has a weighted form, on rows ``(w, data)``.

:class:`Weighted` runs ``inner.weighted()`` (:meth:`~sharded_scan.combiners.base.Combiner.weighted`)
and guards its weights: a zero weight is an omitted row (masked like padding), and a
negative or non-finite one is one line, before compute when the data is in memory, else
when the run ends (counted exactly on the way). ``nan_policy="omit"`` skips the rows of non-finite
weights, as pandas' ``skipna`` skips a NaN, in memory as from a file (its ``NonFinite`` checks the
rows it folds only); negative weights are refused under every policy.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sharded_scan.combiners import wide
from sharded_scan.combiners.base import Combiner, row_number
from sharded_scan.combiners.passes import MultiPass, reads_several_times
from sharded_scan.combiners.wrappers.policies import Wrapper
from sharded_scan.dtypes import accumulator_dtype, check_numeric
from sharded_scan.errors import UsageError


class WeightedAcc(NamedTuple):
    """The weighted combiner's accumulator and how many real rows had a negative or non-finite weight."""

    value: Any
    bad_weights: wide.Wide


BAD_WEIGHTS = "weights must be finite and >= 0 (a zero weight omits its row)"


def check_weight_spec(spec: Any, who: str = "Weighted") -> None:
    """Raises unless ``spec`` is a pair whose first item holds one number a row."""
    if not isinstance(spec, (tuple, list)) or len(spec) != 2:
        raise UsageError(f"{who} runs on data (weights, data): a pair whose first item holds one weight a row.")
    w = spec[0]
    if not isinstance(w, jax.ShapeDtypeStruct) or w.shape != ():
        shape = getattr(w, "shape", type(w).__name__)
        raise UsageError(f"{who} weights must be one number a row (shape (rows,)), got rows of {shape}; "
                         "pass a 1-D array of weights.")
    check_numeric(w.dtype, who)


def usable(w: jax.Array) -> jax.Array:
    """Where a weight is finite and >= 0."""
    return (w >= 0) & jnp.isfinite(w) if jnp.issubdtype(w.dtype, jnp.inexact) else w >= 0


def _finite(w: jax.Array) -> jax.Array:
    return jnp.isfinite(w) if jnp.issubdtype(w.dtype, jnp.inexact) else jnp.ones(w.shape, bool)


@dataclasses.dataclass(frozen=True)
class Weighted(Wrapper, MultiPass):
    """``inner`` weighted per row, on rows ``(weights, data)`` (``weights``: ``(rows,)``, >= 0).

    A zero weight is an omitted row. Wrap it in :class:`~sharded_scan.GroupBy` for weighted
    statistics per key: ``GroupBy(Weighted(Sum()), K)`` on ``(keys, (w, X))``.

    Attributes:
      inner: a combiner with a weighted form (:meth:`~sharded_scan.Combiner.weighted`).
    """

    def __post_init__(self):
        if not isinstance(self.inner, Combiner):
            raise UsageError(f"Weighted needs a sharded_scan Combiner, got {type(self.inner).__name__}.")
        self.inner.weighted()  # one line now when the inner combiner takes no weights

    @property
    def form(self) -> Combiner:
        """The inner combiner's weighted form."""
        return self.inner.weighted()

    @property
    def additive(self) -> bool:
        return self.form.additive

    @property
    def data_part(self) -> tuple[int, ...]:
        return (1, *self.inner.data_part)

    def fingerprint(self):
        return {"combiner": "Weighted", "inner": self.inner.fingerprint()}

    def check_spec(self, spec):
        check_weight_spec(spec)
        self.form.check_spec(spec)

    def check_rows(self, rows):
        w = np.asarray(rows[0])
        bad = ~((w >= 0) & np.isfinite(w)) if np.issubdtype(w.dtype, np.inexact) else w < 0
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            raise UsageError(f"{int(bad.sum())} rows have negative or non-finite weights (row {row_number(first)}: "
                             f"{w[first]}); {BAD_WEIGHTS}.")
        self.form.check_rows(rows)

    def operands(self, spec):
        return self.form.operands(self._float_weights(spec))

    def operand_partition(self, mesh):
        return self.form.operand_partition(mesh)

    def partition(self, mesh):
        parts = self.form.partition(mesh)
        return None if parts is None else WeightedAcc(parts, P())

    def convert(self, acc, source):
        return WeightedAcc(self.form.convert(acc.value, source.form), acc.bad_weights)

    def init(self, spec):
        return WeightedAcc(self.form.init(self._float_weights(spec)), wide.zeros())

    def _float_weights(self, data):
        """``data`` with its weights in their float accumulator dtype (a spec, or rows)."""
        w, rest = data
        dtype = accumulator_dtype(w.dtype)
        if isinstance(w, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(w.shape, dtype), rest
        return w.astype(dtype), rest

    def _split(self, batch, mask, keep):
        """``batch`` with float weights, the rows to fold (``keep``, of positive weight), the real
        rows of nonzero weight, and the rows ``keep`` holds with a negative or non-finite weight."""
        ok = usable(batch[0])
        nonzero = batch[0] != 0
        return self._float_weights(batch), keep & ok & nonzero, mask & nonzero, keep & ~ok

    def add(self, acc, batch, mask):
        return self.add_omitting(acc, batch, mask, mask)

    def add_omitting(self, acc, batch, mask, keep):
        """Folds the rows of positive weight where ``keep``; the form sees the real rows of
        nonzero weight as ``mask`` (``Moments`` counts NaNs in those a ``nan_policy`` skips)."""
        batch, kept, seen, bad = self._split(batch, mask, keep)
        return WeightedAcc(self.form.add_omitting(acc.value, batch, seen, kept),
                           wide.count_rows(acc.bad_weights, bad))

    def omitting_values(self):
        """The weighted form of the inner combiner's :meth:`~Combiner.omitting_values` (``Moments``' per
        column, ``Covariance``'s pairwise, ``Quantiles``' per column; ``self``'s rows skipped whole where
        it is the inner combiner itself)."""
        return dataclasses.replace(self, inner=self.inner.omitting_values())

    def add_finite(self, acc, batch, mask, keep):
        """``nan_policy="omit"``: a row of NaN or Inf weight skipped; the form skips the data's values."""
        batch, kept, seen, bad = self._split(batch, mask, keep & _finite(batch[0]))
        return WeightedAcc(self.form.add_finite(acc.value, batch, seen, kept), wide.count_rows(acc.bad_weights, bad))

    def add_keyed_finite(self, acc, batch, mask, keep, keys, num_keys):
        batch, kept, seen, bad = self._split(batch, mask, keep & _finite(batch[0]))
        counts = jax.ops.segment_sum(bad.astype(jnp.int32), keys, num_keys)
        return WeightedAcc(self.form.add_keyed_finite(acc.value, batch, seen, kept, keys, num_keys),
                           wide.add_int32(acc.bad_weights, counts))

    def finite_keep(self, batch, keep):
        return self.form.finite_keep(batch, keep & _finite(batch[0]))

    def add_keyed(self, acc, batch, mask, keys, num_keys):
        return self.add_keyed_omitting(acc, batch, mask, mask, keys, num_keys)

    def add_keyed_omitting(self, acc, batch, mask, keep, keys, num_keys):
        batch, kept, seen, bad = self._split(batch, mask, keep)
        counts = jax.ops.segment_sum(bad.astype(jnp.int32), keys, num_keys)
        return WeightedAcc(self.form.add_keyed_omitting(acc.value, batch, seen, kept, keys, num_keys),
                           wide.add_int32(acc.bad_weights, counts))

    def merge(self, a, b):
        return WeightedAcc(self.form.merge(a.value, b.value), wide.add(a.bad_weights, b.bad_weights))

    @property
    def needs_passes(self) -> bool:
        return reads_several_times(self.form)

    def passes(self):
        """The weighted form's passes (``Quantiles(exact=True)``), each guarded as here."""
        plan = self.form.passes()
        try:
            step = next(plan)
            while True:
                step = plan.send((yield WeightedPass(step)))
        except StopIteration as done:
            return done.value

    def finalize(self, acc):
        bad = int(wide.to_int(acc.bad_weights))
        if bad:
            problem = f"{bad} rows have negative or non-finite weights; {BAD_WEIGHTS}: fix the weights, or pass"
            raise UsageError(f"{problem} nan_policy='omit' to skip rows with NaN or Inf.",
                             cli=f"{problem} --config.nan_policy=omit to skip rows with NaN or Inf.")
        return self.form.finalize(acc.value)


@dataclasses.dataclass(frozen=True)
class WeightedPass(Weighted):
    """One pass of a weighted form that reads the data several times, guarded as :class:`Weighted`:
    ``inner`` is the pass itself, already weighted."""

    def __post_init__(self):
        pass

    @property
    def form(self) -> Combiner:
        return self.inner
