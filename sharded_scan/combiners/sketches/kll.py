"""A KLL quantile sketch with static shapes: the order-statistics summary behind :class:`Quantiles`.

KLL (Karnin, Lang, Liberty 2016) keeps items in levels; an item at level ``h`` stands for
``2^h`` rows. A level that reaches its capacity is *compacted*: its items are sorted,
paired, and one item of each pair (the first or the second, at random) moves up a
level with twice the weight, which moves the estimated rank of any value by ``±2^h``
or not at all, with mean zero. Capacities shrink geometrically below the top level
(``k c^(top-h)``, at least ``MIN_CAPACITY``), so the sketch holds about ``3k`` items
whatever the row count, and its rank error is about ``1/k`` (measured in
``bench/sketches.py``).

Static shapes: every column's items live in one flat ``(d, S)`` array of keys (``uint32``,
``uint64`` for 64-bit values: :mod:`sharded_scan.combiners.sketches.keys`), the levels contiguous
from level 0 up, each sorted, unused slots the filler (the largest key). Every column
sees the same rows, so how many items each level holds (``sizes``) is one vector shared
by all columns, and so is every decision of *which* level to compact; only which item
of each pair survives is chosen per column. Inserting a sorted run or compacting a level
rewrites a window of static size with one sort and splices it back with one gather.

A micro-batch is inserted as a run: its sorted keys sampled every ``2^j``-th from a
random offset, at the lowest level ``j`` whose capacity holds them. Like a compaction,
this moves ranks by less than ``2^j`` with mean zero (``j = 0`` keeps every row).
Merging two sketches inserts the other's levels as runs, one level after another.

The random bits come from a hash of a salt that every insertion and compaction moves
on, mixed with the keys being compacted: the same rows in the same order always give
the same sketch (checkpoints resume bitwise, ``logical_shards`` holds), while shards
with different rows draw different bits.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sharded_scan.combiners.base import folds_few_microbatches, folds_one_microbatch, merges_many_shards
from sharded_scan.combiners.sketches.keys import GOLDEN, empty_slot, fill, fold32, mix32

LEVELS = 48          # level h weighs 2^h: room for far more than 2^60 rows
SHRINK = 2.0 / 3.0   # KLL's capacity ratio c between a level and the one above it
MIN_CAPACITY = 8     # the capacity of the lowest levels


class Sketch(NamedTuple):
    """One shard's KLL sketch of ``d`` columns."""

    items: jax.Array     # uint32 or uint64 keys (d, S): level 0 first, each level sorted; filler past the last item
    sizes: jax.Array     # int32 (LEVELS,): items per level, the same in every column
    variance: jax.Array  # float32 (): sum of w^2 over every rounding (compaction or sampled insert) of weight w
    salt: jax.Array      # uint32 (): seed of the next random bits
    overflow: jax.Array  # bool (): a window overflowed (never expected; finalize refuses the sketch)


@functools.cache
def capacities(k: int) -> np.ndarray:
    """Capacity by distance below the top level: ``max(MIN_CAPACITY, floor(k c^i))``.

    The top level (``LEVELS - 1``) is never compacted, so its capacity is unbounded.
    """
    caps = np.array([max(MIN_CAPACITY, math.floor(k * SHRINK**i)) for i in range(LEVELS)], np.int64)
    return caps.astype(np.int32)


def flat_size(k: int) -> int:
    """Slots per column: every level one short of its capacity, plus one inserted run of ``k``."""
    return int(np.sum(capacities(k).astype(np.int64) - 1)) + k


def window_size(k: int) -> int:
    """Slots one move sorts: a level and the one above it (at most ``2k`` and ``k`` items), or a
    level and an inserted run (fewer than ``k`` and at most ``k``)."""
    return 3 * k


def empty(d: int, k: int, key_type=np.uint32) -> Sketch:
    """The sketch of no rows, of keys of ``key_type``."""
    return Sketch(
        jnp.full((d, flat_size(k)), fill(key_type), key_type), jnp.zeros((LEVELS,), jnp.int32),
        jnp.zeros((), jnp.float32), jnp.uint32(GOLDEN), jnp.zeros((), bool),
    )


