"""Wrappers that change how any combiner accumulates: compensation and non-finite rows.

- :class:`Compensated` keeps a Kahan compensation term next to every float leaf of an
  additive combiner, so float32 partials do not drift over millions of micro-batches.
- :class:`NonFinite` applies a ``nan_policy`` to NaN and Inf values:
  ``"propagate"`` (numpy's behaviour: they reach the result), ``"omit"`` (each such value is
  skipped where it stands, as pandas' ``skipna``: per column, per pair of columns for ``Covariance``
  and ``Correlation``, the whole row for the statistics of whole rows; :meth:`Combiner.add_finite`),
  ``"omit_rows"`` (every row holding one is masked like padding, in every statistic) or ``"raise"``
  (the run stops, naming the first bad step).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sharded_scan.combiners import wide
from sharded_scan.combiners.base import Combiner, checking_rows, finite_rows
from sharded_scan.errors import UsageError


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


@dataclasses.dataclass(frozen=True)
class Wrapper(Combiner):
    """A combiner that changes how ``inner`` accumulates; its accumulator holds the inner one.

    A frozen dataclass: equality and hashing (what shares the engine's compiled programs)
    cover ``inner`` and the subclass's own fields, and :meth:`rewrap` rebuilds it around
    another inner combiner. The user's hooks reach the inner combiner through here.
    """

    inner: Combiner

    @property
    def additive(self) -> bool:
        return self.inner.additive

    @property
    def data_part(self) -> tuple[int, ...]:
        return self.inner.data_part

    @property
    def one_scan_per_step(self) -> bool:
        return self.inner.one_scan_per_step

    @property
    def microbatch_values(self) -> int:
        return self.inner.microbatch_values

    def rewrap(self, inner: Combiner) -> Wrapper:
        """The same wrapper around ``inner``."""
        return dataclasses.replace(self, inner=inner)

    def check_spec(self, spec):
        self.inner.check_spec(spec)

    def check_rows(self, rows):
        self.inner.check_rows(rows)

    def for_mesh(self, mesh):
        return self.rewrap(self.inner.for_mesh(mesh))

    def operands(self, spec):
        return self.inner.operands(spec)

    def bind(self, operands):
        return self.rewrap(self.inner.bind(operands))

    def finite_keep(self, batch, keep):
        return self.inner.finite_keep(batch, keep)

    def operand_partition(self, mesh):
        return self.inner.operand_partition(mesh)


# Host rows go through ``finite_keep`` in blocks of at most this many, the last padded to a power of two.
FINITE_KEEP_BLOCK = 1 << 16


@functools.lru_cache(maxsize=32)
def _finite_keep_program(combiner: Combiner):
    return jax.jit(combiner.finite_keep)


def host_finite_keep(combiner: Combiner, rows: Any) -> np.ndarray:
    """``combiner.finite_keep`` of every row of ``rows`` (host arrays) as a numpy bool array, in one compiled
    program per power of two of rows (at least 64), not one per op and row count as eager ops compile: a
    check of in-memory data then shares its programs across row counts. Padding rows (zeros) are dropped."""
    leaves, tree = jax.tree.flatten(rows)
    leaves = [np.asarray(leaf) for leaf in leaves]
    try:
        program = _finite_keep_program(combiner)
    except TypeError:  # an unhashable user combiner
        program = jax.jit(combiner.finite_keep)
    n, out = leaves[0].shape[0], []
    for start in range(0, n, FINITE_KEEP_BLOCK):
        block = [leaf[start:start + FINITE_KEEP_BLOCK] for leaf in leaves]
        size = len(block[0])
        padded = max(64, 1 << (size - 1).bit_length())
        block = [np.concatenate([b, np.zeros((padded - size, *b.shape[1:]), b.dtype)]) for b in block]
        keep = np.arange(padded) < size
        out.append(np.asarray(program(jax.tree.unflatten(tree, block), keep))[:size])
    return np.concatenate(out)


def innermost(combiner: Combiner) -> Combiner:
    """The user's combiner inside the policies' wrappers."""
    while isinstance(combiner, Wrapper):
        combiner = combiner.inner
    return combiner


def kahan_add(total, lost, more):
    """``total + more`` with its Kahan compensation ``lost`` (``total - lost`` is the running sum, :func:`kahan_total`).

    A compensation that is not finite is left out: it is inf or NaN only once the sum reached an
    infinity (an infinite value, or finite ones whose sum overflowed: ``inf - total``), and the sum
    then goes on alone, as numpy's, so that it stays infinite and never turns NaN from ``inf - inf``.
    """
    y = more - jnp.where(jnp.isfinite(lost), lost, 0)
    new = total + y
    return new, (new - total) - y


def kahan_total(total, lost, xp=np):
    """The compensated sum of :func:`kahan_add`'s ``total`` and ``lost`` (``xp``: numpy on the host, in float64;
    ``jax.numpy`` on the devices): ``total`` alone where ``lost`` is not finite (the sum reached an infinity)."""
    return total - xp.where(xp.isfinite(lost), lost, 0)  # total - 0 is total exactly, -0.0 and NaN too


class CompensatedAcc(NamedTuple):
    """An additive accumulator and the Kahan compensation of each float leaf."""

    value: Any
    compensation: Any


@dataclasses.dataclass(frozen=True)
class Compensated(Wrapper):
    """Kahan-compensated accumulation for an additive combiner.

    Each micro-batch's contribution ``inner.add(0, batch, mask)`` is added with a running
    compensation per float leaf (integer leaves add exactly). Partials merge by leafwise
    addition (``psum``), and ``finalize`` subtracts the compensation in float64 before
    handing the accumulator to the inner combiner.
    """

    def __post_init__(self):
        if not self.inner.additive:
            raise UsageError(
                f"{type(self.inner).__name__} is not additive; compensated accumulation needs an additive one."
            )

    def fingerprint(self):
        return {**self.inner.fingerprint(), "compensated": "True"}

    def partition(self, mesh):
        parts = self.inner.partition(mesh)
        return None if parts is None else CompensatedAcc(parts, parts)

    def convert(self, acc, source):
        return CompensatedAcc(
            self.inner.convert(acc.value, source.inner), self.inner.convert(acc.compensation, source.inner)
        )

    def init(self, spec):
        value = self.inner.init(spec)
        return CompensatedAcc(value, jax.tree.map(jnp.zeros_like, value))

    def add(self, acc, batch, mask):
        return self._added(acc, self.inner.add(jax.tree.map(jnp.zeros_like, acc.value), batch, mask))

    def add_finite(self, acc, batch, mask, keep):
        return self._added(acc, self.inner.add_finite(jax.tree.map(jnp.zeros_like, acc.value), batch, mask, keep))

    def _added(self, acc, delta):
        """``acc`` plus a micro-batch's contribution ``delta``, compensated."""

        def kahan(s, c, d):
            if isinstance(s, wide.Wide):  # exact; normalised so the limbs never grow
                return wide.add(s, d), c
            if not _is_float(s):
                return s + d, c
            return kahan_add(s, c, d)

        pairs = jax.tree.map(kahan, acc.value, acc.compensation, delta, is_leaf=wide.is_wide)
        value = jax.tree.map(lambda s, p: p[0], acc.value, pairs, is_leaf=wide.is_wide)
        compensation = jax.tree.map(lambda s, p: p[1], acc.value, pairs, is_leaf=wide.is_wide)
        return CompensatedAcc(value, compensation)

    def merge(self, a, b):
        return jax.tree.map(jnp.add, a, b)

    def finalize(self, acc):
        def corrected(s, c):
            s = np.asarray(s)
            if not np.issubdtype(s.dtype, np.floating):
                return s
            return kahan_total(s.astype(np.float64), np.asarray(c, np.float64)).astype(s.dtype)

        return self.inner.finalize(jax.tree.map(corrected, acc.value, acc.compensation))


