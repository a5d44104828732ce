"""Per-column histograms with equal-width bins, binned exactly like ``np.histogram``."""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from sharded_scan.combiners import wide
from sharded_scan.combiners.base import AdditiveCombiner, Combiner, masked
from sharded_scan.combiners.column_split import SplitsByColumns, column_block, padded_columns, round_up
from sharded_scan.combiners.results import frame
from sharded_scan.combiners.statistics.sums import check_matrix_spec
from sharded_scan.errors import UsageError
from sharded_scan.mesh import MODEL_AXIS


class HistogramResult(NamedTuple):
    """Counts ``(d, bins)`` (int64, exact past 2^31) and edges: ``(bins + 1,)``, or ``(d, bins + 1)`` per column."""

    counts: np.ndarray
    edges: np.ndarray
    columns: np.ndarray | None = None  # X's column names (a DataFrame, Parquet, CSV), else np.arange(d)

    def to_pandas(self):
        """A DataFrame indexed by ``(column, bin)``: each bin's ``count`` and its edges ``left``, ``right``."""
        edges = np.broadcast_to(self.edges, (*np.shape(self.counts)[:-1], np.shape(self.edges)[-1]))
        return frame(self, (("count", self.counts), ("left", edges[..., :-1]), ("right", edges[..., 1:])),
                     long=("bin", ("count", "left", "right")))


def _float32_at_least(edges: np.ndarray) -> np.ndarray:
    """The smallest float32 ``>= e`` for each float64 edge: ``x >= e`` iff ``x >= it`` for float32 ``x``."""
    near = edges.astype(np.float32)
    return np.where(near.astype(np.float64) < edges, np.nextafter(near, np.float32(np.inf)), near)


def _float32_at_most(edges: np.ndarray) -> np.ndarray:
    """The largest float32 ``<= e`` for each float64 edge."""
    near = edges.astype(np.float32)
    return np.where(near.astype(np.float64) > edges, np.nextafter(near, np.float32(-np.inf)), near)


def edges_at(lo: float, hi: float, bins: int, index) -> np.ndarray:
    """``np.linspace(lo, hi, bins + 1)[index]`` by numpy's own arithmetic, without making every edge."""
    index = np.asarray(index, np.float64)
    delta = np.float64(hi) - np.float64(lo)
    step = delta / bins
    inner = index / bins * delta if step == 0 else index * step
    return np.where(index == bins, np.float64(hi), inner + np.float64(lo))


def _has_subnormal_compare(lo: float, hi: float, bins: int) -> bool:
    """Whether an edge of ``np.linspace(lo, hi, bins + 1)``, as compared in float32, is a nonzero
    subnormal. The compared values rise with the edge's index, so two bisections per sign find
    whether any lies strictly between 0 and float32's smallest normal: a handful of edges, not all."""
    tiny = np.finfo(np.float32).tiny
    inner = range(bins)  # edges 0..bins-1 are compared with x >= edge, the last with x <= edge

    def compared(i: int) -> float:
        return float(_float32_at_least(edges_at(lo, hi, bins, i)))

    def first(predicate) -> int:
        return bisect.bisect_left(inner, True, key=lambda i: predicate(compared(i)))

    negative = first(lambda c: c > -tiny) < first(lambda c: c >= 0)
    positive = first(lambda c: c > 0) < first(lambda c: c >= tiny)
    last = float(_float32_at_most(np.float64(hi)))
    return negative or positive or (last != 0 and abs(last) < tiny)


def check_normal_edges(ranges: np.ndarray, bins: int) -> None:
    """Raises one :class:`UsageError` line when an edge the values are compared with (float32) is
    subnormal: XLA on CPU and TPU reads it as 0 (flush-to-zero), so every value would land in the
    wrong bin (``Histogram(4, (0, 4e-310))``: every row in the last). Only ranges reaching within
    float32's smallest normal of 0 can have such edges; theirs are checked, in time that does not
    grow with ``bins``."""
    tiny = np.finfo(np.float32).tiny
    near = ranges[(ranges[:, 0] < tiny) & (ranges[:, 1] > -tiny)]
    bad = np.array([_has_subnormal_compare(lo, hi, bins) for lo, hi in near], bool)
    if bad.any():
        lo, hi = (float(v) for v in near[np.argmax(bad)])
        raise UsageError(
            f"Histogram range ({lo!r}, {hi!r}) with {bins} bins has edges below float32's smallest normal number "
            f"{tiny:.3g} in magnitude (values are binned in float32, and XLA on CPU and TPU flushes such "
            "values to 0): scale the data and the range up, or take a wider range or fewer bins.")


