"""Exact quantiles in a few passes: the sketch brackets each answer, counting passes narrow it.

Pass 1 is the one-pass ``Quantiles`` sketch. For each
wanted rank ``r`` of every column and ``q`` (``floor`` and/or ``ceil`` of ``q (n - 1)``, as
``method`` reads them) it gives keys ``lo <= hi``
with at most ``r`` rows below ``lo`` and more than ``r`` rows at or below ``hi``, unless
the sketch's rank error exceeds Hoeffding's bound at probability ``1e-9``. Each further
pass (:class:`RefinePass`) counts, exactly, the rows below each of ``2^bits + 1``
boundaries over ``[lo, hi]`` and the smallest and largest key in every bin. The bin
holding rank ``r`` answers at once when ``r`` is its first or last row or all its rows
are equal; otherwise its smallest and largest keys are the next bracket. A bracket the
rank fell outside of (the sketch's rare miss) is replaced by the keys on that side.

Half of the boundaries cut the bracket into equal key ranges, so each pass shrinks it
by ``2^(bits-1)`` and at most ``ceil(32 / (bits - 1))`` passes follow the sketch
(``ceil(64 / (bits - 1))`` for 64-bit keys, whose host keys are Python ints); for
floats the other half cut it into equal value ranges, which splits smooth data into
bins of nearly equal row counts (two or three passes in all on 10^7 normal rows).
Memory is ``d * len(qs) * 2^bits`` counts and keys, whatever the row count.

On a mesh with a ``model`` axis of size M every pass splits by columns: the sketch pass as
the sketch does (:class:`SketchPass`), the refining passes' counts and bin keys padded to a
multiple of M columns, each device counting ``ceil(d / M)`` of them at its block of the boundaries
(the programs' operands, padded and split the same way: :meth:`RefinePass.operand_partition`). The sketch
is bitwise the whole mesh's on the same shards and the counts are exact, so the passes and
answers are those of the run without ``model``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sharded_scan.combiners import wide
from sharded_scan.combiners.base import Combiner, nonfinite_as_nan
from sharded_scan.combiners.column_split import SplitsByColumns, column_block, padded_columns, round_up
from sharded_scan.combiners.sketches import kll, kll_weighted
from sharded_scan.combiners.sketches.keys import (
    KIND_DTYPES,
    check_column_spec,
    fill,
    fold_if_any,
    from_keys,
    is_float,
    key_dtype,
    masked_columns,
    nan_key,
    np_float_keys,
)
from sharded_scan.combiners.sketches.quantiles_result import finite_weight, method_ranks, result_from_keys
from sharded_scan.mesh import MODEL_AXIS

BRACKET_CONFIDENCE = 1.0 - 1e-9


def host_ints(keys: np.ndarray) -> np.ndarray:
    """Host keys as integers that hold one past the largest key: int64 for ``uint32`` keys,
    Python ints (an object array) for ``uint64`` ones."""
    keys = np.asarray(keys)
    return keys.astype(np.int64 if keys.dtype == np.uint32 else object)


@dataclasses.dataclass(frozen=True)
class SketchPass(Combiner):
    """Pass 1: the one-pass ``sketch`` (``Quantiles``, ``Describe``), returned whole (the merged host
    accumulator) for bracketing; on a mesh with a ``model`` axis split as the sketch splits."""

    sketch: Combiner

    def check_spec(self, spec):
        self.sketch.check_spec(spec)

    def for_mesh(self, mesh):
        return dataclasses.replace(self, sketch=self.sketch.for_mesh(mesh))

    def partition(self, mesh):
        return self.sketch.partition(mesh)

    def convert(self, acc, source):
        return self.sketch.convert(acc, source.sketch)

    def init(self, spec):
        return self.sketch.init(spec)

    def add(self, acc, batch, mask):
        return self.sketch.add(acc, batch, mask)

    def finite_values(self, batch):
        return self.sketch.finite_values(batch)

    def omitting_values(self):
        """The sketch's own (``Quantiles``': each column's finite values, :class:`~.quantiles.FiniteQuantiles`)."""
        return dataclasses.replace(self, sketch=self.sketch.omitting_values())

    def merge(self, a, b):
        return self.sketch.merge(a, b)

    def finalize(self, acc):
        whole = getattr(self.sketch, "whole", self.sketch)  # a split sketch's real columns, whole
        return whole.convert(acc, self.sketch)


