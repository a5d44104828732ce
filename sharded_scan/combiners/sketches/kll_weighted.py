"""A weighted KLL sketch: every item carries a float weight, and every rounding keeps the total.

The layout is :mod:`~sharded_scan.combiners.sketches.kll`'s (levels contiguous in one ``(d, S)``
array of keys, capacities shrinking below the top, one ``sizes`` vector for every column),
with a second ``(d, S)`` array of the items' weights. Items of a level may weigh anything.

Compacting a level of ``c`` items of total weight ``W`` (per column) replaces them by
``m = c // 2`` items of weight ``δ = W / m`` each: the items covering the cumulative weights
``(u + j) δ``, ``j < m``, of the level sorted by key, ``u`` uniform in ``[0, 1)`` (systematic
sampling; an item heavier than ``δ`` may be taken more than once). The total weight is kept,
and the weight estimated below any value moves by less than ``δ`` with mean zero, as a
compaction of the unweighted sketch moves a rank by ``2^h``. A micro-batch whose rows do not
fit the level their count calls for (the unweighted rule) is sampled the same way first.
The sketch records ``Σ δ²`` per column, so :func:`~sharded_scan.combiners.sketches.kll.rank_error_bound`
bounds the error of the weight below an answer, relative to the total weight.

The random bits come from hashes of a salt and of the keys, as in the unweighted sketch: the
same rows in the same order give the same sketch.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sharded_scan.combiners.sketches.keys import GOLDEN, fill, fold32, mix32
from sharded_scan.combiners.sketches.kll import (
    LEVELS,
    HostSketch,
    _full,
    _lowest_full,
    _splice,
    _starts,
    _step,
    _top,
    _window,
    capacities,
    flat_size,
)
from sharded_scan.combiners.sketches.kll import (
    merge as kll_merge,
)


class WeightedSketch(NamedTuple):
    """One shard's weighted KLL sketch of ``d`` columns."""

    items: jax.Array     # uint32 or uint64 keys (d, S): level 0 first, each level sorted; filler past the last item
    weights: jax.Array   # float (d, S): each item's weight, 0 past the last item
    sizes: jax.Array     # int32 (LEVELS,): items per level, the same in every column
    variance: jax.Array  # float (d,): sum of δ² over every rounding (compaction or sampled insert)
    salt: jax.Array      # uint32 (): seed of the next random bits
    overflow: jax.Array  # bool (): a window overflowed (never expected; finalize refuses the sketch)


def empty(d: int, k: int, key_type=np.uint32, weight_type=np.float32) -> WeightedSketch:
    """The weighted sketch of no rows."""
    return WeightedSketch(
        jnp.full((d, flat_size(k)), fill(key_type), key_type), jnp.zeros((d, flat_size(k)), weight_type),
        jnp.zeros((LEVELS,), jnp.int32), jnp.zeros((d,), weight_type), jnp.uint32(GOLDEN), jnp.zeros((), bool),
    )


def unit_uniform(bits: jax.Array, dtype) -> jax.Array:
    """``uint32`` random bits as floats uniform in ``[0, 1)`` (24 bits)."""
    return (bits >> 8).astype(dtype) * jnp.asarray(2.0**-24, dtype)


def systematic(keys: jax.Array, weights: jax.Array, n: jax.Array, m: jax.Array, u: jax.Array, width: int):
    """``m`` items of equal weight standing for the first ``n`` of ``keys``/``weights`` (``(d, N)``,
    sorted by key per column): the items covering the cumulative weights ``(u + j) W / m``.

    Returns the picked keys ``(d, width)`` (sorted; the filler past ``m``), their weight
    ``δ = W / m`` ``(d,)``. ``m`` is at most ``width`` and ``n``.
    """
    live = jnp.arange(keys.shape[1]) < n
    cumulative = jnp.cumsum(jnp.where(live, weights, 0), axis=1)
    delta = cumulative[:, -1] / jnp.maximum(m, 1).astype(weights.dtype)
    j = jnp.arange(width, dtype=weights.dtype)
    targets = (u[:, None] + j[None, :]) * delta[:, None]
    at = jax.vmap(functools.partial(jnp.searchsorted, side="right"))(cumulative, targets)
    picked = jnp.take_along_axis(keys, jnp.clip(at, 0, jnp.maximum(n - 1, 0)), axis=1)
    return jnp.where(jnp.arange(width) < m, picked, fill(keys.dtype)), delta


