"""The most frequent values of each column with their counts: a mergeable frequent-items summary.

Each column keeps at most ``capacity`` monitored values, each with two exact integers:
``count``, the rows holding it since it was (last) taken in, and ``slack``, a bound on
its rows before that; and one bound ``D`` on the rows of any value not monitored. So
every value's true count lies in ``[count, count + slack]`` (unmonitored: ``[0, D]``).

A micro-batch is counted exactly: by hashing where it holds at least 1024 rows and 2 a monitored
slot (:func:`~sharded_scan.combiners.sketches.keys.first_rows`: each row counts one at its value's first row;
whole keys are compared, so a hash collision never merges two values, and a micro-batch hashing
leaves unresolved is sorted), else sorted and run-length encoded; monitored values
add theirs, new values come in with ``slack = D``, and the ``capacity`` candidates with
the largest ``count + slack`` are kept (ties: the lower index, ``lax.top_k``'s choice); ``D``
becomes the largest ``count + slack`` dropped. Partials merge the same way (a value missing on
one side takes that side's ``D`` as slack; ``D`` adds). This is Misra-Gries (Agarwal et al.'s
mergeable summaries: ``D <= rows / (capacity + 1)``) with each value's ``count`` kept exact since
it came in, so a value monitored from its first row, as frequent values are, has its exact count.
A micro-batch of ``SELECT_ROWS`` rows or more (of counts, not weights) chooses with no sort
(:func:`_select`): the ``capacity``-th largest score is checked by two counts against three
guesses (in a full summary's steady state it is a new value's ``1 + D`` or ``2 + D``), found bit
by bit where they miss, and the chosen are ranked into the slots by one running sum.

The top ``k`` are the monitored values with the largest ``count``; ``certain`` says the
``k``-th count is at least every other value's upper bound, so that they are a true top
``k``. Keys are the values' 32-bit keys, 64-bit ones for 64-bit values
(:mod:`~sharded_scan.combiners.sketches.keys`: exact, so int64 ids are never merged); strings
can be counted by their :func:`hash_strings` ids: a tabular source's string column is read so,
and the result then lists the strings (:mod:`~sharded_scan.combiners.sketches.topk_strings`; ties in id order).

``Weighted(TopK(...))`` counts sums of weights, in floats, by the same summary (:class:`WeightedTopK`);
``GroupBy(TopK(...), K)`` keeps a summary per key (:meth:`TopK.add_keyed`). Each column's summary
folds and merges alone, so on a ``model`` axis the columns are split over its devices
(:mod:`~sharded_scan.combiners.column_split`), the weighted and per-key forms' too.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sharded_scan.combiners import wide
from sharded_scan.combiners.base import Combiner
from sharded_scan.combiners.column_split import SplitsEachColumn
from sharded_scan.combiners.results import frame
from sharded_scan.combiners.sketches.datasketches import frequent_items_sketches, frequent_state
from sharded_scan.combiners.sketches.keys import (
    check_column_spec,
    columns,
    decode,
    fill,
    finite_cells,
    first_rows,
    fold_groups,
    fold_if_any,
    hash_fits,
    is_float,
    key_dtype,
    kind_code,
    masked_columns,
    real_values,
    run_window,
    running_min,
    running_sum,
    sort_by_key,
    to_keys,
)
from sharded_scan.combiners.wide import Wide
from sharded_scan.combiners.wide_order import masked_max, maximum
from sharded_scan.errors import UsageError

DEFAULT_K = 10
DEFAULT_CAPACITY = 4096
LIMBS = 3
SELECT_ROWS = 1024  # micro-batches of at least this many rows choose by _select; smaller ones, merges and weights
# by lax.top_k, whose program compiles in ~0.3 CPU-s less (tests' micro-batches) and costs little at that size
HASH_ROWS_PER_SLOT = 2  # micro-batches of at least this many rows a monitored slot (and SELECT_ROWS) count their
# values by hashing (keys.first_rows), the rest by a sort: each micro-batch hashes the monitored keys again too, so
# a hash of 16384 rows against 4096 slots is 1.6-1.9x faster than the sort, equal at 4096 rows, slower below
MICROBATCH_PER_SLOT = 16  # a job's default micro-batch holds at least this many values a monitored slot (its
# columns' values: d columns, 1/d the rows), at most MICROBATCH_VALUES: each micro-batch hashes the monitored keys
# again and chooses capacity of capacity + m, costs more rows amortize, but a larger hash table leaves the caches
# (bench/README.md: 1 int64 column, 4096 slots: 65536 rows 1.2x faster than 16384, 131072 no faster under load; 8
# float64 columns: 16384 rows, as before, 1.7x faster than 65536; 16384 slots: 262144 rows 2.3x faster than 16384)
MICROBATCH_VALUES = 1 << 20


class TopKResult(NamedTuple):
    """Per column, the ``k`` most frequent values, most frequent first (ties: smaller value first).

    ``values`` ``(d, k)`` (``(k,)`` for rows of one value): int64 for integer columns (uint64: uint64), float64
    for float ones; a column with fewer than ``k`` values has empty slots last, with
    ``counts`` 0 (and value 0, or NaN for floats). ``counts`` int64 (rows counted: at most the true count),
    ``errors`` int64 (the true count is at most ``counts + errors``), ``bound`` int64
    ``(d,)``: no value left out has more rows, and ``certain``: the values listed are a
    true top ``k`` (their smallest count is at least ``bound``).
    """

    values: np.ndarray
    counts: np.ndarray
    errors: np.ndarray
    bound: np.ndarray
    certain: np.ndarray
    sketch: np.ndarray | None = None  # the merged summary, a record per column: what to_datasketches writes
    columns: np.ndarray | None = None  # X's column names (a DataFrame, Parquet, CSV), else np.arange(d)

    def to_datasketches(self) -> list[bytes] | bytes:
        """Per column, the bytes of an Apache DataSketches Frequent Items sketch of the column's summary.

        ``datasketches.frequent_items_sketch.deserialize(b, PyLongsSerDe())`` reads an integer
        column's (``PyDoublesSerDe()``: a float column's), ``frequent_strings_sketch.deserialize``
        a string column's; their bounds hold every true count. A list of ``d`` bytes (one bytes
        for rows of one value).
        """
        blobs = frequent_items_sketches(self)
        return blobs[0] if np.ndim(self.counts) == 1 else blobs

    def to_pandas(self):
        """A DataFrame indexed by ``(column, rank)``, rank 0 the most frequent: ``values``,
        ``counts``, ``errors`` and the column's ``bound`` and ``certain``; no empty slots."""
        table = frame(self, ("values", "counts", "errors", "bound", "certain"),
                      long=("rank", ("values", "counts", "errors")))
        return table[table["counts"] > 0]