class BinCounts(NamedTuple):
    """Per column, q and boundary: rows below it; per bin: its smallest and largest key."""

    below: wide.Wide  # (d, nq, bins + 1)
    min: jax.Array    # keys (d, nq, bins), the filler for an empty bin
    max: jax.Array    # keys (d, nq, bins), 0 for an empty bin


@dataclasses.dataclass(frozen=True, eq=False)
class RefinePass(SplitsByColumns, Combiner):
    """Counts rows below every boundary and the key range of every bin, per column and q.

    Attributes:
      bounds: ``(d, nq, bins + 1)`` (:func:`host_ints`), increasing along the last axis,
        values in ``[0, 2^32]`` (``2^32``: past every key; ``2^64`` for 64-bit keys). Bin
        ``i`` holds keys in ``[bounds[i], bounds[i + 1])``. The programs take them as operands
        (:meth:`operands`): passes of one shape share the compiled programs; the fingerprint names them.
      model_shards: set by :meth:`for_mesh`: above 1 the counts are split by columns over ``model``
        (``(round_up(d, M), nq, ...)``, the padding columns empty), each device sorting and counting
        its own block of the columns at its block of the boundaries (the operands, padded and split
        the same way: :meth:`operand_partition`).
    """

    bounds: np.ndarray
    bound: Any = dataclasses.field(default=None, repr=False)  # the operands inside a program (bind)
    model_shards: int = 1

    def check_spec(self, spec):
        check_column_spec(spec, "Quantiles")

    def __eq__(self, other):  # the boundaries are operands: every pass of their shape reuses the compiled programs
        return type(other) is type(self) and self._key() == other._key()

    def __hash__(self):
        return hash((type(self), *self._key()))

    def _key(self):
        return self.bounds.shape, self.bounds.dtype, self.model_shards

    def partition(self, mesh):
        return BinCounts(P(MODEL_AXIS), P(MODEL_AXIS), P(MODEL_AXIS)) if self.model_shards > 1 else None

    def _width(self) -> int:
        """The columns of the state: ``d``, padded to a multiple of ``model_shards``."""
        return round_up(self.bounds.shape[0], self.model_shards)

    def _own(self, cols):
        """This ``model`` device's block of keys ``(d, mb)`` (padded with the filler: no rows), or all of them."""
        return column_block(cols, self.model_shards, axis=0, value=fill(cols.dtype)) if self.model_shards > 1 else cols

    def convert(self, acc, source):
        """Between the whole counts and ones split over ``model`` (a resume on a mesh with other axes)."""
        if source.model_shards == self.model_shards:
            return acc
        d, width = self.bounds.shape[0], self._width()
        low = padded_columns(acc.min, d, width, value=fill(acc.min.dtype))
        return BinCounts(jax.tree.map(lambda x: padded_columns(x, d, width), acc.below), low,
                         padded_columns(acc.max, d, width))

    def operands(self, spec):
        """The boundaries as keys of ``spec``'s values (one past every key: the largest key) and where
        they are past every key: ``(d, nq, bins + 1)`` each; split over ``model``, padded to the state's
        columns (:meth:`_width`) with boundaries at 0, none past every key (a padding column counts no rows)."""
        largest = int(fill(key_dtype(spec.dtype)))
        pad = [(0, self._width() - self.bounds.shape[0]), (0, 0), (0, 0)]
        return (np.pad(np.minimum(self.bounds, largest).astype(key_dtype(spec.dtype)), pad),
                np.pad(np.asarray(self.bounds == largest + 1, bool), pad))

    def operand_partition(self, mesh):
        """Split over ``model`` as the counts are: inside the programs each device binds its own columns'
        boundaries, never the whole (``d * nq * (bins + 1)`` keys: a device's memory for 10^4 columns)."""
        return (P(MODEL_AXIS), P(MODEL_AXIS)) if self.model_shards > 1 else None

    def bind(self, operands):
        return dataclasses.replace(self, bound=operands)

    def finite_values(self, batch):
        """``nan_policy="omit"``: each NaN or Inf as NaN, whose key sorts after every boundary (the brackets
        hold finite keys), so that a column's counts are of its own finite values, as its sketch pass's."""
        return nonfinite_as_nan(batch)

    def fingerprint(self):
        raw = (np.ascontiguousarray(self.bounds, np.int64).tobytes() if self.bounds.dtype != object
               else repr(self.bounds.tolist()).encode())  # 64-bit keys: up to 2^64, past int64
        digest = hashlib.sha256(raw).hexdigest()
        return {"combiner": "RefinePass", "bounds": f"{self.bounds.shape} sha256:{digest}"}

    def init(self, spec):
        _, nq, edges = self.bounds.shape
        d, keys = self._width(), key_dtype(spec.dtype)
        return BinCounts(
            wide.zeros((d, nq, edges), limbs=3), jnp.full((d, nq, edges - 1), fill(keys), keys),
            jnp.zeros((d, nq, edges - 1), keys),
        )

    def add(self, acc, batch, mask):
        return fold_if_any(mask, lambda acc: self._add(acc, batch, mask), acc)

    def _add(self, acc, batch, mask):
        keys = jnp.sort(self._own(masked_columns(batch, mask)), axis=1)  # (d, mb), or this device's block
        counts, low, high = self._bins(keys, jnp.sum(mask, dtype=jnp.int32))
        return BinCounts(
            wide.add(acc.below, wide.of_int32(counts, limbs=3)), jnp.minimum(acc.min, low), jnp.maximum(acc.max, high)
        )

    def _bins(self, keys, real):
        """Per column, q and boundary of keys ``(d, mb)`` sorted, the first ``real`` real: the rows below
        it; per bin: the smallest and largest key."""
        bounds, past_all = self.bound  # split over model: this device's block (operand_partition)

        def below(col, b):
            return jnp.searchsorted(col, b.reshape(-1)).reshape(b.shape).astype(jnp.int32)

        counts = jnp.where(past_all, real, jax.vmap(below)(keys, bounds))  # (d, nq, edges)
        first, last = counts[..., :-1], counts[..., 1:] - 1
        empty = last < first

        def at(col, i):
            return jnp.take(col, jnp.clip(i, 0, col.shape[0] - 1).reshape(-1)).reshape(i.shape)

        low = jnp.where(empty, fill(keys.dtype), jax.vmap(at)(keys, first))
        high = jnp.where(empty, keys.dtype.type(0), jax.vmap(at)(keys, last))
        return counts, low, high

    def merge(self, a, b):
        return BinCounts(wide.add(a.below, b.below), jnp.minimum(a.min, b.min), jnp.maximum(a.max, b.max))

    def merge_collectives(self):  # exact counts, smallest and largest keys: order-free, one collective a leaf
        return BinCounts("sum_exact", "min", "max")

    def finalize(self, acc):
        acc = jax.tree.map(lambda x: np.asarray(x)[: self.bounds.shape[0]], acc)  # the real columns
        return BinCounts(np.asarray(wide.to_int(acc.below), np.int64), acc.min, acc.max)


