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
_PROBE_ROWS = (3, 5)  # two random batches for the additivity probe


def _random_rows(spec: PyTree, rows: int, rng: np.random.Generator) -> PyTree:
    """``rows`` random rows of ``spec``: normal floats, small integers, random booleans."""

    def one(s):
        shape, dtype = (rows, *s.shape), np.dtype(s.dtype)
        if dtype == np.bool_:
            return rng.random(shape) < 0.5
        if np.issubdtype(dtype, np.integer):
            return rng.integers(0, 4, shape).astype(dtype)
        return rng.standard_normal(shape).astype(dtype)

    return jax.tree.map(one, spec)


def _mismatch(got: PyTree, want: PyTree) -> str | None:
    """Where ``got`` and ``want`` differ beyond float rounding (a phrase), or None."""
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        leaf_dtype = np.asarray(g).dtype
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        scale = max(float(np.max(np.abs(w[np.isfinite(w)]), initial=0.0)), 1.0)
        rtol = 1e-2 if np.dtype(getattr(leaf_dtype, "dtype", leaf_dtype)).itemsize < 4 else 1e-4
        if not np.allclose(g, w, rtol=rtol, atol=rtol * scale, equal_nan=True):
            where = jax.tree_util.keystr(path) or "the carry"
            shown = [np.array2string(np.ravel(v)[:3], precision=4) for v in (g, w)]
            return f"{where}: {shown[0]} vs {shown[1]}"
    return None


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
        self._check_additive(spec)

    def _check_additive(self, spec: PyTree) -> None:
        """Refuses a body that is not additive over rows (a running max, a mean): cheap, before any run.

        ``body(init, a ∪ b)`` must equal ``body(init, a) + body(init, b) - init`` on two
        random batches of the data's row spec.
        """
        rng = np.random.default_rng(0)
        a, b = (_random_rows(spec, n, rng) for n in _PROBE_ROWS)
        both = jax.tree.map(lambda x, y: np.concatenate([x, y]), a, b)
        start, body = self._start(spec), jax.jit(self.body)
        try:
            on_a, on_b, on_both = (jax.device_get(body(start, rows)) for rows in (a, b, both))
        except Exception as err:  # the body cannot run on such rows
            raise UsageError(f"from_fn: body(carry, batch) fails on random rows of {_describe(spec)}: "
                             f"{first_line(err)}") from err
        want = jax.tree.map(lambda x, y, s: np.asarray(x) + np.asarray(y) - np.asarray(s), on_a, on_b, start)
        problem = _mismatch(on_both, want)
        if problem is not None:
            n, m = _PROBE_ROWS
            raise UsageError(
                f"from_fn: body is not additive over rows: body(init, a ∪ b) differs from body(init, a) + "
                f"body(init, b) - init for random batches of {n} and {m} rows ({problem}); from_fn needs "
                "body(c, B) = c + sum over rows of g(row) (like c + b.T @ b); write a sharded_scan.Combiner for a "
                "max, a min or a mean."
            )

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
    A body that is not additive (a max, a running mean) is refused before any run: a
    probe compares ``body(init, a ∪ b)`` with ``body(init, a) + body(init, b) - init`` on
    two random batches of the data's rows; write a :class:`sharded_scan.Combiner` for it.

    Args:
      body: ``body(carry, batch) -> carry``; ``batch`` is shaped like the data with a
        leading micro-batch dimension.
      init: the starting carry (array or pytree), or a callable ``spec -> carry`` where
        ``spec`` is the row spec (``jax.ShapeDtypeStruct`` per leaf, no row dimension).
        It fixes the carry's shape and dtype, and is added once to the result.

    Returns:
      A combiner for :func:`sharded_scan.run`; the result is the final carry (host numpy).
      Before any compute, ``run`` raises :class:`sharded_scan.UsageError` when the body's
      output does not match ``init`` in shape and dtype, the body fails on the data, or
      it is not additive over rows.
    """
    return FnCombiner(body, init)
