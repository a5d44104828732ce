"""Wrappers that change how any combiner accumulates: compensation and non-finite rows.

- :class:`Compensated` keeps a Kahan compensation term next to every float leaf of an
  additive combiner, so float32 partials do not drift over millions of micro-batches.
- :class:`NonFinite` applies a ``nan_policy`` to rows holding NaN or Inf:
  ``"propagate"`` (numpy's behaviour: they reach the result), ``"omit"`` (such rows are
  masked like padding) or ``"raise"`` (the run stops, naming the first bad step).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sharded_scan.combiners import wide
from sharded_scan.combiners.base import Combiner
from sharded_scan.errors import UsageError

NAN_POLICIES = ("propagate", "omit", "raise")


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


class CompensatedAcc(NamedTuple):
    """An additive accumulator and the Kahan compensation of each float leaf."""

    value: Any
    compensation: Any


class Compensated(Combiner):
    """Kahan-compensated accumulation for an additive combiner.

    Each micro-batch's contribution ``inner.add(0, batch, mask)`` is added with a running
    compensation per float leaf (integer leaves add exactly). Partials merge by leafwise
    addition (``psum``), and ``finalize`` subtracts the compensation in float64 before
    handing the accumulator to the inner combiner.
    """

    additive = True

    def __init__(self, inner: Combiner):
        if not inner.additive:
            raise UsageError(f"{type(inner).__name__} is not additive; compensated accumulation needs an additive one.")
        self.inner = inner

    def check_spec(self, spec):
        self.inner.check_spec(spec)

    def __eq__(self, other):  # equal wrappers share the engine's compiled step
        return type(other) is type(self) and other.inner == self.inner

    def __hash__(self):
        return hash((type(self), self.inner))

    def for_mesh(self, mesh):
        return Compensated(self.inner.for_mesh(mesh))

    def partition(self, mesh):
        parts = self.inner.partition(mesh)
        return None if parts is None else CompensatedAcc(parts, parts)

    def fingerprint(self):
        return {**self.inner.fingerprint(), "compensated": "True"}

    def init(self, spec):
        value = self.inner.init(spec)
        return CompensatedAcc(value, jax.tree.map(jnp.zeros_like, value))

    def add(self, acc, batch, mask):
        delta = self.inner.add(jax.tree.map(jnp.zeros_like, acc.value), batch, mask)

        def kahan(s, c, d):
            if isinstance(s, wide.Wide):  # exact; normalised so the limbs never grow
                return wide.add(s, d), c
            if not _is_float(s):
                return s + d, c
            y = d - c
            t = s + y
            return t, (t - s) - y

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
            c = np.asarray(c, np.float64)
            # Inf or NaN in the data leaves a NaN compensation: keep numpy's sum then.
            return np.where(np.isfinite(c), s.astype(np.float64) - c, s).astype(s.dtype)

        return self.inner.finalize(jax.tree.map(corrected, acc.value, acc.compensation))


class NonFiniteAcc(NamedTuple):
    """The inner accumulator and how many real rows held NaN or Inf."""

    value: Any
    bad_rows: jax.Array


class NonFinite(Combiner):
    """Applies ``policy`` (``"omit"`` or ``"raise"``) to rows with a NaN or Inf in any leaf."""

    def __init__(self, inner: Combiner, policy: str):
        if policy not in ("omit", "raise"):
            raise UsageError(f"nan_policy must be one of {NAN_POLICIES}, got {policy!r}.")
        self.inner = inner
        self.policy = policy
        self.additive = inner.additive

    def check_spec(self, spec):
        self.inner.check_spec(spec)

    def __eq__(self, other):  # equal wrappers share the engine's compiled step
        return type(other) is type(self) and (other.inner, other.policy) == (self.inner, self.policy)

    def __hash__(self):
        return hash((type(self), self.inner, self.policy))

    def for_mesh(self, mesh):
        return NonFinite(self.inner.for_mesh(mesh), self.policy)

    def partition(self, mesh):
        parts = self.inner.partition(mesh)
        return None if parts is None else NonFiniteAcc(parts, P())

    def fingerprint(self):
        return {**self.inner.fingerprint(), "nan_policy": self.policy}

    def init(self, spec):
        return NonFiniteAcc(self.inner.init(spec), jnp.zeros((), jnp.int32))

    def add(self, acc, batch, mask):
        finite = jnp.ones_like(mask)
        for leaf in jax.tree.leaves(batch):
            if _is_float(leaf):
                finite &= jnp.all(jnp.isfinite(leaf).reshape(leaf.shape[0], -1), axis=1)
        bad = jnp.sum(mask & ~finite, dtype=jnp.int32)
        keep = mask & finite if self.policy == "omit" else mask
        return NonFiniteAcc(self.inner.add(acc.value, batch, keep), acc.bad_rows + bad)

    def merge(self, a, b):
        return NonFiniteAcc(self.inner.merge(a.value, b.value), a.bad_rows + b.bad_rows)

    def finalize(self, acc):
        if self.policy == "raise" and int(acc.bad_rows):
            raise NonFiniteError(f"{int(acc.bad_rows)} rows hold NaN or Inf.")
        return self.inner.finalize(acc.value)


class NonFiniteError(UsageError):
    """Rows with NaN or Inf met ``nan_policy="raise"``."""


class NonFiniteWatch:
    """Stops a run at the first step whose rows hold NaN or Inf (``nan_policy="raise"``).

    After each step it starts a tiny device reduction of the bad-row counts and reads
    the previous step's one, which is done by then, so the devices never wait on it.
    """

    def __init__(self, combiner: Combiner):
        self.active = isinstance(combiner, NonFinite) and combiner.policy == "raise"
        self._pending = None

    def after_step(self, partials, first_row: int, num_rows: int) -> None:
        """Records this step's count; raises if the previous step met a bad row."""
        if not self.active:
            return
        self.check()
        self._pending = (jax.numpy.sum(partials.bad_rows), first_row, num_rows)

    def check(self) -> None:
        """Raises :class:`NonFiniteError` naming the step if its count is non-zero."""
        if self._pending is None:
            return
        count, first_row, num_rows = self._pending
        self._pending = None
        if int(count):
            raise NonFiniteError(
                f"rows {first_row}..{first_row + num_rows - 1} (the step starting at row {first_row}) "
                f"hold NaN or Inf; clean the data, or pass nan_policy='omit' to skip such rows."
            )


def apply_policies(combiner: Combiner, *, nan_policy: str = "propagate", compensated: bool = True) -> Combiner:
    """Wraps ``combiner`` for ``nan_policy`` and (if additive) compensated accumulation."""
    if nan_policy not in NAN_POLICIES:
        raise UsageError(f"nan_policy must be one of {', '.join(NAN_POLICIES)}; got {nan_policy!r}.")
    if compensated and combiner.additive:
        combiner = Compensated(combiner)
    if nan_policy != "propagate":
        combiner = NonFinite(combiner, nan_policy)
    return combiner