@dataclasses.dataclass(frozen=True, eq=False)
class WeightedRefinePass(RefinePass):
    """:class:`RefinePass` on rows ``(w, X)``: the weight below every boundary (float sums), not the rows."""

    def check_spec(self, spec):
        super().check_spec(spec[1])

    def fingerprint(self):
        return {**super().fingerprint(), "combiner": "WeightedRefinePass"}

    def operands(self, spec):
        return super().operands(spec[1])

    def init(self, spec):
        w, x = spec
        acc = super().init(x)
        return acc._replace(below=jnp.zeros((self._width(), *self.bounds.shape[1:]), w.dtype))

    def _add(self, acc, batch, mask):
        w, x = batch
        cols = self._own(masked_columns(x, mask))
        keys, weights = jax.lax.sort((cols, jnp.broadcast_to(jnp.where(mask, w, 0), cols.shape)), dimension=1,
                                     num_keys=1)
        counts, low, high = self._bins(keys, jnp.sum(mask, dtype=jnp.int32))
        cumulative = jnp.concatenate([jnp.zeros_like(weights[:, :1]), jnp.cumsum(weights, axis=1)], axis=1)
        d = counts.shape[0]
        below = jnp.take_along_axis(cumulative, counts.reshape(d, -1), axis=1).reshape(counts.shape)
        return BinCounts(acc.below + below, jnp.minimum(acc.min, low), jnp.maximum(acc.max, high))

    def merge(self, a, b):
        return BinCounts(a.below + b.below, jnp.minimum(a.min, b.min), jnp.maximum(a.max, b.max))

    def merge_collectives(self):  # float weights: a psum rounds by order (not under logical_shards)
        return BinCounts("sum", "min", "max")

    def finalize(self, acc):
        acc = jax.tree.map(lambda x: np.asarray(x)[: self.bounds.shape[0]], acc)  # the real columns
        return BinCounts(np.asarray(acc.below, np.float64), acc.min, acc.max)


