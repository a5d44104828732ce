"""``from_fn``: a plain scan body ``(carry, batch) -> carry`` as an additive combiner."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sharded_scan.combiners.base import AdditiveCombiner, first_line, masked, row_count, rows_spec
from sharded_scan.errors import UsageError

PyTree = Any

_CHECK_ROWS = 5  # a micro-batch size for the shape check; 1 would hide (mb, mb)-shaped bugs


def _describe(tree: PyTree) -> str:
    leaves = jax.tree.leaves(tree)
    if len(leaves) == 1:
        return f"{np.dtype(leaves[0].dtype).name}{tuple(leaves[0].shape)}"
    return f"{jax.tree.structure(tree)} of {[f'{np.dtype(x.dtype).name}{tuple(x.shape)}' for x in leaves]}"


class FnCombiner(AdditiveCombiner):
    """The combiner :func:`from_fn` builds; see there."""

    def __init__(self, body: Callable[[PyTree, PyTree], PyTree], init: PyTree | Callable[[PyTree], PyTree]):
        self.body = body
        self.init_value = init

    def _start(self, spec: PyTree) -> PyTree:
        start = self.init_value(spec) if callable(self.init_value) else self.init_value
        return jax.tree.map(jnp.asarray, start)

    def check_spec(self, spec):
        super().check_spec(spec)
        start = jax.eval_shape(lambda: self._start(spec))
        for rows in (1, _CHECK_ROWS):
            try:
                out = jax.eval_shape(self.body, start, rows_spec(spec, rows))
            except Exception as err:  # the body cannot take a batch of this data
                first = first_line(err)
                raise UsageError(
                    f"from_fn: body(carry, batch) fails for carry {_describe(start)} and a batch of {rows} rows "
                    f"of {_describe(spec)}: {first}"
                ) from err
            same = jax.tree.structure(out) == jax.tree.structure(start) and all(
                (o.shape, o.dtype) == (s.shape, s.dtype)
                for o, s in zip(jax.tree.leaves(out), jax.tree.leaves(start), strict=True)
            )
            if not same:
                raise UsageError(
                    f"from_fn: body must return a carry like init, {_describe(start)}, but returned "
                    f"{_describe(out)} for a batch of {rows} rows; make init match what the body returns."
                )
        # init is added once in finalize; cache it (host numpy) for that.
        self._offset = jax.tree.map(np.asarray, jax.device_get(self._start(spec)))

    def init(self, spec):
        return jax.tree.map(jnp.zeros_like, self._start(spec))

    def add(self, acc, batch, mask):
        zero = jax.tree.map(jnp.zeros_like, acc)
        clean = jax.tree.map(lambda x: masked(x, mask), batch)
        one_zero_row = jax.tree.map(lambda x: jnp.zeros((1, *x.shape[1:]), x.dtype), batch)
        padding = mask.shape[0] - row_count(mask)
        at_zero = self.body(zero, one_zero_row)          # body(0, one zero row) - 0 = g(0)
        got = self.body(zero, clean)

        def fold(a, g, g0):
            return a + (g - g0 * padding.astype(g0.dtype))

        return jax.tree.map(fold, acc, got, at_zero)

    def finalize(self, acc):
        offset = getattr(self, "_offset", None)
        if offset is None and not callable(self.init_value):  # check_spec was not called
            offset = jax.tree.map(np.asarray, self.init_value)
        if offset is None:
            raise UsageError("from_fn: call check_spec(spec) before finalize, as sharded_scan.run does.")
        return jax.tree.map(lambda a, o: np.asarray(a) + o, acc, offset)

    def fingerprint(self):
        name = getattr(self.body, "__qualname__", type(self.body).__name__)
        return {"combiner": "from_fn", "body": name}


def from_fn(body: Callable[[PyTree, PyTree], PyTree], init: PyTree | Callable[[PyTree], PyTree]) -> FnCombiner:
    """Turns a seed-style scan body ``(carry, batch) -> carry`` into an additive combiner.

    The body must be additive over rows: ``body(c, B) == c + sum_r g(B[r])`` for some
    per-row ``g`` (e.g. ``c + b.T @ b``, ``c + b.sum(0)``). That is what lets every
    device fold its own rows and the devices sum their carries with one ``psum``, and
    it is how padding is removed: padding rows are zeroed, and each contributes
    ``g(0) = body(0, one zero row)`` (one tiny extra evaluation), which is subtracted.
    A body that is not additive (a max, a running mean) gives wrong results here; write
    a :class:`sharded_scan.Combiner` for it instead.

    Args:
      body: ``body(carry, batch) -> carry``; ``batch`` is shaped like the data with a
        leading micro-batch dimension.
      init: the starting carry (array or pytree), or a callable ``spec -> carry`` where
        ``spec`` is the row spec (``jax.ShapeDtypeStruct`` per leaf, no row dimension).
        It fixes the carry's shape and dtype, and is added once to the result.

    Returns:
      A combiner for :func:`sharded_scan.run`; the result is the final carry (host numpy).
      Before any compute, ``run`` raises :class:`sharded_scan.UsageError` when the body's
      output does not match ``init`` in shape and dtype or the body fails on the data.
    """
    return FnCombiner(body, init)
