"""Per-column quantiles from a mergeable KLL sketch, or exactly in a few passes.

``Quantiles(qs=...)`` or ``Quantiles(num_buckets=...)`` (tf.Transform's ``quantiles``
boundaries: ``q = 1/B, ..., (B-1)/B``). One pass folds every column into a
:mod:`~sharded_scan.combiners.sketches.kll` sketch of about ``3k`` items; the answer for ``q`` is
read at the estimated ranks around ``q (n - 1)`` that ``method`` names, numpy's methods
(``"linear"``, the default of numpy and pandas, interpolates between the items at ranks
``floor`` and ``ceil`` of it; ``"lower"``, the default before, answers a value of the data);
``q = 0`` and ``q = 1`` are the exact minimum and maximum. While nothing has been compacted
(about ``k`` rows per shard or fewer) the answer is exactly
``np.quantile(x, qs, axis=0, method=method)``.

``Quantiles(exact=True)`` returns exactly that for any row count: the sketch brackets
every answer by keys, then each further pass counts the rows below and in ``2^bits``
bins of every bracket and narrows it to the bin holding the wanted rank, until the
bin is one value (:mod:`~sharded_scan.combiners.sketches.quantiles_exact`; :func:`sharded_scan.run`
runs the passes).

``Weighted(Quantiles(..., method="inverted_cdf"))`` on rows ``(w, X)`` answers numpy's weighted
``inverted_cdf`` from a weighted KLL (:class:`WeightedQuantiles`, :mod:`~sharded_scan.combiners.sketches.kll_weighted`),
exactly too; ``GroupBy(Quantiles(...), K)`` keeps a sketch per key (:meth:`Quantiles.add_keyed`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from sharded_scan.combiners import wide
from sharded_scan.combiners.base import Combiner, nonfinite_as_nan
from sharded_scan.combiners.column_split import SplitsByColumns, column_block, padded_columns, round_up
from sharded_scan.combiners.passes import MultiPass
from sharded_scan.combiners.sketches import kll, kll_weighted
from sharded_scan.combiners.sketches.datasketches import kll_state
from sharded_scan.combiners.sketches.keys import (
    check_column_spec,
    fill,
    finite_keys,
    fold_groups,
    fold_if_any,
    key_dtype,
    kind_code,
    masked_columns,
    run_window,
    sort_by_key,
)
from sharded_scan.combiners.sketches.quantiles_exact import exact_passes, weighted_exact_passes
from sharded_scan.combiners.sketches.quantiles_result import (
    QuantilesAcc,
    QuantilesResult,
    WeightedQuantilesAcc,
    check_method,
    method_ranks,
    result_from_keys,
)
from sharded_scan.errors import UsageError
from sharded_scan.mesh import MODEL_AXIS

DEFAULT_K = 8192
MIN_K = 16
CONFIDENCE = 0.99


def check_qs(qs: Any, num_buckets: Any, who: str) -> tuple[float, ...]:
    """The quantiles asked for, from ``qs`` or ``num_buckets`` (exactly one), checked."""
    if (qs is None) == (num_buckets is None):
        raise UsageError(f"{who} needs exactly one of qs=[...] (values in [0, 1]) or num_buckets=B (B >= 1).")
    if num_buckets is not None:
        if isinstance(num_buckets, bool) or not isinstance(num_buckets, (int, np.integer)) or num_buckets < 1:
            raise UsageError(f"{who} num_buckets must be an integer >= 1, got num_buckets={num_buckets!r}.")
        return tuple(i / int(num_buckets) for i in range(1, int(num_buckets)))
    try:
        values = np.asarray(qs, np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise UsageError(f"{who} qs must be numbers in [0, 1], got qs={qs!r}.") from None
    if not np.all((values >= 0) & (values <= 1)):  # also refuses NaN
        raise UsageError(f"{who} qs must be numbers in [0, 1], got qs={qs!r}.")
    return tuple(float(v) for v in values)


def check_k(k: Any, who: str) -> None:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < MIN_K:
        raise UsageError(f"{who} k (the sketch size) must be an integer >= {MIN_K}, got k={k!r}.")


def extremes(acc, keys, count):
    """The accumulator's smallest and largest keys with those of keys ``(d, mb)`` sorted, the first ``count`` real."""
    largest = jnp.take(keys, count - 1, axis=1)
    return (jnp.minimum(acc.low, keys[:, 0].reshape(acc.low.shape)),
            jnp.maximum(acc.high, largest.reshape(acc.high.shape)))