def boundaries(lo: int, hi: int, bins: int, dtype) -> np.ndarray:
    """``bins + 1`` boundaries over the bracket ``[lo, hi]`` of keys of values of ``dtype``
    (``lo < hi``), the last ``hi + 1``, as :func:`host_ints` of their keys.

    They cut the keys into equal ranges; for floats half of them cut the values instead.
    """
    floats, keys = np.dtype(dtype).kind == "f", key_dtype(dtype)
    by_key = bins // 2 if floats else bins
    shift = max(0, (hi - lo).bit_length() - int(math.log2(by_key)))  # ceil(log2(hi - lo + 1)), exactly
    cuts = [lo + (host_ints(np.arange(by_key, dtype=keys)) << shift)]
    if floats:
        ends = from_keys(np.array([lo, hi], keys), dtype)
        with np.errstate(invalid="ignore", over="ignore"):
            values = np.linspace(ends[0], ends[1], bins - by_key + 1)[1:-1]
        cuts.append(host_ints(np_float_keys(values[np.isfinite(values)], dtype)))
    inside = np.unique(np.concatenate(cuts))
    inside = inside[np.asarray((inside >= lo) & (inside <= hi), bool)]
    return np.concatenate([inside, host_ints(np.zeros(bins + 1 - len(inside), keys)) + (hi + 1)])


def narrowed(bounds: np.ndarray, counts: BinCounts, rank: int, low: int, high: int) -> tuple[int, int]:
    """The next bracket ``(lo, hi)`` of keys for ``rank`` from one pass (``lo == hi``: the answer)."""
    below = counts.below
    if rank < below[0]:
        return low, int(bounds[0]) - 1
    if rank >= below[-1]:
        return int(bounds[-1]), high
    i = int(np.searchsorted(below, rank, side="right")) - 1
    smallest, largest = int(counts.min[i]), int(counts.max[i])
    if rank == below[i] or smallest == largest:
        return smallest, smallest
    if rank == below[i + 1] - 1:
        return largest, largest
    return smallest, largest


def narrowed_by_weight(bounds: np.ndarray, counts: BinCounts, target: float, low: int, high: int) -> tuple[int, int]:
    """The next bracket ``(lo, hi)`` of the smallest key with at least ``target`` weight at or below it
    (``lo == hi``: the answer), from one :class:`WeightedRefinePass`."""
    below = counts.below
    if target <= below[0]:
        return low, int(bounds[0]) - 1
    if target > below[-1]:
        return int(bounds[-1]), high
    i = int(np.searchsorted(below, target, side="left")) - 1  # below[i] < target <= below[i + 1]
    return int(counts.min[i]), int(counts.max[i])