def _top(sizes: jax.Array) -> jax.Array:
    """The highest level holding items (0 when empty)."""
    levels = jnp.arange(LEVELS, dtype=jnp.int32)
    return jnp.max(jnp.where(sizes > 0, levels, 0))


def level_capacities(sizes: jax.Array, k: int) -> jax.Array:
    """The capacity of every level given the current top (levels above it count as a new top)."""
    below_top = jnp.clip(_top(sizes) - jnp.arange(LEVELS, dtype=jnp.int32), 0, LEVELS - 1)
    caps = jnp.asarray(capacities(k))[below_top]
    return caps.at[LEVELS - 1].set(jnp.iinfo(jnp.int32).max)


def _starts(sizes: jax.Array) -> jax.Array:
    return jnp.cumsum(sizes) - sizes


def _padded(x: jax.Array, before: int, after: int) -> jax.Array:
    d, blank = x.shape[0], empty_slot(x.dtype)
    return jnp.concatenate([jnp.full((d, before), blank, x.dtype), x, jnp.full((d, after), blank, x.dtype)], axis=1)


def _window(items: jax.Array, start: jax.Array, size: int) -> jax.Array:
    """``items[:, start:start + size]`` (``0 <= start <= S``), the filler past the end."""
    return jax.lax.dynamic_slice_in_dim(_padded(items, 0, size), start, size, axis=1)


def _splice(items: jax.Array, total: jax.Array, start, old_len, new: jax.Array, new_len) -> jax.Array:
    """Replaces ``items[:, start:start + old_len]`` by ``new[:, :new_len]``, moving what follows.

    ``old_len`` and ``new_len`` are at most ``new``'s width.
    """
    slots, width = items.shape[1], new.shape[1]
    pos = jnp.arange(slots, dtype=jnp.int32)
    shift = new_len - old_len
    placed = jax.lax.dynamic_update_slice_in_dim(_padded(items, 0, width), new, start, axis=1)[:, :slots]
    moved = jax.lax.dynamic_slice_in_dim(_padded(items, width, width), width - shift, slots, axis=1)
    out = jnp.where(pos < start + new_len, placed, moved)
    return jnp.where(pos < total + shift, out, empty_slot(items.dtype))


