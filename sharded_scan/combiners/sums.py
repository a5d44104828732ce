"""Additive sums: column sums with a row count, and the Gram matrix XᵀX."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sharded_scan.combiners.base import AdditiveCombiner, accumulator_dtype, masked, row_count
from sharded_scan.errors import UsageError


class SumResult(NamedTuple):
    """Column sums over all rows and the number of rows."""

    sum: np.ndarray
    count: np.ndarray


@dataclasses.dataclass(frozen=True)
class Sum(AdditiveCombiner):
    """Sums every leaf over rows (any row shape) and counts the rows."""

    def init(self, spec):
        sums = jax.tree.map(lambda s: jnp.zeros(s.shape, accumulator_dtype(s.dtype)), spec)
        return SumResult(sums, jnp.zeros((), jnp.int32))

    def add(self, acc, batch, mask):
        sums = jax.tree.map(
            lambda a, x: a + jnp.sum(masked(x, mask).astype(a.dtype), axis=0), acc.sum, batch
        )
        return SumResult(sums, acc.count + row_count(mask))

    def finalize(self, acc):
        return SumResult(acc.sum, np.asarray(acc.count, np.int64))


def check_matrix_spec(spec, who: str) -> None:
    """Raises unless ``spec`` is one array leaf whose rows are vectors ``(d,)``."""
    leaves = jax.tree.leaves(spec)
    if len(leaves) != 1 or not isinstance(spec, jax.ShapeDtypeStruct):
        raise UsageError(f"{who} takes one array of rows, got a pytree of {len(leaves)} leaves.")
    if len(spec.shape) != 1:
        raise UsageError(
            f"{who} needs rows of shape (d,), got rows of shape {spec.shape}; "
            "reshape the data to (rows, features)."
        )


@dataclasses.dataclass(frozen=True)
class Gram(AdditiveCombiner):
    """The Gram matrix XᵀX of rows X (shape (n, d)); the result is the (d, d) array."""

    def check_spec(self, spec):
        super().check_spec(spec)
        check_matrix_spec(spec, "Gram")

    def init(self, spec):
        d = spec.shape[0]
        return jnp.zeros((d, d), accumulator_dtype(spec.dtype))

    def add(self, acc, batch, mask):
        x = masked(batch, mask)
        return acc + jnp.matmul(x.T, x, preferred_element_type=acc.dtype)

    def finalize(self, acc):
        return np.asarray(acc)