class Brackets:
    """Per column and wanted rank, a bracket ``[lo, hi]`` of keys that every pass narrows.

    Made from the merged sketch pass ``acc`` and ``ranks`` ``(d, m)`` (0-based, in rows, each
    below the column's rows: NaN, whose keys sort last, may follow them); ``settled``
    ``(d, m)`` marks answers the caller has already (ends, NaN columns). ``keys`` holds
    the answers once :attr:`open` is False. Brackets are :func:`host_ints` of the keys.
    """

    def __init__(self, acc, ranks: np.ndarray, settled: np.ndarray, bits: int):
        counts = wide.to_int(acc.count)  # per column under nan_policy="omit": its finite values
        rows = int(np.max(counts, initial=0))  # the margin is the sketch's error in ranks, whatever the rows
        host = kll.to_host(acc.sketch)
        self.ranks, self.bins, self.dtype = ranks, 1 << bits, KIND_DTYPES[int(acc.kind)]
        self.key_type = np.asarray(acc.low).dtype
        self.low = host_ints(np.asarray(acc.low).reshape(-1))
        self.high = host_ints(np.asarray(acc.high).reshape(-1))
        if rows == 0 or float(acc.sketch.variance) == 0.0:  # nothing compacted: the sketch holds every row
            self.lo = self.hi = host_ints(kll.keys_at(host, ranks))
            return
        margin = kll.rank_error_bound(float(acc.sketch.variance), rows, BRACKET_CONFIDENCE) * rows + 1
        # Past either end of the sketch's items (of its finite ones per column) only the true extremes bracket safely.
        total = finite_weight(host, acc.kind) if np.ndim(counts) else host.cumulative[:, -1:]
        low, high = self.low[:, None], self.high[:, None]
        lo = np.where(ranks < margin, low, host_ints(kll.keys_at(host, np.maximum(ranks - margin, 0))))
        hi = np.where(ranks + margin >= total, high, host_ints(kll.keys_at(host, ranks + margin)))
        self.lo, self.hi = lo, np.where(settled, lo, np.maximum(hi, lo))

    def _unsettled(self) -> np.ndarray:
        """Where an answer is still a bracket (bool: object arrays of 64-bit keys compare to objects)."""
        return np.asarray(self.lo < self.hi, bool)

    @property
    def open(self) -> bool:
        """Whether an answer is still a bracket (another pass is needed)."""
        return bool(np.any(self._unsettled()))

    def bounds(self) -> np.ndarray:
        """The next pass's boundaries for every open bracket (``RefinePass.bounds``)."""
        bounds = np.zeros(self.lo.shape + (self.bins + 1,), self.lo.dtype)
        for j, i in zip(*np.nonzero(self._unsettled()), strict=True):
            bounds[j, i] = boundaries(int(self.lo[j, i]), int(self.hi[j, i]), self.bins, self.dtype)
        return bounds

    def narrow(self, bounds: np.ndarray, counts: BinCounts) -> None:
        """Narrows every open bracket by the pass that counted rows at ``bounds``."""
        for j, i in zip(*np.nonzero(self._unsettled()), strict=True):
            cell = BinCounts(counts.below[j, i], counts.min[j, i], counts.max[j, i])
            self.lo[j, i], self.hi[j, i] = narrowed(bounds[j, i], cell, int(self.ranks[j, i]), int(self.low[j]),
                                                    int(self.high[j]))

    @property
    def keys(self) -> np.ndarray:
        """The answers' keys ``(d, m)``, in the accumulator's key dtype (``uint32`` or ``uint64``)."""
        return self.lo.astype(self.key_type)


class WeightedBrackets(Brackets):
    """:class:`Brackets` of weighted quantiles: per column and q, the smallest key whose weight at or below
    it reaches the ``targets`` ``(d, m)`` (``q`` times the total weight), from a weighted sketch pass."""

    def __init__(self, acc, targets: np.ndarray, settled: np.ndarray, bits: int):
        host = kll_weighted.to_host(acc.sketch)
        self.ranks, self.bins, self.dtype = targets, 1 << bits, KIND_DTYPES[int(acc.kind)]
        self.key_type = np.asarray(acc.low).dtype
        self.low = host_ints(np.asarray(acc.low).reshape(-1))
        self.high = host_ints(np.asarray(acc.high).reshape(-1))
        picks = host_ints(kll.keys_at(host, np.nextafter(targets, -np.inf)))
        variance = np.asarray(acc.sketch.variance, np.float64)
        if host.keys.shape[1] == 0 or not variance.any():  # nothing rounded: the sketch holds every row
            self.lo = self.hi = picks
            return
        total = host.cumulative[:, -1:]
        margin = np.array([[kll.rank_error_bound(float(v), float(t), BRACKET_CONFIDENCE) * t]
                           for v, t in zip(variance, total[:, 0], strict=True)]) * 1.01
        low, high = self.low[:, None], self.high[:, None]
        lo = np.where(targets <= margin, low, host_ints(kll.keys_at(host, np.maximum(targets - margin, 0))))
        hi = np.where(targets + margin >= total, high, host_ints(kll.keys_at(host, targets + margin)))
        self.lo, self.hi = lo, np.where(settled, picks, np.maximum(hi, lo))
        self.lo = np.where(settled, picks, self.lo)

    def narrow(self, bounds: np.ndarray, counts: BinCounts) -> None:
        for j, i in zip(*np.nonzero(self._unsettled()), strict=True):
            cell = BinCounts(counts.below[j, i], counts.min[j, i], counts.max[j, i])
            self.lo[j, i], self.hi[j, i] = narrowed_by_weight(bounds[j, i], cell, float(self.ranks[j, i]),
                                                              int(self.low[j]), int(self.high[j]))