class TopKAcc(NamedTuple):
    """Monitored keys (the first ``held`` of each column valid), their counts and slacks, and ``D``."""

    keys: jax.Array   # uint32 or uint64 (d, capacity)
    count: Wide       # (d, capacity)
    slack: Wide       # (d, capacity)
    held: jax.Array   # int32 (d,) or (): monitored values
    bound: Wide       # (d,): rows of any unmonitored value, at most
    kind: jax.Array   # int32 (): keys.kind_code


def _take(w: Wide, index: jax.Array) -> Wide:
    return Wide(jnp.take_along_axis(w.limbs, index[..., None], axis=1))


def _concat(a: Wide, b: Wide) -> Wide:
    return Wide(jnp.concatenate([a.limbs, b.limbs], axis=1))


def _where(mask: jax.Array, a: Wide, b: Wide) -> Wide:
    return Wide(jnp.where(mask[..., None], a.limbs, b.limbs))


def _spread(bound: Wide, n: int) -> Wide:
    """A per-column bound ``(d,)`` repeated for ``n`` entries: ``(d, n)``."""
    limbs = bound.limbs
    return Wide(jnp.broadcast_to(limbs[:, None, :], (limbs.shape[0], n, limbs.shape[1])))


class ExactCounts:
    """TopK's counts: exact integers (:class:`~sharded_scan.combiners.wide.Wide`, ``LIMBS`` limbs)."""

    add = staticmethod(wide.add)
    take, concat = staticmethod(_take), staticmethod(_concat)
    where, spread = staticmethod(_where), staticmethod(_spread)
    score = staticmethod(wide.to_float)
    masked_max, maximum = staticmethod(masked_max), staticmethod(maximum)

    @staticmethod
    def of(x: jax.Array) -> Wide:
        return wide.of_int32(x, LIMBS)

    @staticmethod
    def zeros(shape) -> Wide:
        return wide.zeros(shape, LIMBS)

    @staticmethod
    def to_host(w: Wide) -> np.ndarray:
        return wide.to_int(w).astype(np.int64)