def window_sizes(k: int, rows: int = 0) -> tuple[int, ...]:
    """The static window sizes one move may sort: the smallest one that holds the items moved.

    Most moves happen at low levels, whose capacities are a small part of ``k``, and fit in
    ``k/4`` slots; most of the rest (an insertion into, or a compaction of, a level below the
    top two) in ``k``; the largest holds any move (:func:`window_size`). XLA:CPU sorts a window
    whole, filler too: at the default ``k`` the ``k`` window cut a 16384-row micro-batch's
    ``add`` from 6.3 to 5.0 ms CPU (8 columns, 122 micro-batches from empty, the same sketch
    bitwise; a fourth size, ``k/2``, 4.8 ms for one more compiled move). The middle size is
    for micro-batches of ``rows >= 1024`` and ``k >= 1024``: it compiles one more move
    (0.2 s), which small micro-batches, few moves a row, do not pay back; nor a short job's steps
    (:func:`~sharded_scan.combiners.base.folds_few_microbatches`: its 0.35-0.4 CPU-s of compile is 1.3 ms of
    moves saved a micro-batch; a Describe of 200,000 rows in a fresh process, 13 micro-batches then). A step whose
    shards fold one micro-batch over the job (:func:`~sharded_scan.combiners.base.folds_one_microbatch`: a small
    job's) of more than ``k/4`` rows has the largest only: from empty, its one insertion holds more than ``k/4``
    items (``ceil(rows / 2^j)`` at the lowest level ``j`` whose capacity holds it), so the small window, compiled,
    was never taken (a Describe of 200,000 x 8 in one micro-batch: 0.06-0.09 CPU-s of compile less). A keyed add,
    an insertion a key, many and small, keeps it (:func:`~sharded_scan.combiners.base.folding_per_key`: a GroupBy
    of 200 keys ran its step 0.25-0.6 CPU-s slower without), as a micro-batch of fewer rows does (32 shards of
    1,563 rows: 2 ms a shard). Which window a move sorts in does not change the sketch.
    """
    if folds_one_microbatch() and min(k, rows) > max(16, k // 4):
        return (window_size(k),)
    middle = {k} if min(k, rows) >= 1024 and not folds_few_microbatches() else set()
    return tuple(sorted({max(16, k // 4), window_size(k)} | middle))


def _step(
    s: Sketch, level: jax.Array, runs: tuple[jax.Array, ...], run_len: jax.Array, inserting: jax.Array, k: int,
    sizes: tuple[int, ...] | None = None, move=None,
) -> Sketch:
    """One move of the sketch, in one sorted window: insert ``runs`` into ``level``, or compact ``level - 1``.

    Inserting: ``level`` holds fewer than ``k`` items; they and the run (``runs``: its keys
    ``(d, R)`` sorted, ``R <= k``, its first ``run_len`` valid; a weighted sketch's: and their
    weights) are merged. Compacting: the items of ``level - 1`` are paired, and the first or
    second of each pair (per column, at random) joins ``level``; with an odd count the largest
    stays. Both levels together hold at most ``window_size(k)`` items. ``sizes``: the windows to
    choose from (default :func:`window_sizes`; each one is compiled). ``move``: the move in one
    window (:func:`_move`; the weighted sketch's, :func:`~.kll_weighted._move`).
    """
    low_level = jnp.maximum(level - 1, 0)
    low = jnp.where(inserting, 0, s.sizes[low_level])
    up = s.sizes[level]
    need = jnp.where(inserting, up + run_len, low + up)
    sizes = sizes or window_sizes(k)
    branch = sum((need > size).astype(jnp.int32) for size in sizes[:-1])
    moves = [functools.partial(move or _move, size=size) for size in sizes]
    s = jax.lax.switch(branch, moves, s, level, low_level, low, up, *runs, run_len, inserting)
    return s._replace(overflow=s.overflow | jnp.where(inserting, up >= k, need > sizes[-1]))


def _move(s: Sketch, level, low_level, low, up, run, run_len, inserting, *, size: int) -> Sketch:
    """:func:`_step` in a window of ``size`` slots (``size`` at least the items it moves)."""
    pos = jnp.arange(size, dtype=jnp.int32)
    starts = _starts(s.sizes)
    start = jnp.where(inserting, starts[level], starts[low_level])
    win = _window(s.items, start, size)
    pairs, odd = low // 2, low % 2
    salt = mix32(s.salt ^ (level.astype(jnp.uint32) + 1) * jnp.uint32(GOLDEN))
    column_sum = fold32(jnp.sum(jnp.where(pos < low, win, 0), axis=1, dtype=win.dtype))
    choice = (mix32(salt ^ column_sum) & 1).astype(jnp.int32)[:, None]  # per column: keep pairs' 1st or 2nd
    promoted = (pos < 2 * pairs) & ((pos & 1) == choice)
    filler = fill(win.dtype)
    moving = jnp.where(promoted | ((pos >= low) & (pos < low + up)), win, filler)
    run = jnp.where((jnp.arange(run.shape[1]) < run_len) & inserting, run, filler)
    after_level = jnp.full((run.shape[0], size + run.shape[1]), filler, win.dtype)
    from_run = jax.lax.dynamic_update_slice_in_dim(after_level, run, up, axis=1)[:, :size]  # slots [up, up + R)
    merged = jnp.sort(jnp.minimum(moving, from_run), axis=1)
    leftover = jax.lax.dynamic_slice_in_dim(win, jnp.maximum(low - 1, 0), 1, axis=1)
    new = jnp.where(odd == 1, jnp.concatenate([leftover, merged[:, :-1]], axis=1), merged)
    grown = pairs + jnp.where(inserting, run_len, 0)
    items = _splice(s.items, jnp.sum(s.sizes), start, low + up, new, odd + up + grown)
    sizes = s.sizes.at[level].add(grown)
    sizes = jnp.where(inserting, sizes, sizes.at[low_level].set(odd))
    weight = jnp.exp2(low_level.astype(jnp.float32))
    return Sketch(items, sizes, s.variance + jnp.where(inserting, 0.0, weight * weight), salt, s.overflow)


def _full(s: Sketch, k: int) -> jax.Array:
    return s.sizes >= level_capacities(s.sizes, k)


def _lowest_full(s: Sketch, k: int) -> jax.Array:
    """The level a compaction moves items into: one above the lowest full level."""
    return jnp.argmax(_full(s, k)).astype(jnp.int32) + 1


def insert_sorted_rows(
    s: Sketch, keys: jax.Array, count: jax.Array, k: int, key_sum: jax.Array | None = None
) -> Sketch:
    """Inserts a micro-batch: ``keys`` ``(d, mb)`` sorted per column, the first ``count`` real.

    ``key_sum``: the sum of the micro-batch's keys over every column, where ``keys`` are only
    some of them (a sketch split by columns over ``model``): the random bits then are those
    of the whole sketch, the same on every ``model`` device.

    The rows are sampled every ``2^j``-th from a random offset (the same in every column,
    so that every column keeps the same number), ``j`` the lowest level whose capacity
    holds the sample; then full levels are compacted, lowest first, until none is.
    """
    mb = keys.shape[1]
    levels = jnp.arange(32, dtype=jnp.int32)
    sample = -((-count) >> levels)  # ceil(count / 2^j)
    caps = jnp.asarray(capacities(k))[jnp.clip(_top(s.sizes) - levels, 0, LEVELS - 1)]
    level = jnp.argmax(sample <= caps).astype(jnp.int32)
    key_sum = jnp.sum(keys, dtype=keys.dtype) if key_sum is None else key_sum
    salt = mix32(s.salt ^ fold32(key_sum) ^ count.astype(jnp.uint32))
    offset = (salt & ((jnp.uint32(1) << level.astype(jnp.uint32)) - 1)).astype(jnp.int32)
    length = jnp.where(count > offset, -((offset - count) >> level), 0)
    i = jnp.arange(min(k, mb), dtype=jnp.int32)
    taken = i < length
    rows = jnp.where(taken, offset + (i << level), 0)
    run = jnp.where(taken, jnp.take(keys, jnp.clip(rows, 0, mb - 1), axis=1), fill(keys.dtype))
    weight = jnp.exp2(level.astype(jnp.float32))
    s = s._replace(salt=salt, variance=s.variance + jnp.where(level > 0, weight * weight, 0.0))

    def move(carry):
        s, pending = carry
        return (_step(s, jnp.where(pending, level, _lowest_full(s, k)), (run,), length, pending, k,
                      window_sizes(k, mb)),
                jnp.zeros_like(pending))

    return jax.lax.while_loop(lambda c: c[1] | jnp.any(_full(c[0], k)), move, (s, length > 0))[0]


def merge_windows(k: int) -> tuple[int, ...]:
    """The window sizes a merge's moves may sort. Each size compiles one more move in the merge program:
    a pair merge of 8 ``Quantiles(num_buckets=100)`` columns (``k`` 8192) took 0.21 CPU-s to compile with
    one size and 0.35 with :func:`window_sizes`' three, and its run 50 against 29 ms (8 shards of 125,000
    rows, the same sketch bitwise). So a job of :data:`~sharded_scan.combiners.base.MANY_SHARDS` or more shards
    (``shards - 1`` pair merges; :func:`~sharded_scan.combiners.base.merges_many_shards`) sorts in three sizes, a
    smaller one in one."""
    return window_sizes(k, k) if merges_many_shards() else (window_size(k),)


def merge(a: Sketch, b: Sketch, k: int, fields: tuple[str, ...] = ("items",), move_window=None) -> Sketch:
    """The sketch of both: ``b``'s levels inserted into ``a`` as runs, lowest first.

    Either side empty gives the other, unchanged. A weighted sketch (:mod:`.kll_weighted`) merges
    so too: its runs are its ``fields`` ``("items", "weights")``, each window moved by its ``move_window``.
    """
    levels = jnp.arange(LEVELS, dtype=jnp.int32)
    b_starts = _starts(b.sizes)

    def next_level(h):
        return jnp.min(jnp.where((levels >= h) & (b.sizes > 0), levels, LEVELS))

    def move(carry):
        s, h = carry
        at = jnp.minimum(next_level(h), LEVELS - 1)
        runs = tuple(_window(getattr(b, field), b_starts[at], k) for field in fields)
        inserting = ~jnp.any(_full(s, k))  # compact first: a level takes a run only when settled
        s = _step(s, jnp.where(inserting, at, _lowest_full(s, k)), runs, b.sizes[at], inserting, k,
                  merge_windows(k), move_window)
        return s, jnp.where(inserting, at + 1, h)

    start = a._replace(salt=mix32(a.salt ^ (b.salt * jnp.uint32(GOLDEN))), variance=a.variance + b.variance)
    merged = jax.lax.while_loop(
        lambda c: jnp.any(_full(c[0], k)) | (next_level(c[1]) < LEVELS), move, (start, jnp.zeros_like(a.sizes[0]))
    )[0]
    merged = merged._replace(overflow=merged.overflow | b.overflow)
    a_empty, b_empty = jnp.all(a.sizes == 0), jnp.all(b.sizes == 0)
    return jax.tree.map(lambda x, y, m: jnp.where(b_empty, x, jnp.where(a_empty, y, m)), a, b, merged)


class HostSketch(NamedTuple):
    """A finished sketch on the host: per column, the items sorted and their cumulative weights."""

    keys: np.ndarray        # uint32 or uint64 (d, n_items), sorted per column
    cumulative: np.ndarray  # float64 (d, n_items): total weight of the items up to and including each


def to_host(s: Sketch) -> HostSketch:
    """Sorts every column's items with their weights (``2^level``) on the host."""
    if bool(np.asarray(s.overflow)):
        raise RuntimeError("the quantile sketch overflowed a window; this is a bug in sharded_scan, please report it")
    sizes = np.asarray(s.sizes, np.int64)
    total = int(sizes.sum())
    keys = np.asarray(s.items)[:, :total]
    weights = np.repeat(np.exp2(np.arange(LEVELS, dtype=np.float64)), sizes)
    order = np.argsort(keys, axis=1, kind="stable")
    return HostSketch(np.take_along_axis(keys, order, axis=1), np.cumsum(weights[order], axis=1))


def keys_at(host: HostSketch, ranks: np.ndarray) -> np.ndarray:
    """Per column, the key of the item covering each rank (``ranks`` ``(d, m)``, 0-based, in rows)."""
    d, n_items = host.keys.shape
    if n_items == 0:
        return np.full(ranks.shape, fill(host.keys.dtype), host.keys.dtype)
    out = np.empty(ranks.shape, host.keys.dtype)
    for j in range(d):
        at = np.searchsorted(host.cumulative[j], ranks[j], side="right")
        out[j] = host.keys[j, np.minimum(at, n_items - 1)]
    return out


def rank_error_bound(variance: float, rows: int, confidence: float = 0.99) -> float:
    """Hoeffding's bound on one quantile's normalized rank error from the sketch's roundings.

    Every rounding of weight ``w`` moves a rank by at most ``w`` with mean zero, so the
    rank of one estimate is off by more than ``t`` with probability at most
    ``2 exp(-t² / (2 Σw²))``; this returns ``t / rows`` at that probability ``1 - confidence``.
    """
    if rows <= 0 or variance <= 0:
        return 0.0
    return math.sqrt(2.0 * variance * math.log(2.0 / (1.0 - confidence))) / rows