class SplitCounts(NamedTuple):
    """A :class:`Histogram`'s counts split by columns over ``model``, padded with empty columns to a
    multiple of the axis size; ``columns``' length is the real column count (zeros: sums keep it)."""

    counts: wide.Wide
    columns: jax.Array


def unsplit(acc: SplitCounts) -> wide.Wide:
    """The whole counts of ``acc``: its real columns."""
    return wide.Wide(acc.counts.limbs[: acc.columns.shape[0]])


class SplitSums(NamedTuple):
    """A :class:`WeightedHistogram`'s float sums split by columns over ``model`` as :class:`SplitCounts`
    splits the counts: padded with empty columns to a multiple of the axis size, ``columns``' length the
    real column count."""

    sums: jax.Array
    columns: jax.Array


def unsplit_sums(acc: SplitSums) -> jax.Array:
    """The whole sums of ``acc``: its real columns (as :func:`unsplit` the counts)."""
    return acc.sums[: acc.columns.shape[0]]


@dataclasses.dataclass(frozen=True, eq=False)
class Histogram(SplitsByColumns, AdditiveCombiner):
    """Counts of each column's values in ``bins`` equal bins over ``range``.

    Like ``np.histogram(x[:, j], bins, range)`` for every column ``j``: the edges are
    ``np.linspace(lo, hi, bins + 1)`` in float64, each bin holds ``[edge_i, edge_i+1)``,
    the last also its right edge, and values outside ``[lo, hi]`` (and NaN) are not
    counted (under ``nan_policy="omit"`` so each NaN or Inf is skipped where it stands, the row's other
    values counted; ``"omit_rows"`` skips every row holding one). Values are compared in float32
    against the float64 edges exactly (XLA on CPU and
    TPU flushes subnormal values, below about 1e-38 in magnitude, to zero first; a range with
    such edges is one line, :func:`check_normal_edges`).

    Args:
      bins: the number of bins, ``> 0``.
      range: ``(lo, hi)`` for every column, or a ``(d, 2)`` array of per-column ranges.
    """

    bins: int
    range: Any
    bound: Any = dataclasses.field(default=None, repr=False)  # the operands inside a program (bind)
    model_shards: int = 1  # set by for_mesh: above 1 the counts and edges are split by columns over ``model``

    def __post_init__(self):
        bins = self.bins
        if isinstance(bins, bool) or not isinstance(bins, (int, np.integer)) or bins <= 0:
            raise UsageError(f"Histogram needs a positive integer number of bins, got bins={bins!r}.")
        if self.range is None:
            raise UsageError("Histogram needs range=(lo, hi) (or a (d, 2) array of per-column ranges).")
        ranges = np.asarray(self.range, np.float64)
        if ranges.shape[-1:] != (2,) or ranges.ndim > 2:
            raise UsageError(f"Histogram range must be (lo, hi) or of shape (d, 2), got shape {ranges.shape}.")
        if not (np.isfinite(ranges).all() and (ranges[..., 0] < ranges[..., 1]).all()):
            raise UsageError(f"Histogram range needs finite lo < hi, got {self.range!r}.")
        check_normal_edges(np.atleast_2d(ranges), bins)

    def _edges(self, d: int) -> np.ndarray:
        ranges = np.broadcast_to(np.asarray(self.range, np.float64), (d, 2))
        return np.stack([np.linspace(lo, hi, self.bins + 1) for lo, hi in ranges])

    def check_spec(self, spec):
        super().check_spec(spec)
        check_matrix_spec(spec, "Histogram")
        ranges = np.asarray(self.range)
        if ranges.ndim == 2 and ranges.shape[0] != spec.shape[0]:
            raise UsageError(
                f"Histogram has {ranges.shape[0]} per-column ranges but the rows have {spec.shape[0]} columns."
            )

    def __eq__(self, other):  # the edges are operands: another range reuses the compiled programs
        return type(other) is type(self) and self._key() == other._key()

    def __hash__(self):
        return hash((type(self), *self._key()))

    def _key(self):
        return self.bins, np.shape(self.range), self.model_shards

    def partition(self, mesh: Mesh):
        return SplitCounts(wide.Wide(P(MODEL_AXIS)), P()) if self.model_shards > 1 else None

    def operands(self, spec):
        """The float32 edges every value is compared with: inner ``(d, bins - 1)``, ``lo`` and ``hi`` ``(d,)``;
        split over ``model``, padded to the counts' columns (``round_up(d, M)``) with inner edges 0 and an
        empty range, ``lo`` 1 above ``hi`` 0 (a padding column counts no value)."""
        d = spec.shape[0]
        edges = self._edges(d)
        inner, lo = _float32_at_least(edges[:, 1:-1]), _float32_at_least(edges[:, 0])
        hi = _float32_at_most(edges[:, -1])
        if self.model_shards == 1:
            return inner, lo, hi
        pad = round_up(d, self.model_shards) - d
        return (np.pad(inner, [(0, pad), (0, 0)]), np.pad(lo, (0, pad), constant_values=1),
                np.pad(hi, (0, pad), constant_values=0))

    def operand_partition(self, mesh: Mesh):
        """Split over ``model`` as the counts are: inside the programs each device binds its own columns'
        edges, never the whole (``d * (bins + 1)`` floats: a device's memory for 10^4 columns of 10^3 bins)."""
        return (P(MODEL_AXIS), P(MODEL_AXIS), P(MODEL_AXIS)) if self.model_shards > 1 else None

    def bind(self, operands):
        return dataclasses.replace(self, bound=operands)

    def init(self, spec):
        d = spec.shape[0]
        if self.model_shards > 1:
            return SplitCounts(wide.zeros((round_up(d, self.model_shards), self.bins)),
                               jnp.zeros((d,), jnp.int8))
        return wide.zeros((d, self.bins))

    def _bins(self, x, mask):
        """Each value's bin, numbered over ``(column, bin)`` (``(mb, d)``; this ``model`` device's
        columns where split), and whether it counts."""
        if self.bound is not None:  # inside the programs; split over model, this device's block (operand_partition)
            inner, lo, hi = self.bound
        else:  # unbound (outside the programs): the whole edges, this device's block where split
            whole = Histogram.operands(self, jax.ShapeDtypeStruct((x.shape[1],), x.dtype))
            inner, lo, hi = whole if self.model_shards == 1 else (column_block(e, self.model_shards, axis=0)
                                                                   for e in whole)
        if self.model_shards > 1:  # padded columns: empty ranges, nothing counts
            x = column_block(x, self.model_shards)
        d = x.shape[1]
        x = x.astype(jnp.float32)
        index = jax.vmap(lambda e, col: jnp.searchsorted(e, col, side="right"))(inner, x.T).T  # (mb, d)
        return index + jnp.arange(d, dtype=index.dtype) * self.bins, masked((x >= lo) & (x <= hi), mask, False)

    def add(self, acc, batch, mask):
        return self._counted(acc, self._binned(batch, mask, None, 1, jnp.int32))

    def finite_values(self, batch):
        """``nan_policy="omit"``: NaN and inf lie outside every (finite) range, so each is skipped where it
        stands as without a policy (the weighted form too; ``Weighted`` skips a row of NaN or inf weight)."""
        return batch

    def add_keyed(self, acc, batch, mask, keys, num_keys):
        return self._counted(acc, self._binned(batch, mask, keys, num_keys, jnp.int32))

    def _counted(self, acc, counts):
        if self.model_shards > 1:
            return acc._replace(counts=wide.add_int32(acc.counts, counts))
        return wide.add_int32(acc, counts)

    def _binned(self, x, mask, keys, num_keys, dtype, weights=None):
        """The micro-batch's counts (or ``weights``' sums) per bin: ``(d, bins)``, or
        ``(num_keys, d, bins)`` by ``keys``."""
        flat, keep = self._bins(x, mask)
        d = flat.shape[1]
        if keys is not None:
            flat = flat + keys[:, None] * (d * self.bins)
        value = keep.astype(dtype) if weights is None else jnp.where(keep, weights[:, None].astype(dtype), 0)
        sums = jnp.zeros(num_keys * d * self.bins, dtype).at[flat.reshape(-1)].add(value.reshape(-1))
        return sums.reshape((d, self.bins) if keys is None else (num_keys, d, self.bins))

    def weighted(self):
        return WeightedHistogram(self.bins, self.range, self.bound, self.model_shards)

    def convert(self, acc, source):
        """Between whole counts and counts split over ``model`` (a resume on a mesh with other axes)."""
        acc = unsplit(acc) if source.model_shards > 1 else acc
        if self.model_shards == 1:
            return acc
        d = acc.limbs.shape[0]
        limbs = padded_columns(acc.limbs, d, round_up(d, self.model_shards))
        return SplitCounts(wide.Wide(limbs), jnp.zeros((d,), jnp.int8))

    def finalize(self, acc):
        counts = wide.to_int(unsplit(acc) if self.model_shards > 1 else acc)
        edges = self._edges(counts.shape[0])
        return HistogramResult(counts, edges if np.ndim(self.range) == 2 else edges[0])

    def fingerprint(self):
        return {"combiner": "Histogram", "bins": repr(self.bins), "range": repr(np.asarray(self.range).tolist())}