class NonFiniteAcc(NamedTuple):
    """The inner accumulator and how many real rows held NaN or Inf (exact: :class:`wide.Wide`)."""

    value: Any
    bad_rows: wide.Wide


@dataclasses.dataclass(frozen=True)
class NonFinite(Wrapper):
    """Applies ``policy`` (``"omit"``, ``"omit_rows"`` or ``"raise"``) to NaN and Inf values.

    ``"omit"`` folds by the inner combiner's :meth:`~Combiner.add_finite` (each value skipped where it
    stands; whole rows for the statistics of whole rows), ``"omit_rows"`` by its ``add_omitting`` of the
    rows whose every value is finite.

    The count of such rows lives in the accumulator. With ``"raise"`` the engine reads
    it after every step (:meth:`health`, one step late so the devices never wait) and
    the run stops at the first step that met one, naming its rows; ``finalize`` checks
    the total too.
    """

    policy: str

    def fingerprint(self):
        return {**self.inner.fingerprint(), "nan_policy": self.policy}

    def partition(self, mesh):
        parts = self.inner.partition(mesh)
        return None if parts is None else NonFiniteAcc(parts, P())

    def convert(self, acc, source):
        return NonFiniteAcc(self.inner.convert(acc.value, source.inner), acc.bad_rows)

    def init(self, spec):
        return NonFiniteAcc(self.inner.init(spec), wide.zeros())

    def check_rows(self, rows):
        """The inner combiner's checks of the rows it will fold: under ``"omit_rows"`` only the finite ones,
        under ``"omit"`` those it folds at all (:meth:`~Combiner.finite_keep`: a row holding NaN is checked
        where its other values are folded); a NaN weight of ``Weighted`` is skipped in memory as from a file,
        not refused. An inner combiner that checks no rows (``Combiner.check_rows`` itself, as ``Moments``')
        costs no pass over them."""
        numbers = None  # the rows checked as the data's rows, for the row a message names
        if self.policy in OMITTING and type(self.inner).check_rows is not Combiner.check_rows:
            keep = finite_rows(jax.tree.map(np.asarray, rows), np)  # as add's rows: every float value finite
            if self.policy == "omit" and not keep.all():
                keep = host_finite_keep(self.inner, rows)
            rows, numbers = jax.tree.map(lambda leaf: np.asarray(leaf)[keep], rows), np.flatnonzero(keep)
        with checking_rows(numbers):
            self.inner.check_rows(rows)

    def add(self, acc, batch, mask):
        finite = finite_rows(batch)
        if self.policy == "omit":
            value = self.inner.add_finite(acc.value, batch, mask, mask)
        elif self.policy == "omit_rows":
            value = self.inner.add_omitting(acc.value, batch, mask, mask & finite)
        else:
            value = self.inner.add(acc.value, batch, mask)
        return NonFiniteAcc(value, wide.count_rows(acc.bad_rows, mask & ~finite))

    def merge(self, a, b):
        return NonFiniteAcc(self.inner.merge(a.value, b.value), wide.add(a.bad_rows, b.bad_rows))

    def merge_collectives(self):
        inner = self.inner.merge_collectives()
        return None if inner is None else NonFiniteAcc(inner, "sum_exact")

    def health(self, partials) -> jax.Array:
        """How many rows of the shards' ``partials`` held NaN or Inf (a device value)."""
        return jnp.sum(wide.to_float(partials.bad_rows))

    def check_health(self, value, first_row: int, num_rows: int) -> None:
        """Raises :class:`NonFiniteError` when :meth:`health` (read back) for rows
        ``[first_row, first_row + num_rows)`` counted any."""
        if float(value):  # the first step with any: all of them are in it
            raise NonFiniteError(
                f"{round(float(value))} rows of rows {first_row}..{first_row + num_rows - 1} (the step starting at "
                f"row {first_row}) hold NaN or Inf; clean the data, or pass nan_policy='omit' to skip such rows."
            )

    def finalize(self, acc):
        bad = int(wide.to_int(acc.bad_rows))
        if self.policy == "raise" and bad:
            raise NonFiniteError(f"{bad} rows hold NaN or Inf.")
        return self.inner.finalize(acc.value)


OMITTING = ("omit", "omit_rows")  # the policies that skip NaN and Inf


class NonFiniteError(UsageError):
    """Rows with NaN or Inf met ``nan_policy="raise"``."""


def step_guard(combiner: Combiner) -> NonFinite | None:
    """The policy the engine checks after every step (``nan_policy="raise"``), or None."""
    return combiner if isinstance(combiner, NonFinite) and combiner.policy == "raise" else None


def apply_policies(combiner: Combiner, *, nan_policy: str = "propagate", compensated: bool = True) -> Combiner:
    """Wraps ``combiner`` for ``nan_policy`` and (if additive) compensated accumulation; the
    options as :class:`~sharded_scan.options.RunOptions` checked them. Under ``"omit"`` the combiner is the
    one that skips values where they stand (:meth:`~Combiner.omitting_values`)."""
    if nan_policy == "omit":
        combiner = combiner.omitting_values()
    if compensated and combiner.additive:
        combiner = Compensated(combiner)
    if nan_policy != "propagate":
        combiner = NonFinite(combiner, nan_policy)
    return combiner
