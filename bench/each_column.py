"""A per-column combiner run on each column alone, so that each column skips its own NaN and Inf: the route
``nan_policy="omit"`` took for ``Moments``, ``TopK`` and ``DistinctCount`` before they folded with a mask per column,
kept here as the reference ``bench/omit_agreement.py`` compares them with (no built-in runs it).

``nan_policy="omit"`` skips a NaN or Inf where it stands, as pandas' ``skipna``: a column's count is its
own count of finite values, and a NaN in one column hides none of the row's other values. A combiner
whose statistics are per column but whose state counts the rows once for every column (``Moments``)
runs so as :class:`EachColumn`: one one-column state per column, stacked, folded and merged by
``jax.vmap`` over the columns with each column's own mask of finite values, as ``Describe`` folds its
moments; ``finalize`` finishes each column and joins them into one result of the inner combiner's type
(each field's column axis first: a count per column). Under ``GroupBy`` the key axis comes first
(``(num_keys, d, ...)``); under ``Weighted`` each column keeps its own ``Σw`` (the weights of its rows).

Over a ``model`` axis the stacked state is whole on every device (each folds every column).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sharded_scan.combiners.base import finite_rows
from sharded_scan.combiners.wrappers.policies import Wrapper


def part(tree: Any, path: tuple[int, ...]) -> Any:
    """The item of ``tree`` at ``path`` (indices into nested tuples)."""
    for i in path:
        tree = tree[i]
    return tree


def with_part(tree: Any, path: tuple[int, ...], new: Any) -> Any:
    """``tree`` with its item at ``path`` replaced by ``new``."""
    if not path:
        return new
    items = list(tree)
    items[path[0]] = with_part(tree[path[0]], path[1:], new)
    return type(tree)(items)


def joined(results: list, one_value: bool = False) -> Any:
    """One result of per-column ``results``: each field's values joined along its first axis (a scalar
    field, such as ``count``, becomes one value a column; ``one_value``: rows of one value, the one
    column's result as it is); ``columns`` (None) stays."""
    first = results[0]
    if one_value:
        return jax.tree.map(lambda x: np.asarray(x)[0] if np.ndim(x) else x, first)
    if hasattr(first, "_fields"):
        return type(first)(*[v if v is None else joined([r[i] for r in results])
                             for i, v in enumerate(first)])
    return np.concatenate([np.atleast_1d(np.asarray(r)) for r in results])


@functools.lru_cache(maxsize=32)
def _column_state_ndim(inner: Any) -> int:
    """The axes of the first leaf of ``inner``'s state of one column (traced once per combiner)."""
    return np.ndim(jax.tree.leaves(jax.eval_shape(inner.init, jax.ShapeDtypeStruct((1,), jnp.float32)))[0])


class EachColumnAcc(NamedTuple):
    """The inner combiner's one-column states stacked (the columns first; under ``GroupBy`` after the
    keys), and int8 zeros shaped like a row of the data (``()``: rows of one value, one column)."""

    value: Any
    row: jax.Array