def nan_columns(acc) -> np.ndarray:
    """``(d, 1)``: which columns of a merged sketch accumulator held a NaN (their largest key is NaN's)."""
    high_keys = np.asarray(acc.high).reshape(-1)
    return ((high_keys == nan_key(high_keys.dtype)) & is_float(acc.kind))[:, None]


def no_rows(rows) -> np.ndarray:
    """``(d, 1)`` (or a scalar): which columns have no values to answer from (their answers NaN)."""
    rows = np.asarray(rows)
    return (rows == 0).reshape(-1, 1) if rows.ndim else rows == 0


def refined(brackets, refine_pass):
    """Yields ``refine_pass(bounds)`` passes until every bracket is closed; returns the passes run, the sketch's too."""
    passes = 1
    while brackets.open:
        bounds = brackets.bounds()
        brackets.narrow(bounds, (yield refine_pass(bounds)))
        passes += 1
    return passes


def weighted_exact_passes(qs: tuple[float, ...], bits: int, sketch: Combiner):
    """The passes of ``Weighted(Quantiles(exact=True, method="inverted_cdf"))``: the weighted sketch
    (``sketch``), then weight counts that narrow each answer by ``bits`` bits of its key."""
    qs = np.asarray(qs, np.float64)
    acc = yield SketchPass(sketch)
    rows = wide.to_int(acc.count)  # per column under nan_policy="omit", as the weight
    d = np.asarray(acc.low).size
    targets = np.broadcast_to(qs[None, :] * np.asarray(acc.weight, np.float64).reshape(-1, 1), (d, len(qs)))
    settled = (qs[None, :] == 0) | (qs[None, :] == 1) | nan_columns(acc) | no_rows(rows)
    brackets = WeightedBrackets(acc, targets, settled, bits)
    passes = yield from refined(brackets, WeightedRefinePass)
    keys = brackets.keys
    return result_from_keys(acc, qs, (keys, keys, np.zeros(keys.shape)), rows, 0.0, passes, "inverted_cdf")


def exact_passes(qs: tuple[float, ...], bits: int, method: str, sketch: Combiner):
    """The passes of ``Quantiles(exact=True)`` for ``qs``, the first one ``sketch``'s (the
    one-pass ``Quantiles``), each later one refining by ``bits`` bits of the keys: a generator
    :func:`sharded_scan.run` drives."""
    qs = np.asarray(qs, np.float64)
    acc = yield SketchPass(sketch)
    rows = wide.to_int(acc.count)  # per column under nan_policy="omit": its finite values
    d = np.asarray(acc.low).size
    per_row = rows if np.ndim(rows) == 0 else rows.reshape(-1, 1)
    low, high, weight = (np.broadcast_to(a, (d, len(qs))) for a in method_ranks(qs, per_row, method))
    both = not np.array_equal(low, high)  # linear and midpoint read two ranks, the others one
    ranks = np.concatenate([low, high], axis=1) if both else low
    ends = np.tile(qs, 2 if both else 1)[None, :]
    brackets = Brackets(acc, ranks, (ends == 0) | (ends == 1) | nan_columns(acc) | no_rows(rows), bits)
    passes = yield from refined(brackets, RefinePass)
    keys = brackets.keys
    picks = (keys[:, : len(qs)], keys[:, len(qs):] if both else keys, weight)
    return result_from_keys(acc, qs, picks, rows, 0.0, passes, method)