class WeightCounts:
    """Weighted TopK's counts: sums of weights, floats."""

    add, maximum = staticmethod(jnp.add), staticmethod(jnp.maximum)

    @staticmethod
    def concat(a, b):
        return jnp.concatenate([a, b], axis=1)

    @staticmethod
    def of(x):
        return x

    score = of

    @staticmethod
    def zeros(shape):
        return jnp.zeros(shape, jnp.float32)  # promoted to the weights' dtype where it meets them

    @staticmethod
    def take(x, index):
        return jnp.take_along_axis(x, index, axis=1)

    @staticmethod
    def where(mask, a, b):
        return jnp.where(mask, a, b)

    @staticmethod
    def spread(bound, n):
        return jnp.broadcast_to(bound[:, None], (bound.shape[0], n))

    @staticmethod
    def masked_max(x, mask):
        return jnp.max(jnp.where(mask, x, 0), axis=-1)

    @staticmethod
    def to_host(x) -> np.ndarray:
        return np.asarray(x, np.float64)


def _lookup(sorted_keys: jax.Array, held: jax.Array, queries: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per column, where each query sits in ``sorted_keys`` (its first ``held`` valid) and whether it is there."""
    at = jax.vmap(jnp.searchsorted)(sorted_keys, queries)
    found = (at < held[:, None]) & (jnp.take_along_axis(sorted_keys, jnp.minimum(at, sorted_keys.shape[1] - 1), 1)
                                     == queries)
    return at, found


def _threshold(keys: jax.Array, capacity: int) -> jax.Array:
    """Per row ``(d, 1)``, the largest ``t`` with at least ``capacity`` of ``keys`` at or above it, one
    bit at a time from the top (a count over the row each)."""
    one, width = keys.dtype.type(1), 8 * keys.dtype.itemsize

    def bit(i, t):
        trial = t | (one << (width - 1 - i).astype(keys.dtype))
        return jnp.where(jnp.sum(keys >= trial, axis=1, dtype=jnp.int32)[:, None] >= capacity, trial, t)

    return jax.lax.fori_loop(0, width, bit, keys[:, :1] & 0)  # zeros, varying as keys do in shard_map


def _select(score: jax.Array, valid: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per row, the ``capacity`` valid entries with the largest ``score`` (ties: the lower index; all valid
    ones where fewer), ``lax.top_k``'s choice, with no sort: their indices in order in ``capacity`` slots
    (the rest 0), which slots hold one, and the ``(d, n)`` mask of those chosen.

    The ``capacity``-th largest score ``t`` is first tried among three guesses, each checked exactly
    by two counts: the smallest score of each part (the first ``capacity`` entries, the rest) and
    the next of the rest, which it is in a full summary's steady state (a new value's ``1 + D``, a
    stale monitored one's, or a value's ``2 + D`` where most of the micro-batch's are monitored);
    where all valid entries fit, every one is chosen; else (a row's guesses miss) it is found bit by
    bit (:func:`_threshold`). Then one running sum ranks the chosen into the slots in index order.
    """
    keys = jnp.where(valid, jnp.maximum(to_keys(score), 1), 0)  # invalid: 0, below every valid score
    top = keys.dtype.type(np.iinfo(keys.dtype).max)
    old, new = keys[:, :capacity], keys[:, capacity:]
    least = jnp.min(jnp.where(new > 0, new, top), axis=1, keepdims=True)
    guess = jnp.concatenate([jnp.min(jnp.where(old > 0, old, top), axis=1, keepdims=True), least,  # (d, 3)
                             jnp.min(jnp.where(new > least, new, top), axis=1, keepdims=True)], axis=1)
    at_least = jnp.sum(keys[:, None, :] >= guess[:, :, None], axis=2, dtype=jnp.int32)
    more = jnp.sum(keys[:, None, :] > guess[:, :, None], axis=2, dtype=jnp.int32)
    right = (at_least >= capacity) & (more < capacity)  # so guess == t: at least one key equals it
    fits = jnp.sum(valid, axis=1, dtype=jnp.int32) <= capacity  # t = 0: every valid entry chosen
    t = jnp.take_along_axis(guess, jnp.argmax(right, axis=1, keepdims=True), axis=1)
    t = jnp.where(fits[:, None], keys.dtype.type(0), t)
    found = (fits | jnp.any(right, axis=1))[:, None]

    t = jax.lax.cond(jnp.all(found), lambda: t, lambda: jnp.where(found, t, _threshold(keys, capacity)))
    above, tie = keys > t, valid & (keys == t)
    if keys.shape[1] < 1 << 15:  # both ranks from one running sum: ties counted in the upper bits
        ranked = running_sum(above.astype(jnp.int32) | (tie.astype(jnp.int32) << 15))
        ranked_above, ranked_tie = ranked & 0x7FFF, ranked >> 15
    else:
        ranked_above, ranked_tie = (running_sum(m.astype(jnp.int32)) for m in (above, tie))
    need = capacity - ranked_above[:, -1:]  # ties taken, lowest index first
    chosen = above | (tie & (ranked_tie <= need))
    slot = jnp.where(chosen, ranked_above + jnp.minimum(ranked_tie, need) - 1, capacity)
    iota = jnp.broadcast_to(jnp.arange(keys.shape[1], dtype=jnp.int32), keys.shape)
    rows = jnp.arange(keys.shape[0])[:, None]
    index = jnp.zeros((keys.shape[0], capacity), jnp.int32).at[rows, slot].set(iota, mode="drop")
    taken = ranked_above[:, -1:] + jnp.minimum(ranked_tie[:, -1:], need)
    return index, jnp.arange(capacity) < taken, chosen


def _top_k(score: jax.Array, valid: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`_select`'s choice by ``lax.top_k``, in order of score: fewer ops to compile, slower to run."""
    _, index = jax.lax.top_k(jnp.where(valid, score, -1.0), capacity)
    chosen = jnp.zeros(valid.shape, bool).at[jnp.arange(valid.shape[0])[:, None], index].set(True)
    return index, jnp.take_along_axis(valid, index, axis=1), chosen


def keep_largest(keys, count: Wide, slack: Wide, valid, bound: Wide, capacity: int, counts=ExactCounts):
    """The ``capacity`` valid candidates with the largest ``count + slack`` per column, and the new ``D``.

    Returns ``(keys, count, slack, held, bound)``; the kept entries come first. ``counts``: the
    arithmetic of the counts (:class:`ExactCounts` or :class:`WeightCounts`). Chosen by ``lax.top_k``; a
    micro-batch of at least ``SELECT_ROWS`` rows of counts is kept by :func:`keep_with_new`, by :func:`_select`:
    the same entries (their order differs, which nothing reads).
    """
    high = counts.add(count, slack)
    index, kept, chosen = _top_k(counts.score(high), valid, capacity)  # float only chooses; the bounds stay exact
    bound = counts.maximum(bound, counts.masked_max(high, valid & ~chosen))
    zero = counts.zeros(kept.shape)
    return (
        jnp.where(kept, jnp.take_along_axis(keys, index, axis=1), fill(keys.dtype)),
        counts.where(kept, counts.take(count, index), zero), counts.where(kept, counts.take(slack, index), zero),
        jnp.sum(kept, axis=1, dtype=jnp.int32), bound,
    )


def keep_with_new(keys, count: Wide, slack: Wide, runs: jax.Array, valid, bound: Wide, capacity: int):
    """:func:`keep_largest`'s entries, counts and bound (exact counts), chosen by :func:`_select`, of the
    monitored entries then a micro-batch's: ``keys`` ``(d, capacity + m)``; the monitored ones' ``count`` and
    ``slack`` ``(d, capacity)``; the micro-batch's ``runs`` ``(d, m)``, int32 rows, each with ``slack = bound``.
    The micro-batch's part stays int32 (its largest dropped ``count + slack`` is ``bound`` + its largest run),
    so only ``capacity`` entries carry limbs (concatenated, gathered, their largest taken), not ``capacity + m``."""
    cap = count.limbs.shape[1]
    high, high_new = wide.add(count, slack), wide.add(wide.of_int32(runs, LIMBS), _spread(bound, runs.shape[1]))
    score = jnp.concatenate([wide.to_float(high), wide.to_float(high_new)], axis=1)
    index, kept, chosen = _select(score, valid, capacity)
    dropped = valid & ~chosen
    dropped_new = dropped[:, cap:]
    most = jnp.max(jnp.where(dropped_new, runs, 0), axis=1)
    largest_new = _where(jnp.any(dropped_new, axis=1), wide.add(wide.of_int32(most, LIMBS), bound),
                         wide.zeros(most.shape, LIMBS))
    new_bound = maximum(bound, maximum(masked_max(high, dropped[:, :cap]), largest_new))
    old = index < cap
    at_old, at_new = jnp.minimum(index, cap - 1), jnp.maximum(index - cap, 0)
    zero = wide.zeros(kept.shape, LIMBS)
    count = _where(old, _take(count, at_old), wide.of_int32(jnp.take_along_axis(runs, at_new, axis=1), LIMBS))
    slack = _where(old, _take(slack, at_old), _spread(bound, capacity))
    return (
        jnp.where(kept, jnp.take_along_axis(keys, index, axis=1), fill(keys.dtype)),
        _where(kept, count, zero), _where(kept, slack, zero), jnp.sum(kept, axis=1, dtype=jnp.int32), new_bound,
    )


@dataclasses.dataclass(frozen=True)
class TopK(SplitsEachColumn, Combiner):
    """The ``k`` most frequent values of each column and their counts (pandas' ``value_counts().head(k)``).

    Args:
      k: how many values to return per column.
      capacity: values monitored per column (the accuracy knob; at least ``k``): a value
        with more than ``rows / (capacity + 1)`` rows is always among them, and on
        Zipf(1.1) data the default 4096 returns the exact top 100 with exact counts
        (``python bench/sketches.py``).

    Values are compared as ``np.unique`` does: ``-0.0`` is ``0.0`` and all NaNs are one
    value (``nan_policy="propagate"``); ``"omit"`` skips each NaN or Inf where it stands (pandas'
    ``value_counts()``), ``"omit_rows"`` every row holding one.

    On a mesh with a ``model`` axis of size M (set by :meth:`for_mesh`, ``model_shards``) the
    summaries are split by columns: each device holds and counts ``ceil(d / M)`` of them (padded
    with empty ones), so the result is bitwise that of a mesh without ``model`` and the same shards.
    """

    k: int = DEFAULT_K
    capacity: int = DEFAULT_CAPACITY
    model_shards: int = 1  # set by for_mesh: above 1 each model device counts its block of the columns
    takes_string_ids = True  # a string column's values: the source maps the top ids back to strings
    counts = ExactCounts
    state_type, shared = TopKAcc, ("kind",)  # split over model: a summary per column (column_split)

    @property
    def microbatch_values(self) -> int:
        return min(MICROBATCH_PER_SLOT * self.capacity, MICROBATCH_VALUES)

    def __post_init__(self):
        for name in ("k", "capacity"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise UsageError(f"TopK {name} must be a positive integer, got {name}={value!r}.")
        if self.capacity < self.k:
            raise UsageError(f"TopK capacity ({self.capacity}) must be at least k ({self.k}); raise capacity.")

    def check_spec(self, spec):
        check_column_spec(spec, "TopK")

    def init(self, spec):
        return self.split(self.whole.init(spec)) if self.model_shards > 1 else self._init(spec)

    def _init(self, spec):
        """The whole summaries' identity."""
        d, c, keys = (spec.shape[0] if spec.shape else 1), self.capacity, key_dtype(spec.dtype)
        return TopKAcc(
            jnp.full((d, c), fill(keys), keys), wide.zeros((d, c), LIMBS), wide.zeros((d, c), LIMBS),
            jnp.zeros(spec.shape, jnp.int32), wide.zeros((d,), LIMBS), kind_code(spec.dtype),
        )

    def add(self, acc, batch, mask):
        if self.model_shards > 1:
            return acc._replace(value=self.whole.add(acc.value, self.own(batch), mask))
        return fold_if_any(mask, lambda acc: self._add(acc, batch, mask), acc)

    def _add(self, acc, batch, mask):
        """Folds the rows ``mask`` ``(mb,)``, or each column's own values ``mask`` ``(d, mb)`` (:meth:`add_finite`)."""
        mb = mask.shape[-1]
        if mb < max(SELECT_ROWS, HASH_ROWS_PER_SLOT * self.capacity) or not hash_fits(acc.keys.shape[0],
                                                                                        self.capacity + mb):
            return self._add_by_sort(acc, batch, mask)
        # XLA:TPU's scatters and gathers are slower than its sort: a micro-batch hashed took 1.2-2.5x the sort's time
        # on a TPU v5e, where on XLA:CPU hashing is 1.4-1.7x faster (bench/README.md, "Top-k ... hashing").
        return jax.lax.platform_dependent(acc, batch, mask, tpu=self._add_by_sort, default=self._add_by_hash)

    def _add_by_hash(self, acc, batch, mask):
        mb = mask.shape[-1]
        keys = jnp.concatenate([acc.keys, columns(batch)], axis=1)
        valid = jnp.concatenate([self._monitored(acc), jnp.broadcast_to(mask, (keys.shape[0], mb))], axis=1)
        rep, resolved = first_rows(keys, valid)
        return jax.lax.cond(resolved, lambda: self._add_hashed(acc, keys, valid, rep),
                            lambda: self._add_by_sort(acc, batch, mask))

    def _add_by_sort(self, acc, batch, mask):
        return self._add_sorted(acc, jnp.sort(masked_columns(batch, mask), axis=1),
                                jnp.sum(mask, axis=-1, dtype=jnp.int32))

    def _monitored(self, acc):
        return jnp.arange(self.capacity)[None, :] < acc.held.reshape(-1)[:, None]

    def _add_hashed(self, acc, keys, valid, rep):
        """Folds a micro-batch whose rows' first rows ``rep`` were found by hashing (:func:`~.keys.first_rows`)
        over ``keys``, the monitored keys then the micro-batch's: each row counts one at its key's first row,
        so a monitored key's count is its rows in the micro-batch, and a new value's sits at its first row."""
        d, n = keys.shape
        cap, c = self.capacity, self.counts
        pos = jnp.arange(n, dtype=jnp.int32)
        batch_row = valid & (pos >= cap)
        runs = jnp.zeros((d, n), jnp.int32).at[jnp.arange(d)[:, None], jnp.where(batch_row, rep, n)].add(
            1, mode="drop")
        keys, count, slack, held, bound = keep_with_new(
            keys, c.add(acc.count, c.of(runs[:, :cap])), acc.slack, runs[:, cap:],
            valid & ((pos < cap) | (rep == pos)), acc.bound, cap,
        )
        return TopKAcc(keys, count, slack, held.reshape(acc.held.shape), bound, acc.kind)

    def _add_sorted(self, acc, s, real, weights=None):
        """Folds keys ``s`` ``(d, mb)`` sorted per column, the first ``real`` real (``(d,)``: each column's own,
        :meth:`add_finite`; a column of none keeps its summary as it was: nothing is dropped, and the slots keep their
        order, :func:`_select`'s, or ``lax.top_k``'s, which finds them ranked already); with their ``weights``, for
        the weighted form: each value then counts the sum of its rows' weights."""
        d, mb = s.shape
        c = self.counts
        end = real[:, None] if jnp.ndim(real) else real
        pos = jnp.arange(mb, dtype=jnp.int32)
        first = (pos < end) & jnp.concatenate([jnp.ones((d, 1), bool), s[:, 1:] != s[:, :-1]], axis=1)
        if weights is None:
            later = running_min(jnp.where(first, pos, end), axis=1, reverse=True)  # next run start at or after
            run_end = jnp.concatenate([later[:, 1:], jnp.full((d, 1), end)], axis=1)
            runs = jnp.where(first, run_end - pos, 0)  # rows of each value, at its first row
        else:
            run = jnp.maximum(running_sum(first.astype(jnp.int32)) - 1, 0)  # each row's run
            sums = jax.vmap(lambda w, r: jax.ops.segment_sum(w, r, mb))(weights, run)
            runs = jnp.where(first, jnp.take_along_axis(sums, run, axis=1), 0)
        monitored = self._monitored(acc)
        at, hit = _lookup(s, jnp.full((d,), real), acc.keys)
        hit &= monitored
        count = c.add(acc.count, c.of(jnp.where(hit, jnp.take_along_axis(runs, jnp.minimum(at, mb - 1), 1), 0)))
        # A monitored key found in the batch sits at its run's first row: those runs are known.
        known = jnp.zeros((d, mb), bool).at[jnp.arange(d)[:, None], jnp.where(hit, at, mb)].set(True, mode="drop")
        keys, valid = jnp.concatenate([acc.keys, s], axis=1), jnp.concatenate([monitored, first & ~known], axis=1)
        if mb >= SELECT_ROWS and weights is None:  # sums of weights: no guess
            keys, count, slack, held, bound = keep_with_new(keys, count, acc.slack, runs, valid, acc.bound,
                                                            self.capacity)
        else:
            keys, count, slack, held, bound = keep_largest(
                keys, c.concat(count, c.of(runs)), c.concat(acc.slack, c.spread(acc.bound, mb)), valid, acc.bound,
                self.capacity, c)
        return TopKAcc(keys, count, slack, held.reshape(acc.held.shape), bound, acc.kind)

    def omitting_values(self):
        """``self``: under ``nan_policy="omit"`` each column's summary folds its own finite values
        (:meth:`add_finite`), a NaN or Inf skipped where it stands, the row's other values kept."""
        return self

    def _values(self, batch):
        """The values counted of a micro-batch (the weighted form's: its data, not its weights)."""
        return batch

    def _cells(self, batch, keep):
        """What :meth:`add_finite` folds of the rows ``keep`` (:func:`~.keys.finite_cells` of the values counted)."""
        return finite_cells(self._values(batch), keep)

    def finite_keep(self, batch, keep):
        """Every row of ``keep`` is folded: its NaN and Inf values are skipped where they stand."""
        return keep

    def add_finite(self, acc, batch, mask, keep):
        """``nan_policy="omit"`` (pandas' ``value_counts()``): each column's summary folds the finite values of
        the rows ``keep``, by a mask per column ``(d, mb)`` where ``add`` takes one per row (the same hash, sort
        and choice, no ``jax.vmap``: a one-column state folded alone would be the same summary)."""
        if self.model_shards > 1:
            return acc._replace(value=self.whole.add_finite(acc.value, self.own(batch), mask, keep))
        cells = self._cells(batch, keep)
        return fold_if_any(cells, lambda acc: self._add(acc, batch, cells), acc)

    def add_keyed(self, acc, batch, mask, keys, num_keys):
        """A summary per key: the micro-batch sorted by (key, value) once, then each key present folds its
        rows, at most ``capacity`` at a time (:func:`~.keys.fold_groups`)."""
        if self.model_shards > 1:
            return acc._replace(value=self.whole.add_keyed(acc.value, self.own(batch), mask, keys, num_keys))
        return self._add_keyed(acc, batch, mask, keys, num_keys)

    def add_keyed_finite(self, acc, batch, mask, keep, keys, num_keys):
        """:meth:`add_finite` per key: a key's rows sorted by value, each column's NaN and Inf (as the
        filler, which sorts last) after its finite values, which each window of its rows folds."""
        if self.model_shards > 1:
            value = self.whole.add_keyed_finite(acc.value, self.own(batch), mask, keep, keys, num_keys)
            return acc._replace(value=value)
        cells = self._cells(batch, keep)
        return self._add_keyed(acc, batch, keep, keys, num_keys, None if cells.ndim == 1 else cells)

    def _add_keyed(self, acc, batch, mask, keys, num_keys, cells=None):
        """``cells``: each column's values to fold ``(d, mb)`` (:meth:`_cells`: float columns), else the rows
        ``mask``."""
        groups, cols = sort_by_key(masked_columns(batch, mask if cells is None else cells), mask, keys, num_keys)
        width = min(cols.shape[1], self.capacity)

        def fold(one, start, n):
            window = run_window(cols, start, n, width)
            return self._add_sorted(one, window, n if cells is None else real_values(window))

        return fold_groups(fold, acc, groups, num_keys, width)

    def weighted(self):
        return WeightedTopK(self.k, self.capacity, self.model_shards)

    def merge(self, a, b):
        if self.model_shards > 1:  # column by column: each device merges its own columns
            return a._replace(value=self.whole.merge(a.value, b.value))
        c, counts = self.capacity, self.counts
        a_held, b_held = a.held.reshape(-1), b.held.reshape(-1)
        slots = jnp.arange(c)[None, :]
        a_valid, b_valid = slots < a_held[:, None], slots < b_held[:, None]
        b_order = jnp.argsort(b.keys, axis=1)
        at, in_b = _lookup(jnp.take_along_axis(b.keys, b_order, 1), b_held, a.keys)
        in_b &= a_valid
        partner = jnp.take_along_axis(b_order, jnp.minimum(at, c - 1), 1)
        a_count = counts.add(a.count, counts.where(in_b, counts.take(b.count, partner), counts.zeros(in_b.shape)))
        a_slack = counts.add(a.slack, counts.where(in_b, counts.take(b.slack, partner), counts.spread(b.bound, c)))
        _, in_a = _lookup(jnp.sort(a.keys, axis=1), a_held, b.keys)
        b_slack = counts.add(b.slack, counts.spread(a.bound, c))
        keys, count, slack, held, bound = keep_largest(
            jnp.concatenate([a.keys, b.keys], axis=1), counts.concat(a_count, b.count), counts.concat(a_slack, b_slack),
            jnp.concatenate([a_valid, b_valid & ~in_a], axis=1), counts.add(a.bound, b.bound), c, counts,
        )
        return TopKAcc(keys, count, slack, held.reshape(a.held.shape), bound, a.kind)

    def _sketch(self, acc):
        """The per-column records DataSketches' Frequent Items bytes are written from."""
        return frequent_state(acc)

    def finalize(self, acc):
        if self.model_shards > 1:
            return self.whole.finalize(self.unsplit(acc))
        keys, to_host = np.asarray(acc.keys), self.counts.to_host
        count, slack = to_host(acc.count), to_host(acc.slack)
        held, bound = np.asarray(acc.held).reshape(-1), to_host(acc.bound).reshape(-1)
        d, k, kind = keys.shape[0], self.k, count.dtype
        integers = decode(keys[0, :0], acc.kind).dtype  # integers stay: int64, uint64 for uint64 columns
        values = np.full((d, k), np.nan) if is_float(acc.kind) else np.zeros((d, k), integers)
        counts, errors = np.zeros((d, k), kind), np.zeros((d, k), kind)
        bounds, certain = np.zeros(d, kind), np.zeros(d, bool)
        for j in range(d):
            n = int(held[j])
            order = np.lexsort((keys[j, :n], -count[j, :n]))
            top, rest = order[:k], order[k:]
            values[j, : len(top)] = decode(keys[j, top], acc.kind)
            counts[j, : len(top)], errors[j, : len(top)] = count[j, top], slack[j, top]
            bounds[j] = max(bound[j], (count[j, rest] + slack[j, rest]).max(initial=0))
            certain[j] = len(top) == 0 or counts[j, len(top) - 1] >= bounds[j]
        sketch = self._sketch(acc)
        if np.ndim(acc.held) == 0:
            return TopKResult(values[0], counts[0], errors[0], bounds[0], certain[0], sketch)
        return TopKResult(values, counts, errors, bounds, certain, sketch)


@dataclasses.dataclass(frozen=True)
class WeightedTopK(TopK):
    """``TopK(k, capacity).weighted()``: on rows ``(w, X)``, the ``k`` values of each column with the
    largest sums of weights (pandas' ``df.groupby(x)[w].sum().nlargest(k)``), by the same summary with
    float counts: ``counts`` (float64) is a value's weight since it was monitored, at most its true
    weight, which is at most ``counts + errors``; no value left out weighs more than ``bound``, and a
    value weighing more than the total weight over ``capacity + 1`` is always monitored (up to float
    rounding of the sums)."""

    counts = WeightCounts

    def _sketch(self, acc):
        return None  # sums of weights: DataSketches' Frequent Items counts are integers

    def check_spec(self, spec):
        super().check_spec(spec[1])

    def _init(self, spec):
        w, x = spec
        acc = super()._init(x)
        return acc._replace(count=jnp.zeros(acc.keys.shape, w.dtype), slack=jnp.zeros(acc.keys.shape, w.dtype),
                            bound=jnp.zeros(acc.keys.shape[:1], w.dtype))

    def own(self, batch):
        w, x = batch
        return w, super().own(x)

    def _values(self, batch):
        return batch[1]

    def columns_spec(self, acc, n):
        return jax.ShapeDtypeStruct((), acc.count.dtype), super().columns_spec(acc, n)

    def _sorted(self, batch, mask):
        w, x = batch
        cols = masked_columns(x, mask)
        return cols, jnp.broadcast_to(jnp.where(mask, w, 0), cols.shape)

    def _add(self, acc, batch, mask):
        s, weights = jax.lax.sort(self._sorted(batch, mask), dimension=1, num_keys=1)
        return self._add_sorted(acc, s, jnp.sum(mask, axis=-1, dtype=jnp.int32), weights)

    def _add_keyed(self, acc, batch, mask, keys, num_keys, cells=None):
        cols, weights = self._sorted(batch, mask if cells is None else cells)
        groups, cols, weights = sort_by_key(cols, mask, keys, num_keys, weights)

        width = min(cols.shape[1], self.capacity)

        def fold(one, start, n):
            window = run_window(cols, start, n, width)
            return self._add_sorted(one, window, n if cells is None else real_values(window),
                                    run_window(weights, start, n, width))

        return fold_groups(fold, acc, groups, num_keys, width)

    weighted = Combiner.weighted  # weights do not stack