@dataclasses.dataclass(frozen=True, eq=False)
class WeightedHistogram(Histogram):
    """``Histogram(...).weighted()``: on rows ``(w, X)``, the weights' sums per bin (float), like
    ``np.histogram(x, bins, range, weights=w)``; takes the same operands (the edges) as the histogram.
    On a mesh with ``model`` its sums and edges split by columns as the counts do (:class:`SplitSums`);
    the weights, one a row, stay whole."""

    def check_spec(self, spec):
        super().check_spec(spec[1])

    def operands(self, spec):
        return super().operands(spec[1])

    def partition(self, mesh: Mesh):
        return SplitSums(P(MODEL_AXIS), P()) if self.model_shards > 1 else None

    def init(self, spec):
        w, x = spec
        d = x.shape[0]
        if self.model_shards > 1:
            return SplitSums(jnp.zeros((round_up(d, self.model_shards), self.bins), w.dtype),
                             jnp.zeros((d,), jnp.int8))
        return jnp.zeros((d, self.bins), w.dtype)

    def add(self, acc, batch, mask):
        w, x = batch
        return self._summed(acc, lambda dtype: self._binned(x, mask, None, 1, dtype, w))

    def add_keyed(self, acc, batch, mask, keys, num_keys):
        w, x = batch
        return self._summed(acc, lambda dtype: self._binned(x, mask, keys, num_keys, dtype, w))

    def _summed(self, acc, sums):
        """``acc`` plus the micro-batch's ``sums(dtype)`` (this device's columns where split)."""
        if self.model_shards > 1:
            return acc._replace(sums=acc.sums + sums(acc.sums.dtype))
        return acc + sums(acc.dtype)

    def weighted(self):
        return Combiner.weighted(self)

    def convert(self, acc, source):
        """Between whole sums and sums split over ``model`` (a resume on a mesh with other axes)."""
        acc = unsplit_sums(acc) if source.model_shards > 1 else acc
        if self.model_shards == 1:
            return acc
        d = acc.shape[0]
        return SplitSums(padded_columns(acc, d, round_up(d, self.model_shards)), jnp.zeros((d,), jnp.int8))

    def finalize(self, acc):
        acc = np.asarray(unsplit_sums(acc) if self.model_shards > 1 else acc)
        edges = self._edges(acc.shape[0])
        return HistogramResult(acc, edges if np.ndim(self.range) == 2 else edges[0])
