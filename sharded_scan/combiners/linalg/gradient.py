"""The gradient of a mean loss over the whole dataset (gradient accumulation)."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sharded_scan.combiners import wide
from sharded_scan.combiners.base import AdditiveCombiner, first_line, masked, rows_spec
from sharded_scan.dtypes import accumulator_dtype, check_numeric
from sharded_scan.errors import UsageError

PyTree = Any


class GradientResult(NamedTuple):
    """Row count, the mean loss, and the gradient of the mean loss (a pytree like ``params``)."""

    count: np.ndarray
    loss: np.ndarray
    grad: PyTree


class GradientAcc(NamedTuple):
    count: wide.Wide     # rows, exact past 2^31
    loss_sum: jax.Array  # ()
    grad_sum: PyTree


def _varying_like(tree: PyTree, ref: jax.Array) -> PyTree:
    """``tree`` marked as varying over the mesh axes ``ref`` varies over (inside shard_map).

    Differentiating with respect to a value replicated over the ``data`` axis would sum
    its cotangent over the devices already; the engine's merge does that once.
    """
    axes = tuple(sorted(jax.typeof(ref).manual_axis_type.varying))
    return jax.tree.map(lambda p: jax.lax.pcast(p, axes, to="varying"), tree) if axes else tree


@dataclasses.dataclass(frozen=True, eq=False)
class Gradient(AdditiveCombiner):
    """``mean_r loss_fn(params, rows)[r]`` over every row, and its gradient in ``params``.

    The devices sum the masked per-row losses and the gradient of that sum; ``finalize``
    divides both by the row count. Padding rows are zeros whose losses are masked out
    with ``jnp.where``: a loss that is NaN or infinite at an all-zero row still gives
    a finite result, but its gradient may not (e.g. ``log(x)`` at 0); guard such losses.

    Args:
      loss_fn: ``loss_fn(params, batch) -> (mb,)`` per-row losses, where ``batch`` is
        shaped like the data with a leading micro-batch dimension ``mb``.
      params: a pytree of float arrays at which the gradient is taken.
    """

    loss_fn: Callable[[PyTree, PyTree], jax.Array]
    params: PyTree

    def _params(self) -> PyTree:
        return jax.tree.map(lambda p: jnp.asarray(p, accumulator_dtype(jnp.asarray(p).dtype)), self.params)

    def _static(self) -> tuple:
        """What the compiled programs depend on: the loss and the params' structure, shapes and dtypes."""
        leaves, treedef = jax.tree.flatten(self.params)
        return (self.loss_fn, treedef, tuple((np.shape(p), jnp.asarray(p).dtype) for p in leaves))

    def __eq__(self, other):  # params are operands: a new value reuses the compiled programs
        return type(other) is type(self) and other._static() == self._static()

    def __hash__(self):
        return hash((type(self), self._static()))

    def operands(self, spec):
        return jax.tree.map(np.asarray, self._params())

    def bind(self, operands):
        return dataclasses.replace(self, params=operands)

    def check_spec(self, spec):
        super().check_spec(spec)
        for p in jax.tree.leaves(self.params):
            if not np.issubdtype(np.asarray(p).dtype, np.floating):
                raise UsageError(f"Gradient needs float params, got a leaf of dtype {np.asarray(p).dtype}.")
        mb = 3
        try:
            out = jax.eval_shape(self.loss_fn, self._params(), rows_spec(spec, mb))
        except Exception as err:  # the user's loss cannot take this data
            first = first_line(err)
            raise UsageError(f"Gradient: loss_fn(params, batch) fails on a batch of {mb} rows: {first}") from err
        if not isinstance(out, jax.ShapeDtypeStruct) or out.shape != (mb,):
            shape = getattr(out, "shape", type(out).__name__)
            raise UsageError(
                f"Gradient: loss_fn must return one loss per row, shape ({mb},) for {mb} rows, got {shape}; "
                "do not average inside loss_fn."
            )
        check_numeric(out.dtype, "Gradient's loss_fn")

    def init(self, spec):
        params = self._params()
        dtype = jnp.result_type(*jax.tree.leaves(params)) if jax.tree.leaves(params) else jnp.float32
        return GradientAcc(wide.zeros(), jnp.zeros((), dtype), jax.tree.map(jnp.zeros_like, params))

    def add(self, acc, batch, mask):
        def total(params):
            losses = self.loss_fn(params, batch)
            return jnp.sum(masked(losses.astype(acc.loss_sum.dtype), mask))

        loss, grad = jax.value_and_grad(total)(_varying_like(self._params(), acc.loss_sum))
        return GradientAcc(
            wide.count_rows(acc.count, mask), acc.loss_sum + loss, jax.tree.map(jnp.add, acc.grad_sum, grad)
        )

    def finalize(self, acc):
        n = int(wide.to_int(acc.count))
        grad = jax.tree.map(lambda g: np.asarray(g, np.float64) / n, acc.grad_sum)
        return GradientResult(np.int64(n), np.float64(acc.loss_sum) / n, grad)

    def fingerprint(self):
        name = getattr(self.loss_fn, "__qualname__", type(self.loss_fn).__name__)
        leaves = [np.asarray(p) for p in jax.tree.leaves(self.params)]
        digest = hashlib.sha256(b"".join(p.tobytes() for p in leaves)).hexdigest()[:16]
        return {"combiner": "Gradient", "loss_fn": name, "params": f"{jax.tree.structure(self.params)}#{digest}"}