def _move(s: WeightedSketch, level, low_level, low, up, run, run_w, run_len, inserting, *, size: int):
    """:func:`~sharded_scan.combiners.sketches.kll._step` in a window of ``size`` slots: insert the sorted
    ``run`` (keys and weights ``(d, R)``) into ``level``, or compact ``level - 1`` into ``level``."""
    pos = jnp.arange(size, dtype=jnp.int32)
    start = jnp.where(inserting, _starts(s.sizes)[level], _starts(s.sizes)[low_level])
    win, win_w = _window(s.items, start, size), _window(s.weights, start, size)
    salt = mix32(s.salt ^ (level.astype(jnp.uint32) + 1) * jnp.uint32(GOLDEN))
    column_sum = fold32(jnp.sum(jnp.where(pos < low, win, 0), axis=1, dtype=win.dtype))
    u = unit_uniform(mix32(salt ^ column_sum), win_w.dtype)
    m = low // 2
    picked, delta = systematic(win, win_w, low, m, u, size)
    filler, zero = fill(win.dtype), win_w.dtype.type(0)
    in_level = (pos >= low) & (pos < low + up)
    promoted = ~inserting & (pos < m)
    keys = jnp.where(in_level, win, jnp.where(promoted, picked, filler))
    weights = jnp.where(in_level, win_w, jnp.where(promoted, delta[:, None], zero))
    run_live = (jnp.arange(run.shape[1]) < run_len) & inserting
    slots = jnp.full((run.shape[0], size + run.shape[1]), filler, win.dtype)
    from_run = jax.lax.dynamic_update_slice_in_dim(slots, jnp.where(run_live, run, filler), up, axis=1)[:, :size]
    from_run_w = jax.lax.dynamic_update_slice_in_dim(
        jnp.zeros(slots.shape, win_w.dtype), jnp.where(run_live, run_w, zero), up, axis=1)[:, :size]
    taken = inserting & (pos >= up) & (pos < up + run_len)  # where the window's slots are unused
    keys, weights = jax.lax.sort((jnp.where(taken, from_run, keys), jnp.where(taken, from_run_w, weights)),
                                 dimension=1, num_keys=1)
    grown = jnp.where(inserting, run_len, m)
    total = jnp.sum(s.sizes)
    items = _splice(s.items, total, start, low + up, keys, up + grown)
    item_weights = _splice(s.weights, total, start, low + up, weights, up + grown)
    sizes = s.sizes.at[level].add(grown)
    sizes = jnp.where(inserting, sizes, sizes.at[low_level].set(0))
    variance = s.variance + jnp.where(inserting, zero, delta * delta)
    return WeightedSketch(items, item_weights, sizes, variance, salt, s.overflow)


def insert_sorted_rows(s: WeightedSketch, keys: jax.Array, weights: jax.Array, count: jax.Array,
                       k: int) -> WeightedSketch:
    """Inserts a micro-batch: ``keys`` ``(d, mb)`` sorted per column with their ``weights``, the
    first ``count`` real (weight > 0).

    At level 0 (``count`` within its capacity) the rows go in as they are; else ``m`` of them,
    ``m`` the sample the unweighted sketch would take (every ``2^j``-th row), are drawn by
    :func:`systematic` and go in at level ``j``. Then full levels are compacted, lowest first.
    """
    mb = keys.shape[1]
    levels = jnp.arange(32, dtype=jnp.int32)
    sample = -((-count) >> levels)  # ceil(count / 2^j)
    caps = jnp.asarray(capacities(k))[jnp.clip(_top(s.sizes) - levels, 0, LEVELS - 1)]
    level = jnp.argmax(sample <= caps).astype(jnp.int32)
    length = sample[level]
    salt = mix32(s.salt ^ fold32(jnp.sum(keys, dtype=keys.dtype)) ^ count.astype(jnp.uint32))
    width = min(k, mb)
    u = unit_uniform(mix32(salt ^ jnp.uint32(GOLDEN) ^ fold32(jnp.sum(keys, axis=1, dtype=keys.dtype))),
                     weights.dtype)
    picked, delta = systematic(keys, weights, count, length, u, width)
    live = jnp.arange(width) < length
    as_is = jnp.where(live, keys[:, :width], fill(keys.dtype))
    run = jnp.where(level > 0, picked, as_is)
    run_w = jnp.where(level > 0, jnp.where(live, delta[:, None], 0), jnp.where(live, weights[:, :width], 0))
    s = s._replace(salt=salt, variance=s.variance + jnp.where(level > 0, delta * delta, 0))

    def move(carry):
        s, pending = carry
        at = jnp.where(pending, level, _lowest_full(s, k))
        return _step(s, at, (run, run_w), length, pending, k, move=_move), jnp.zeros_like(pending)

    return jax.lax.while_loop(lambda c: c[1] | jnp.any(_full(c[0], k)), move, (s, length > 0))[0]


def merge(a: WeightedSketch, b: WeightedSketch, k: int) -> WeightedSketch:
    """The sketch of both (:func:`~sharded_scan.combiners.sketches.kll.merge`, with the items' weights)."""
    return kll_merge(a, b, k, ("items", "weights"), _move)


def to_host(s: WeightedSketch) -> HostSketch:
    """Every column's items sorted with their cumulative weights (float64), on the host."""
    if bool(np.asarray(s.overflow)):
        raise RuntimeError("the quantile sketch overflowed a window; this is a bug in sharded_scan, please report it")
    total = int(np.asarray(s.sizes, np.int64).sum())
    keys, weights = np.asarray(s.items)[:, :total], np.asarray(s.weights, np.float64)[:, :total]
    order = np.argsort(keys, axis=1, kind="stable")
    return HostSketch(np.take_along_axis(keys, order, axis=1), np.cumsum(np.take_along_axis(weights, order, 1), 1))
