"""States split by columns over a ``model`` axis: the helpers every such combiner uses, and a state whose every
column folds and merges alone.

:class:`SplitsByColumns` marks a dataclass combiner whose state splits by columns (its ``model_shards``);
:func:`round_up`, :func:`padded_columns` and :func:`column_block` lay its columns out in whole blocks of the axis
and pick a device's own (``Gram``, ``Covariance``, ``Histogram``, ``Quantiles``, the solvers, ...).

A :class:`SplitsEachColumn` combiner (``DistinctCount``, ``TopK``, ``Moments``) keeps a NamedTuple
state whose leaves hold one column each along an axis (:meth:`~SplitsEachColumn.column_axes`: the
first, but the fields in its ``shared``, the same for every column: whole on every device); its
``row_field`` leaf is shaped like a row (``()`` for rows of one value). Over a ``model`` axis of
M devices the state is a :class:`SplitColumns`: its columns padded with the identity's to a
multiple of M, each device holding ``ceil(d / M)`` of them, and every device runs the whole
combiner's ``add`` and ``merge`` on its block of the state and of each micro-batch's columns
(:meth:`own`); so the result is bitwise the whole state's (``Moments``: but for the rounding of
M3 in the merge over ``data``, a program of other shapes, ~1e-7 apart).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from sharded_scan.mesh import MODEL_AXIS


class SplitsByColumns:
    """Mixin of a dataclass combiner whose state splits by columns over ``model``: its
    ``model_shards`` field, set by :meth:`for_mesh` to the mesh's ``model`` size."""

    def for_mesh(self, mesh: Mesh):
        shards = dict(mesh.shape).get(MODEL_AXIS, 1)
        return dataclasses.replace(self, model_shards=shards) if shards > 1 else self

    @property
    def whole(self):
        """This combiner unsplit (``model_shards=1``)."""
        return dataclasses.replace(self, model_shards=1)


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (columns padded to whole ``model`` blocks)."""
    return -(-n // multiple) * multiple


def padded_columns(x: jax.Array, real: int, width: int, axis: int = 0, value=0) -> jax.Array:
    """``x``'s first ``real`` columns along ``axis`` (a split state's real ones, its padding dropped),
    padded with ``value`` to ``width`` (whole blocks of a ``model`` axis): how a state is laid out
    for another ``model`` size (:meth:`Combiner.convert`)."""
    x = jax.lax.slice_in_dim(x, 0, real, axis=axis)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, width - real)
    return jnp.pad(x, pad, constant_values=value)


def column_block(x: jax.Array, shards: int, axis: int = 1, value=0) -> jax.Array:
    """This ``model`` device's block of ``x``'s columns (along ``axis``; padded with ``value``
    to ``shards`` blocks)."""
    d = x.shape[axis]
    width = round_up(d, shards) // shards
    x = padded_columns(x, d, width * shards, axis, value)
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(MODEL_AXIS) * width, width, axis=axis)


class SplitColumns(NamedTuple):
    """A state split by columns over ``model``: every per-column leaf's column axis padded with the
    identity's columns to a multiple of the axis size."""

    value: Any
    columns: jax.Array  # int8 zeros shaped like a row ((d,), or () for scalar rows): the real columns


class SplitsEachColumn(SplitsByColumns):
    """Mixin of a dataclass combiner whose state (a ``state_type`` NamedTuple) folds and merges each
    column alone; ``shared`` names its fields that are not per column, ``row_field`` one shaped like a row."""

    shared = ()
    row_field = "held"

    def column_axes(self) -> Any:
        """A prefix of the state: each part's column axis, None where it is the same for every column."""
        return self.state_type(*(None if f in self.shared else 0 for f in self.state_type._fields))

    def _each(self, f, *trees):
        """``f(axis, *parts)`` over the parts :meth:`column_axes` names."""
        return jax.tree.map(f, self.column_axes(), *trees, is_leaf=lambda a: a is None)

    def partition(self, mesh: Mesh):
        return SplitColumns(self._each(lambda a: P() if a is None else P(*[None] * a, MODEL_AXIS)), P()) \
            if self.model_shards > 1 else None

    def own(self, batch: jax.Array) -> jax.Array:
        """This ``model`` device's block of the micro-batch's columns ``(mb, ceil(d / M))`` (zeros padding)."""
        return column_block(batch.reshape(batch.shape[0], -1), self.model_shards)

    def columns_spec(self, acc: Any, n: int) -> Any:
        """Rows of ``n`` columns whose identity pads a state like ``acc`` (values keyed as its keys)."""
        return jax.ShapeDtypeStruct((n,), acc.keys.dtype)

    def split(self, acc: Any) -> SplitColumns:
        """``acc`` whole as split: its columns, then the identity's of the padded ones."""
        shape = np.shape(getattr(acc, self.row_field))
        d = shape[0] if shape else 1
        pad = self.whole.init(self.columns_spec(acc, round_up(d, self.model_shards) - d))

        def padded(axis, x, empty):
            if axis is None:
                return x
            return jax.tree.map(lambda x, e: jnp.concatenate([jnp.atleast_1d(x), e], axis), x, empty)

        return SplitColumns(self._each(padded, acc, pad), jnp.zeros(shape, jnp.int8))

    def unsplit(self, acc: SplitColumns) -> Any:
        """The whole state of ``acc``: its real columns (``row_field`` shaped like a row)."""
        shape = np.shape(acc.columns)
        real = shape[0] if shape else 1

        def real_columns(axis, x):
            return x if axis is None else jax.tree.map(lambda x: x[(slice(None),) * axis + (slice(real),)], x)

        value = self._each(real_columns, acc.value)
        return value._replace(**{self.row_field: getattr(value, self.row_field).reshape(shape)})

    def convert(self, acc, source):
        """Between the whole state and one split over ``model`` (a resume on a mesh with other axes)."""
        whole = source.unsplit(acc) if source.model_shards > 1 else acc
        return self.split(whole) if self.model_shards > 1 else whole
