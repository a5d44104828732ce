"""Additive sums: column sums with a row count, and the Gram matrix XᵀX.

The Gram matrix is symmetric, so by default only its upper triangle is accumulated, as
block rows: ``rows[i] = (XᵀX)[s_i:e_i, s_i:]`` for consecutive column blocks
``[s_i, e_i)``. Each block row costs one matmul, the whole about ``(d + b) / 2d`` of the
flops (and of the checkpoint and merge bytes) of the full product; ``finalize`` mirrors
it. On a mesh with a ``model`` axis the (d, d) accumulator is instead split by columns
over ``model``, so each device holds ``d²/M`` of it.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from sharded_scan.combiners import wide
from sharded_scan.combiners.base import AdditiveCombiner, Combiner, masked, nonfinite_as
from sharded_scan.combiners.column_split import column_block, round_up
from sharded_scan.combiners.keyed_sums import keyed_sum
from sharded_scan.combiners.results import frame
from sharded_scan.dtypes import accumulator_dtype
from sharded_scan.errors import UsageError
from sharded_scan.mesh import MODEL_AXIS


class SumResult(NamedTuple):
    """Column sums over all rows and the number of rows."""

    sum: np.ndarray
    count: np.ndarray
    columns: np.ndarray | None = None  # X's column names (a DataFrame, Parquet, CSV), else np.arange(d)

    def to_pandas(self):
        """A DataFrame: a row per column, its ``sum`` and the ``count`` of rows."""
        return frame(self, ("sum", "count"))


def _is_integer(dtype) -> bool:
    return np.dtype(dtype) == np.bool_ or np.issubdtype(np.dtype(dtype), np.integer)


def _exact_sum(acc: wide.Wide, x: jax.Array, mask: jax.Array) -> wide.Wide:
    return wide.add(acc, wide.sum_rows(x, mask, acc.limbs.shape[-1]))


def _float_sum(acc: jax.Array, x: jax.Array, mask: jax.Array) -> jax.Array:
    return acc + jnp.sum(masked(x, mask).astype(acc.dtype), axis=0)


@dataclasses.dataclass(frozen=True)
class Sum(AdditiveCombiner):
    """Sums every leaf over rows (any row shape) and counts the rows.

    Integer and bool leaves sum exactly (as :class:`~sharded_scan.combiners.wide.Wide`
    integers: int64 in the result, Python ints past 2^63); float leaves sum in their
    accumulator dtype (float32; float64 for float64 data, and under ``jax_enable_x64``).
    Under ``nan_policy="omit"`` a NaN or Inf adds nothing to its column (pandas' ``sum()``), and
    ``count`` counts every row; ``"omit_rows"`` skips every row holding one.
    """

    finalizes_stacked = True  # GroupBy finalizes every key at once: a sum of no rows is 0, its count 0

    def init(self, spec):
        def zero(s):
            if _is_integer(s.dtype):
                return wide.zeros(s.shape, wide.limbs_for(s.dtype))
            return jnp.zeros(s.shape, accumulator_dtype(s.dtype))

        return SumResult(jax.tree.map(zero, spec), wide.zeros())

    def add(self, acc, batch, mask):
        def fold(a, x):
            return _exact_sum(a, x, mask) if wide.is_wide(a) else _float_sum(a, x, mask)

        sums = jax.tree.map(fold, acc.sum, batch, is_leaf=wide.is_wide)
        return SumResult(sums, wide.count_rows(acc.count, mask))

    def finite_values(self, batch):
        """``nan_policy="omit"``: each NaN or inf adds nothing to its column (pandas' ``sum()``: 0 for a
        column of none); ``count`` counts the rows."""
        return nonfinite_as(batch, 0)

    def add_keyed(self, acc, batch, mask, keys, num_keys):
        def fold(a, x):
            if wide.is_wide(a):
                return wide.add(a, wide.segment_sum_rows(x, mask, keys, num_keys, a.limbs.shape[-1]))
            return a + keyed_sum(masked(x, mask).astype(a.dtype), keys, num_keys)

        sums = jax.tree.map(fold, acc.sum, batch, is_leaf=wide.is_wide)
        return SumResult(sums, wide.add_int32(acc.count, key_counts(mask, keys, num_keys)))

    def finalize(self, acc):
        sums = jax.tree.map(lambda a: wide.to_int(a) if wide.is_wide(a) else a, acc.sum, is_leaf=wide.is_wide)
        return SumResult(sums, wide.to_int(acc.count))

    def weighted(self):
        return WeightedSum()


class WeightedSumResult(NamedTuple):
    """Weighted column sums ``Σ w x``, the rows of positive weight and the sum of the weights."""

    sum: np.ndarray
    count: np.ndarray
    weight: np.ndarray
    columns: np.ndarray | None = None  # X's column names (a DataFrame, Parquet, CSV), else np.arange(d)

    def to_pandas(self):
        """A DataFrame: a row per column, its weighted ``sum``, the ``count`` of rows and their ``weight``."""
        return frame(self, ("sum", "count", "weight"))


@dataclasses.dataclass(frozen=True)
class WeightedSum(AdditiveCombiner):
    """``Sum().weighted()``: on rows ``(w, data)``, ``Σ w x`` of every leaf (in float), the rows and ``Σ w``."""

    def finite_values(self, batch):
        """``nan_policy="omit"``: each NaN or inf value adds nothing (``Weighted`` skips a row of NaN weight)."""
        return batch[0], nonfinite_as(batch[1], 0)

    def init(self, spec):
        w, data = spec
        sums = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.result_type(accumulator_dtype(s.dtype), w.dtype)), data)
        return WeightedSumResult(sums, wide.zeros(), jnp.zeros((), w.dtype))

    def add(self, acc, batch, mask):
        w, data = batch
        w = masked(w, mask)
        sums = jax.tree.map(lambda a, x: a + jnp.tensordot(w.astype(a.dtype), x.astype(a.dtype), 1), acc.sum, data)
        return WeightedSumResult(sums, wide.count_rows(acc.count, mask), acc.weight + jnp.sum(w))

    def add_keyed(self, acc, batch, mask, keys, num_keys):
        w, data = batch
        w = masked(w, mask)

        def fold(a, x):
            weighted = w.reshape(w.shape + (1,) * (x.ndim - 1)).astype(a.dtype) * x.astype(a.dtype)
            return a + keyed_sum(weighted, keys, num_keys)

        sums = jax.tree.map(fold, acc.sum, data)
        return WeightedSumResult(sums, wide.add_int32(acc.count, key_counts(mask, keys, num_keys)),
                                 acc.weight + keyed_sum(w, keys, num_keys))

    def finalize(self, acc):
        return WeightedSumResult(acc.sum, wide.to_int(acc.count), acc.weight)


def key_counts(mask: jax.Array, keys: jax.Array, num_keys: int) -> jax.Array:
    """The real rows of each key in a micro-batch, int32 ``(num_keys,)`` (for :func:`wide.add_int32`)."""
    return keyed_sum(mask.astype(jnp.int32), keys, num_keys)


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



class Triangle(NamedTuple):
    """The upper triangle of a symmetric (d, d) matrix as block rows.

    ``rows[i]`` is ``M[s_i:e_i, s_i:]`` (shape ``(e_i - s_i, d - s_i)``); the shapes alone
    say where each block starts, so no other bookkeeping travels with it.
    """

    rows: tuple


OUTER_PRODUCTS_AT_ONCE = 1 << 24  # Gram.add_keyed's most values of per-row outer products (64 MiB in float32)

# Block size by d, from the sweep in bench/results (Gram, 8 simulated CPU devices).
BLOCK_BY_WIDTH = ((256, None), (2048, 256))
DEFAULT_LARGE_BLOCK = 512


def default_block(d: int) -> int:
    """The measured best block for a ``d``-wide triangle (``d`` itself: no blocking)."""
    for width, block in BLOCK_BY_WIDTH:
        if d <= width:
            return block or d
    return DEFAULT_LARGE_BLOCK


def triangle_zeros(d: int, block: int, dtype) -> Triangle:
    """The zero triangle of a (d, d) matrix cut into column blocks of ``block``."""
    starts = range(0, d, block)
    return Triangle(tuple(jnp.zeros((min(block, d - s), d - s), dtype) for s in starts))


def triangle_add(tri: Triangle, x: jax.Array) -> Triangle:
    """Adds the upper triangle of ``xᵀx`` (``x``: (rows, d)): one matmul per block row."""
    d = x.shape[1]
    out = []
    for acc in tri.rows:
        start = d - acc.shape[1]
        left = x[:, start : start + acc.shape[0]]
        out.append(acc + jnp.matmul(left.T, x[:, start:], preferred_element_type=acc.dtype))
    return Triangle(tuple(out))


def triangle_full(tri: Triangle) -> np.ndarray:
    """The symmetric (d, d) host array whose upper triangle ``tri`` holds."""
    rows = [np.asarray(r) for r in tri.rows]
    d = rows[0].shape[1]
    full = np.zeros((d, d), rows[0].dtype)
    for r in rows:
        start = d - r.shape[1]
        full[start : start + r.shape[0], start:] = r
    lower = np.tril_indices(d, -1)
    full[lower] = full.T[lower]
    return full


@dataclasses.dataclass(frozen=True)
class Gram(AdditiveCombiner):
    """The Gram matrix XᵀX of rows X (shape (n, d)); the result is the (d, d) array.

    Attributes:
      block: columns per block row of the upper triangle; None picks the measured
        default for ``d`` (:func:`default_block`).
      model_shards: set by :meth:`for_mesh`: when above 1 the accumulator is the
        (d, d) matrix split by columns over the mesh's ``model`` axis (no symmetry).
    """

    block: int | None = None
    model_shards: int = 1

    def check_spec(self, spec):
        super().check_spec(spec)
        check_matrix_spec(spec, "Gram")
        block = self.block
        if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
            raise UsageError(f"Gram block must be a positive integer or None, got {self.block!r}.")

    def for_mesh(self, mesh: Mesh) -> Gram:
        shards = dict(mesh.shape).get(MODEL_AXIS, 1)
        return dataclasses.replace(self, model_shards=shards) if shards > 1 else self

    def partition(self, mesh: Mesh):
        return P(None, MODEL_AXIS) if self.model_shards > 1 else None

    def init(self, spec):
        d, dtype = spec.shape[0], accumulator_dtype(spec.dtype)
        if self.model_shards > 1:
            return jnp.zeros((d, round_up(d, self.model_shards)), dtype)
        return triangle_zeros(d, min(self.block or default_block(d), d), dtype)

    def add(self, acc, batch, mask):
        x = masked(batch, mask)
        if self.model_shards > 1:
            return acc + jnp.matmul(x.T, column_block(x, self.model_shards), preferred_element_type=acc.dtype)
        return triangle_add(acc, x)

    def add_keyed(self, acc, batch, mask, keys, num_keys):
        """Per key, from each row's outer product summed by key (``mb x d x d`` values at once; wider
        rows take the default, one matmul per key)."""
        d = batch.shape[1]
        if batch.shape[0] * d * d > OUTER_PRODUCTS_AT_ONCE:
            return Combiner.add_keyed(Gram(self.block, self.model_shards), acc, batch, mask, keys, num_keys)
        dtype = jax.tree.leaves(acc)[0].dtype
        x = masked(batch, mask).astype(dtype)

        def by_key(left, right):
            return jax.ops.segment_sum(left[:, :, None] * right[:, None, :], keys, num_keys)

        if self.model_shards > 1:
            return acc + by_key(x, column_block(x, self.model_shards))
        return Triangle(tuple(r + by_key(x[:, d - r.shape[2] : d - r.shape[2] + r.shape[1]], x[:, d - r.shape[2] :])
                              for r in acc.rows))

    def weighted(self):
        return WeightedGram(self.block, self.model_shards)

    def finalize(self, acc):
        if isinstance(acc, Triangle):
            return triangle_full(acc)
        return np.asarray(acc)[:, : acc.shape[0]]

    def convert(self, acc, source):
        """Between the triangle and the column-split matrix (a resume on a mesh with other axes)."""
        if source == self:
            return acc
        if isinstance(acc, Triangle):
            d = acc.rows[0].shape[1]
            full = jnp.zeros((d, d), acc.rows[0].dtype)
            for r in acc.rows:
                start = d - r.shape[1]
                full = full.at[start : start + r.shape[0], start:].set(r)
            full = jnp.triu(full) + jnp.triu(full, 1).T
        else:
            full = acc[:, : acc.shape[0]]
        d = full.shape[0]
        like = jax.eval_shape(lambda spec: Gram.init(self, spec), jax.ShapeDtypeStruct((d,), full.dtype))
        if isinstance(like, Triangle):
            starts = [d - r.shape[1] for r in like.rows]
            return Triangle(tuple(full[s : s + r.shape[0], s:] for s, r in zip(starts, like.rows, strict=True)))
        return jnp.pad(full, ((0, 0), (0, like.shape[1] - d)))


@dataclasses.dataclass(frozen=True)
class WeightedGram(Gram):
    """``Gram().weighted()``: on rows ``(w, X)``, ``Xᵀ diag(w) X``, the Gram matrix of ``√w x``."""

    def check_spec(self, spec):
        super().check_spec(spec[1])

    def init(self, spec):
        return super().init(spec[1])

    def _scaled(self, acc, batch):
        w, x = batch
        dtype = jax.tree.leaves(acc)[0].dtype
        return x.astype(dtype) * jnp.sqrt(w).astype(dtype)[:, None]

    def add(self, acc, batch, mask):
        return super().add(acc, self._scaled(acc, batch), mask)

    def add_keyed(self, acc, batch, mask, keys, num_keys):
        return super().add_keyed(acc, self._scaled(acc, batch), mask, keys, num_keys)

    def weighted(self):
        return AdditiveCombiner.weighted(self)