@dataclasses.dataclass(frozen=True)
class EachColumn(Wrapper):
    """``inner`` (a combiner of per-column statistics of rows ``(n, d)``, at ``inner.data_part``) run on
    each column alone, each column skipping its own NaN and Inf under ``nan_policy="omit"``
    (:meth:`add_finite`); its result is ``inner``'s, a value a column in every field.

    Attributes:
      data_path: where the data is in a row (None: ``inner.data_part``; ``(1,)`` for a weighted form's
        rows ``(w, X)``).
    """

    data_path: tuple[int, ...] | None = None

    @property
    def path(self) -> tuple[int, ...]:
        return self.inner.data_part if self.data_path is None else self.data_path

    def fingerprint(self):
        return {"combiner": "EachColumn", "inner": self.inner.fingerprint(), "data_path": repr(self.data_path)}

    def for_mesh(self, mesh):
        return self  # one-column states, whole on every device

    def weighted(self):
        return EachColumn(self.inner.weighted(), (1, *self.path))

    def init(self, spec):
        data = part(spec, self.path)
        d = data.shape[0] if data.shape else 1
        one = self.inner.init(with_part(spec, self.path, jax.ShapeDtypeStruct((1,), data.dtype)))
        return EachColumnAcc(jax.tree.map(lambda x: jnp.broadcast_to(x, (d, *x.shape)), one),
                             jnp.zeros(data.shape, jnp.int8))

    def finite_keep(self, batch, keep):
        """The rows of ``keep`` whose values outside the data (a ``Weighted`` form's weights) are finite."""
        path = self.path
        return keep & finite_rows(with_part(batch, path, None)) if path else keep

    def _fold(self, acc, batch, mask, cells, keyed=None):
        """Each column of ``batch`` folded into its state, its rows ``cells[:, j]`` (``keyed``: ``(keys,
        num_keys)``, the state's key axis first)."""
        path = self.path
        x = part(batch, path).reshape(cells.shape)

        def column(a, values, keep):
            rows = with_part(batch, path, values[:, None])
            if keyed is None:
                return self.inner.add_omitting(a, rows, mask, keep)
            return self.inner.add_keyed_omitting(a, rows, mask, keep, *keyed)

        axis = 0 if keyed is None else 1
        return acc._replace(value=jax.vmap(column, in_axes=(axis, 1, 1), out_axes=axis)(acc.value, x, cells))

    def _cells(self, batch, keep, finite: bool):
        x = part(batch, self.path)
        x = x.reshape(x.shape[0], -1)
        cells = jnp.broadcast_to(keep[:, None], x.shape)
        return cells & jnp.isfinite(x) if finite and jnp.issubdtype(x.dtype, jnp.inexact) else cells

    def add(self, acc, batch, mask):
        return self.add_omitting(acc, batch, mask, mask)

    def add_omitting(self, acc, batch, mask, keep):
        return self._fold(acc, batch, mask, self._cells(batch, keep, False))

    def add_finite(self, acc, batch, mask, keep):
        return self._fold(acc, batch, mask, self._cells(batch, self.finite_keep(batch, keep), True))

    def add_keyed(self, acc, batch, mask, keys, num_keys):
        return self.add_keyed_omitting(acc, batch, mask, mask, keys, num_keys)

    def add_keyed_omitting(self, acc, batch, mask, keep, keys, num_keys):
        return self._fold(acc, batch, mask, self._cells(batch, keep, False), (keys, num_keys))

    def add_keyed_finite(self, acc, batch, mask, keep, keys, num_keys):
        cells = self._cells(batch, self.finite_keep(batch, keep), True)
        return self._fold(acc, batch, mask, cells, (keys, num_keys))

    def merge(self, a, b):
        return a._replace(value=jax.vmap(self.inner.merge)(a.value, b.value))

    def merge_collectives(self):
        inner = self.inner.merge_collectives()
        return None if inner is None else EachColumnAcc(inner, "max")

    @property
    def finalizes_stacked(self) -> bool:
        """Every key at once under ``GroupBy`` where ``inner`` finalizes stacked and the rows are ``X`` alone."""
        return self.inner.finalizes_stacked and not self.path

    def _has_keys(self, acc) -> bool:
        """Whether ``acc`` holds a leading key axis (a ``GroupBy``'s every key): a leaf two axes more than one
        column's state (a state of rows ``(n, d)`` or ``(n,)`` is one more: the columns)."""
        return np.ndim(jax.tree.leaves(acc.value)[0]) == _column_state_ndim(self.inner) + 2

    def finalize(self, acc):
        if self.finalizes_stacked and self._has_keys(acc):
            return self._finalize_keys(acc)
        d = np.shape(jax.tree.leaves(acc.value)[0])[0]
        parts = [self.inner.finalize(jax.tree.map(lambda x, j=j: np.asarray(x)[j], acc.value)) for j in range(d)]
        return joined(parts, one_value=np.ndim(acc.row) == 0)

    def _finalize_keys(self, acc):
        """Every key's and column's results in one ``inner`` finalize (the key and column axes first), each
        field as :func:`joined` joins a key's columns (one call a column), a key a row."""
        r = self.inner.finalize(jax.tree.map(np.asarray, acc.value))

        def per_key(x):
            x = np.asarray(x)
            if np.ndim(acc.row) == 1:  # rows of one value: the one column's, as it is
                return x[:, 0, 0] if x.ndim > 2 else x[:, 0]
            return x.reshape(x.shape[0], -1, *x.shape[3:]) if x.ndim > 2 else x

        return jax.tree.map(per_key, r)