def finite_extremes(acc, keys, finite):
    """:func:`extremes` of the ``finite`` ``(d,)`` first keys of each column (a column of none: no change)."""
    has = finite > 0
    first = jnp.where(has, keys[:, 0], fill(keys.dtype))
    last = jnp.where(has, jnp.take_along_axis(keys, jnp.maximum(finite - 1, 0)[:, None], axis=1)[:, 0], 0)
    return (jnp.minimum(acc.low, first.reshape(acc.low.shape).astype(keys.dtype)),
            jnp.maximum(acc.high, last.reshape(acc.high.shape).astype(keys.dtype)))


def finite_count(keys, count, kind):
    """Per column ``(d,)`` (int32): how many of the first ``count`` keys ``(d, mb)`` stand for finite values."""
    return jnp.sum(finite_keys(keys, kind) & (jnp.arange(keys.shape[1]) < count), axis=1, dtype=jnp.int32)


class SplitQuantilesAcc(NamedTuple):
    """A :class:`Quantiles` accumulator split by columns over ``model``: its columns padded
    with empty ones to a multiple of the axis size, and how many are real."""

    value: QuantilesAcc
    columns: jax.Array  # int8 zeros shaped like a row ((d,), or () for scalar rows): the real columns


def unsplit(acc: SplitQuantilesAcc) -> QuantilesAcc:
    """The whole accumulator of ``acc``: its real columns (a scalar's shapes for scalar rows)."""
    value, shape = acc.value, np.shape(acc.columns)
    real = shape[0] if shape else 1
    ends = (lambda x: x[:real]) if shape else (lambda x: x[0])
    return value._replace(sketch=value.sketch._replace(items=value.sketch.items[:real]), low=ends(value.low),
                          high=ends(value.high), count=_count_columns(value.count, lambda x: x[:real]))


def _count_columns(count: wide.Wide, fn) -> wide.Wide:
    """``fn`` of a count per column (:class:`FiniteQuantiles`': ``(d,)``); one count of every row as it is."""
    return jax.tree.map(fn, count) if np.ndim(count.limbs) > 1 else count


def split(acc: QuantilesAcc, shards: int) -> SplitQuantilesAcc:
    """``acc`` whole as split over ``shards`` ``model`` devices: padded with empty columns."""
    items, shape = acc.sketch.items, np.shape(acc.low)
    d, width = items.shape[0], round_up(items.shape[0], shards)
    ends = lambda x, value: padded_columns(jnp.reshape(x, (-1,)), d, width, value=value)  # noqa: E731
    value = acc._replace(sketch=acc.sketch._replace(items=padded_columns(items, d, width, value=fill(items.dtype))),
                         low=ends(acc.low, fill(items.dtype)), high=ends(acc.high, 0),
                         count=_count_columns(acc.count, lambda x: padded_columns(x, d, width)))
    return SplitQuantilesAcc(value, jnp.zeros(shape, jnp.int8))


@dataclasses.dataclass(frozen=True)
class Quantiles(SplitsByColumns, Combiner, MultiPass):
    """Quantiles of every column of rows X ``(n, d)`` (or of a vector), like ``np.quantile(X, qs, axis=0)``.

    Args:
      qs: the quantiles to return, each in ``[0, 1]``.
      num_buckets: instead of ``qs``: the ``num_buckets - 1`` boundaries that cut each
        column into ``num_buckets`` buckets of equal row counts (tf.Transform's
        ``quantiles``; ``num_buckets=1`` gives none).
      k: the sketch size, the accuracy knob: room for about ``4k`` keys per column
        (128 KiB at the default 8192), and a normalized rank error of a few ``1/k``: the
        result's ``rank_error`` bounds it; at the default the largest rank error over
        2001 quantiles of 10^7 rows was 1e-7 to 4.1e-4 (``python bench/sketches.py``).
      method: how an answer between two ranks is read, as ``np.quantile``'s: ``"linear"``
        (the default, numpy's and pandas'), ``"lower"`` (the default before: every answer a
        value of the data, as tf.Transform's boundaries), ``"higher"``, ``"nearest"``,
        ``"midpoint"``.
      exact: return exactly ``np.quantile(X, qs, axis=0, method=method)``, in 2 or 3
        passes over typical data (at most ``1 + ceil(32 / (bits - 1))``; 64 for 64-bit data), which
        :func:`sharded_scan.run` runs one after another.
      bits: with ``exact``, each pass after the first cuts every bracket into ``2^bits``
        bins (memory ``d * len(qs) * 2^bits`` counts).

    NaN and infinities: with ``nan_policy="propagate"`` a column holding NaN gives NaN
    (like ``np.quantile``) and infinities rank as the largest and smallest values; with
    ``"omit"`` each NaN or Inf is skipped where it stands, as ``np.nanquantile`` per column or pandas'
    ``df.quantile()`` (:class:`FiniteQuantiles`: ``count`` per column, its finite values); ``"omit_rows"`` skips
    every row holding one. ``-0.0`` and ``0.0`` count as one value.
    float64 and int64 values are ranked exactly, by 64-bit keys.

    On a mesh with a ``model`` axis of size M (set by :meth:`for_mesh`, ``model_shards``) the
    sketch is split by columns: each device holds and sorts ``ceil(d / M)`` of them (the columns
    padded with empty ones to a multiple of M), the random bits those of the whole sketch, so
    the result is bitwise that of a mesh without ``model`` and the same shards.
    """

    # qs are read on the host only: sketches that differ in qs alone compare equal and
    # share one compiled step (the fingerprint still names the qs).
    qs: Any = dataclasses.field(default=None, compare=False)
    num_buckets: int | None = None
    k: int = DEFAULT_K
    exact: bool = False
    bits: int = 10
    method: str = dataclasses.field(default="linear", compare=False)  # read on the host only, like qs
    model_shards: int = 1
    # Its add sorts the micro-batch whatever the mask: a mask-free second scan ran no faster (12 steps of 16384
    # rows x 8 columns) and added 0.6 of 2.7 CPU-s to compiling the step.
    one_scan_per_step = True
    compiles_less_when_short = True  # kll.window_sizes: no middle window in a short job

    def __post_init__(self):
        object.__setattr__(self, "qs", check_qs(self.qs, self.num_buckets, "Quantiles"))
        if self.num_buckets is not None:
            object.__setattr__(self, "num_buckets", None)  # qs now says it; one spelling per job
        check_k(self.k, "Quantiles")
        check_method(self.method, "Quantiles")
        if not isinstance(self.exact, (bool, np.bool_)):
            raise UsageError(f"Quantiles exact must be True or False, got exact={self.exact!r}.")
        bits = self.bits
        if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 2 <= bits <= 16:
            raise UsageError(f"Quantiles bits must be an integer in [2, 16], got bits={bits!r}.")

    def check_spec(self, spec):
        check_column_spec(spec, "Quantiles")

    def partition(self, mesh: Mesh):
        if self.model_shards == 1:
            return None
        sketch = kll.Sketch(P(MODEL_AXIS, None), P(), P(), P(), P())
        count = P(MODEL_AXIS) if self.per_column else P()
        return SplitQuantilesAcc(QuantilesAcc(sketch, count, P(MODEL_AXIS), P(MODEL_AXIS), P()), P())

    #: Whether ``count`` is per column (:class:`FiniteQuantiles`: each column's finite values) or every row's.
    per_column = False

    def omitting_values(self):
        """``nan_policy="omit"``: each column's quantiles of its own finite values (:class:`FiniteQuantiles`)."""
        return FiniteQuantiles(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    def init(self, spec):
        shape = spec.shape
        d, keys = (shape[0] if shape else 1), key_dtype(spec.dtype)
        if self.model_shards > 1:
            width = round_up(d, self.model_shards)
            value = self.whole.init(jax.ShapeDtypeStruct((width,), spec.dtype))
            return SplitQuantilesAcc(value, jnp.zeros(shape, jnp.int8))
        return QuantilesAcc(
            kll.empty(d, self.k, keys), wide.zeros(limbs=3), jnp.full(shape, fill(keys), keys),
            jnp.zeros(shape, keys), kind_code(spec.dtype),
        )

    def add(self, acc, batch, mask):
        return fold_if_any(mask, lambda acc: self._add(acc, batch, mask), acc)

    def _add(self, acc, batch, mask):
        cols, count = masked_columns(batch, mask), jnp.sum(mask, dtype=jnp.int32)
        if self.model_shards == 1:
            return self._add_sorted(acc, jnp.sort(cols, axis=1), count)
        own = jnp.sort(self._own(cols), axis=1)  # only this device's columns are sorted
        return acc._replace(value=self._add_sorted(acc.value, own, count, jnp.sum(cols, dtype=cols.dtype)))

    def _own(self, cols):
        """This ``model`` device's block of keys ``(d, mb)``, padded with empty columns."""
        return column_block(cols, self.model_shards, axis=0, value=fill(cols.dtype))

    def _add_sorted(self, acc, keys, count, key_sum=None):
        """Folds keys ``(d, mb)`` sorted per column, the first ``count`` real (``key_sum``: the
        sum of every column's keys where ``keys`` are this device's columns)."""
        sketch = kll.insert_sorted_rows(acc.sketch, keys, count, self.k, key_sum)
        low, high = extremes(acc, keys, count)
        return QuantilesAcc(sketch, wide.add_int32(acc.count, count), low, high, acc.kind)

    def add_keyed(self, acc, batch, mask, keys, num_keys):
        """A sketch per key: the micro-batch sorted by (key, value) once, then each key present
        inserts its rows (:func:`~.keys.fold_groups`)."""
        groups, cols = sort_by_key(masked_columns(batch, mask), mask, keys, num_keys)
        width = min(cols.shape[1], self.k)
        if self.model_shards == 1:
            return fold_groups(lambda one, start, n: self._add_sorted(one, run_window(cols, start, n, width), n), acc,
                               groups, num_keys, width)

        def fold(one, start, n):
            window = run_window(cols, start, n, width)
            return one._replace(value=self._add_sorted(one.value, self._own(window), n,
                                                          jnp.sum(window, dtype=window.dtype)))

        return fold_groups(fold, acc, groups, num_keys, width)

    def weighted(self) -> WeightedQuantiles:
        if self.method != "inverted_cdf":
            raise UsageError(
                "weighted quantiles are read from the inverse of the weighted CDF (numpy's only weighted method): "
                f"pass Quantiles(..., method='inverted_cdf') to Weighted, got method={self.method!r}."
            )
        return WeightedQuantiles(self.whole)

    def merge(self, a, b):
        if self.model_shards > 1:  # column by column: each device merges its own columns
            return SplitQuantilesAcc(self.whole.merge(a.value, b.value), a.columns)
        return QuantilesAcc(
            kll.merge(a.sketch, b.sketch, self.k), wide.add(a.count, b.count), jnp.minimum(a.low, b.low),
            jnp.maximum(a.high, b.high), a.kind,
        )

    def convert(self, acc, source):
        """Between the whole sketch and one split over ``model`` (a resume on a mesh with other axes)."""
        whole = unsplit(acc) if source.model_shards > 1 else acc
        return split(whole, self.model_shards) if self.model_shards > 1 else whole

    def finalize(self, acc):
        if self.model_shards > 1:
            return self.whole.finalize(unsplit(acc))
        return sketch_quantiles(acc, np.asarray(self.qs), self.method)._replace(sketch=kll_state(acc, self.k))

    @property
    def needs_passes(self) -> bool:
        return bool(self.exact)

    def passes(self):
        return exact_passes(self.qs, self.bits, self.method, dataclasses.replace(self, exact=False))


class FiniteQuantiles(Quantiles):
    """``Quantiles`` under ``nan_policy="omit"``: per column the quantiles of its own finite values, as
    ``np.nanquantile`` per column or pandas' ``df.quantile()``; a NaN or Inf in one column hides none of the
    row's other values. Each NaN or Inf is folded as NaN (:func:`~.base.nonfinite_as_nan`), whose key sorts
    after every value, as ``Describe`` folds its percentiles; ``count`` is per column, its finite values, and a
    column's answers are read at ranks of its own finite rows (NaN for a column of none). ``rank_error`` bounds
    every column's. Split over ``model``, weighted, per key and ``exact=True`` as ``Quantiles``."""

    per_column = True

    def omitting_values(self):
        return self

    def finite_values(self, batch):
        return nonfinite_as_nan(batch)

    def init(self, spec):
        acc = super().init(spec)
        if self.model_shards > 1:
            return acc
        return acc._replace(count=wide.zeros(acc.sketch.items.shape[:1], limbs=3))  # (d,): 1 for rows of one value

    def _add_sorted(self, acc, keys, count, key_sum=None):
        sketch = kll.insert_sorted_rows(acc.sketch, keys, count, self.k, key_sum)
        finite = finite_count(keys, count, acc.kind)
        low, high = finite_extremes(acc, keys, finite)
        return QuantilesAcc(sketch, wide.add_int32(acc.count, finite), low, high, acc.kind)

    def finalize(self, acc):
        if self.model_shards > 1:
            return self.whole.finalize(unsplit(acc))
        return finite_quantiles(acc, np.asarray(self.qs), self.method)._replace(sketch=kll_state(acc, self.k))


@dataclasses.dataclass(frozen=True)
class WeightedQuantiles(Combiner, MultiPass):
    """``Quantiles(..., method="inverted_cdf").weighted()``: on rows ``(w, X)``, per column the smallest
    value whose weight at or below it is at least ``q`` of the total, like ``np.quantile(X, qs, axis=0,
    weights=w, method="inverted_cdf")``, from a weighted KLL sketch (:mod:`~.kll_weighted`).

    While nothing has been rounded (about ``k`` rows per shard or fewer) the answer is exactly numpy's,
    but where ``q`` times the total weight falls within float rounding of a sum of weights; ``rank_error``
    bounds, with probability 0.99 per answer, ``|F(answer) - q|``, ``F`` the share of the total weight at
    or below (and, across the answer's own weight, below) it. ``q = 0`` and ``q = 1`` are the exact
    smallest and largest values of positive weight. With ``exact=True`` further passes sum the weight
    below the sketch's brackets until each answer is one value: numpy's, with the same exception.
    Under ``nan_policy="omit"`` (:class:`FiniteQuantiles`) per column: a row's weight counts for a column only
    where its value there is finite (``count`` and the total weight per column).
    """

    quantiles: Quantiles

    @property
    def needs_passes(self) -> bool:
        return bool(self.quantiles.exact)

    def passes(self):
        sketch = dataclasses.replace(self, quantiles=dataclasses.replace(self.quantiles, exact=False))
        return weighted_exact_passes(self.quantiles.qs, self.quantiles.bits, sketch)

    def check_spec(self, spec):
        self.quantiles.check_spec(spec[1])

    def omitting_values(self):
        return WeightedQuantiles(self.quantiles.omitting_values())

    def finite_values(self, batch):
        """Under ``nan_policy="omit"`` each NaN or Inf as NaN: its weight left out of its column alone."""
        return nonfinite_as_nan(batch) if self.quantiles.per_column else None

    def init(self, spec):
        w, x = spec
        one = self.quantiles.init(x)
        d = x.shape[0] if x.shape else 1
        sketch = kll_weighted.empty(d, self.quantiles.k, one.low.dtype, w.dtype)
        weight = jnp.zeros((d,) if self.quantiles.per_column else (), w.dtype)  # per column: its finite values'
        return WeightedQuantilesAcc(sketch, one.count, weight, one.low, one.high, one.kind)

    def _weights(self, w, cols, mask, kind):
        """Each row's weight in every column ``(d, mb)``: 0 for padding, and per column for a NaN (``omit``)."""
        cells = mask[None, :] & finite_keys(cols, kind) if self.quantiles.per_column else mask
        return jnp.broadcast_to(jnp.where(cells, w, 0), cols.shape)

    def add(self, acc, batch, mask):
        return fold_if_any(mask, lambda acc: self._add(acc, batch, mask), acc)

    def _add(self, acc, batch, mask):
        w, x = batch
        cols = masked_columns(x, mask)
        keys, weights = jax.lax.sort((cols, self._weights(w, cols, mask, kind_code(x.dtype))), dimension=1, num_keys=1)
        return self._add_sorted(acc, keys, weights, jnp.sum(mask, dtype=jnp.int32))

    def _add_sorted(self, acc, keys, weights, count):
        sketch = kll_weighted.insert_sorted_rows(acc.sketch, keys, weights, count, self.quantiles.k)
        if self.quantiles.per_column:
            finite = finite_count(keys, count, acc.kind)
            low, high = finite_extremes(acc, keys, finite)
            return WeightedQuantilesAcc(sketch, wide.add_int32(acc.count, finite), acc.weight + jnp.sum(weights, 1),
                                        low, high, acc.kind)
        low, high = extremes(acc, keys, count)
        total = acc.weight + jnp.sum(weights[0])
        return WeightedQuantilesAcc(sketch, wide.add_int32(acc.count, count), total, low, high, acc.kind)

    def add_keyed(self, acc, batch, mask, keys, num_keys):
        """A sketch per key, as :meth:`Quantiles.add_keyed`."""
        w, x = batch
        cols = masked_columns(x, mask)
        weights = self._weights(w, cols, mask, kind_code(x.dtype))
        groups, cols, weights = sort_by_key(cols, mask, keys, num_keys, weights)

        width = min(cols.shape[1], self.quantiles.k)

        def fold(one, start, n):
            return self._add_sorted(one, run_window(cols, start, n, width), run_window(weights, start, n, width), n)

        return fold_groups(fold, acc, groups, num_keys, width)

    def merge(self, a, b):
        return WeightedQuantilesAcc(
            kll_weighted.merge(a.sketch, b.sketch, self.quantiles.k), wide.add(a.count, b.count), a.weight + b.weight,
            jnp.minimum(a.low, b.low), jnp.maximum(a.high, b.high), a.kind,
        )

    def finalize(self, acc):
        qs = np.asarray(self.quantiles.qs)
        host = kll_weighted.to_host(acc.sketch)
        d = host.keys.shape[0]
        total = host.cumulative[:, -1:] if host.keys.shape[1] else np.ones((d, 1))
        # the first item whose cumulative weight reaches q W: past every cumulative weight below it
        picks = kll.keys_at(host, np.nextafter(qs[None, :] * total, -np.inf))
        variance = np.asarray(acc.sketch.variance, np.float64)
        bound = max((kll.rank_error_bound(float(v), float(t), CONFIDENCE) for v, t in zip(variance, total[:, 0],
                                                                                             strict=True)), default=0.0)
        rows = wide.to_int(acc.count)
        return result_from_keys(acc, qs, (picks, picks, np.zeros(picks.shape)), rows, bound, passes=1,
                                method="inverted_cdf")


def sketch_picks(host: kll.HostSketch, qs: np.ndarray, rows, method: str):
    """The sketch's keys at the ranks ``method`` reads for ``qs`` over ``rows`` values (``(d, 1)`` or
    a number), and their weights: what :func:`~.quantiles_result.result_from_keys` takes."""
    low, high, weight = method_ranks(qs, rows, method)
    shape = (host.keys.shape[0], len(qs))
    low, high = np.broadcast_to(low, shape), np.broadcast_to(high, shape)
    return kll.keys_at(host, low), kll.keys_at(host, high), weight


def sketch_quantiles(acc: QuantilesAcc, qs: np.ndarray, method: str) -> QuantilesResult:
    """The sketch's answers for ``qs`` from a merged host accumulator."""
    host = kll.to_host(acc.sketch)
    total = host.cumulative[:, -1:] if host.keys.shape[1] else np.ones((host.keys.shape[0], 1))
    rows = int(wide.to_int(acc.count))
    bound = kll.rank_error_bound(float(acc.sketch.variance), rows, CONFIDENCE)
    return result_from_keys(acc, qs, sketch_picks(host, qs, total, method), rows, bound, passes=1, method=method)


def finite_quantiles(acc: QuantilesAcc, qs: np.ndarray, method: str) -> QuantilesResult:
    """:func:`sketch_quantiles` of a :class:`FiniteQuantiles` accumulator: each column's answers read at the
    ranks of its count of finite values (its NaN's sort last), as ``Describe``'s percentiles; ``rank_error``
    the largest of the columns' (each the sketch's error in ranks over the column's values)."""
    host = kll.to_host(acc.sketch)
    rows = wide.to_int(acc.count)
    bound = max((kll.rank_error_bound(float(acc.sketch.variance), int(n), CONFIDENCE) for n in rows if n > 0),
                default=0.0)
    low, high, weight = sketch_picks(host, qs, np.asarray(rows, np.float64)[:, None], method)
    largest = np.asarray(acc.high).reshape(-1, 1)  # a NaN item past a column's finite ones is never its answer
    return result_from_keys(acc, qs, (np.minimum(low, largest), np.minimum(high, largest), weight), rows, bound,
                            passes=1, method=method)

