"""Exact wide integers in 32-bit words: row counts and bin counts that never wrap.

JAX without ``jax_enable_x64`` (and TPUs at any setting) has no 64-bit integers, and an
int32 count wraps after 2^31 rows, a few minutes of a pod. A :class:`Wide` holds an
integer array as ``LIMBS`` int32 limbs on a trailing axis: limb ``k`` weighs
``2^(16 k)``; the lower limbs are kept in ``[0, 2^16)`` by :func:`add`, the top one is
signed and holds the rest, so one :class:`Wide` holds integers of up to 63 bits and more.

Partials may be summed leafwise (``psum``, a plain ``+``) without normalising: the lower
limbs of up to 2^15 normalised partials still fit in int32, and :func:`to_int` reads
limbs of any size exactly on the host.

Public as ``sharded_scan.counts``, for a user's own combiner: a row count that never wraps is
``init``: ``counts.zeros()``, ``add``: ``counts.count_rows(acc, mask)``, ``finalize``:
``counts.to_int(acc)`` (an :class:`~sharded_scan.AdditiveCombiner`'s ``+`` merges it); exact sums
of integer columns are :func:`sum_rows`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

LIMB_BITS = 16
LIMBS = 4  # 3 x 16 bits + a signed top limb: |value| < 2^79
_MASK = (1 << LIMB_BITS) - 1


class Wide(NamedTuple):
    """An exact integer array: int32 ``limbs`` of shape ``(*shape, LIMBS)``."""

    limbs: jax.Array


def zeros(shape: tuple[int, ...] = (), limbs: int = LIMBS) -> Wide:
    """Zero, of ``shape``."""
    return Wide(jnp.zeros((*shape, limbs), jnp.int32))


def normalize(w: Wide) -> Wide:
    """Carries every lower limb into ``[0, 2^16)``; the value is unchanged."""
    limbs = [w.limbs[..., k] for k in range(w.limbs.shape[-1])]
    for k in range(len(limbs) - 1):
        carry = limbs[k] >> LIMB_BITS  # arithmetic: floor division, also for negative limbs
        limbs[k] = limbs[k] & _MASK
        limbs[k + 1] = limbs[k + 1] + carry
    return Wide(jnp.stack(limbs, axis=-1))


def add(a: Wide, b: Wide) -> Wide:
    """``a + b``, normalised (both normalised, or with limbs below 2^30)."""
    return normalize(Wide(a.limbs + b.limbs))


def of_int32(n: jax.Array, limbs: int = LIMBS) -> Wide:
    """The int32 array ``n`` (any sign) as a normalised :class:`Wide`."""
    n = jnp.asarray(n, jnp.int32)
    parts = [n & _MASK, n >> LIMB_BITS] + [jnp.zeros_like(n)] * (limbs - 2)
    return Wide(jnp.stack(parts, axis=-1))


def add_int32(w: Wide, n: jax.Array) -> Wide:
    """``w + n`` for an int32 array ``n`` broadcastable to ``w``'s shape (e.g. a row count)."""
    return add(w, of_int32(jnp.broadcast_to(n, w.limbs.shape[:-1]), w.limbs.shape[-1]))


def count_rows(w: Wide, mask: jax.Array) -> Wide:
    """``w`` plus the number of True entries of ``mask`` (a micro-batch's real rows)."""
    return add_int32(w, jnp.sum(mask, dtype=jnp.int32))


def is_zero(w: Wide) -> jax.Array:
    """Whether each value is zero (limbs normalised or not)."""
    return jnp.all(normalize(w).limbs == 0, axis=-1)


def to_float(w: Wide, dtype=jnp.float32) -> jax.Array:
    """The value in ``dtype`` on the device (rounded once per limb: for weights, not for reports)."""
    out = jnp.zeros(w.limbs.shape[:-1], dtype)
    for k in reversed(range(w.limbs.shape[-1])):
        out = out * (1 << LIMB_BITS) + w.limbs[..., k].astype(dtype)
    return out


GROUP_ROWS = 1 << 15  # a column sum of 2^15 pieces of 16 bits fits int32


def limbs_for(dtype) -> int:
    """Limbs for sums of ``dtype`` integers: 64-bit values need two more than ``LIMBS``."""
    return LIMBS + 2 if np.dtype(dtype).itemsize > 4 else LIMBS


def _pieces(x: jax.Array) -> list[jax.Array]:
    """An integer (or bool) array as int32 pieces of 16 bits, lowest first.

    Every piece but the top one is in ``[0, 2^16)``; the top one of a signed dtype is
    signed, so ``x == sum(piece_k * 2^(16 k))`` exactly.
    """
    dtype = np.dtype(x.dtype)
    if dtype == np.bool_ or dtype.itemsize <= 2:
        return [x.astype(jnp.int32)]
    count = dtype.itemsize * 8 // LIMB_BITS
    signed = np.issubdtype(dtype, np.signedinteger)
    out = []
    for k in range(count):
        part = jnp.right_shift(x, jnp.asarray(LIMB_BITS * k, dtype))  # arithmetic when signed
        if k < count - 1 or not signed:
            part = jnp.bitwise_and(part, jnp.asarray(_MASK, dtype))
        out.append(part.astype(jnp.int32))
    return out


def _column_sums(piece: jax.Array) -> jax.Array:
    """``(groups, *rest)`` int32 sums of ``piece``'s rows in groups of at most ``GROUP_ROWS``."""
    rows = piece.shape[0]
    size = max(min(rows, GROUP_ROWS), 1)
    groups = -(-rows // size)
    piece = jnp.pad(piece, [(0, groups * size - rows)] + [(0, 0)] * (piece.ndim - 1))
    return jnp.sum(piece.reshape(groups, size, *piece.shape[1:]), axis=1)


def sum_rows(x: jax.Array, mask: jax.Array, limbs: int | None = None) -> Wide:
    """The exact sum over rows of the integer (or bool) array ``x`` where ``mask`` is True.

    Each 16-bit piece is summed in int32 over groups of at most 2^15 rows, so no
    partial sum wraps whatever the micro-batch size; the group sums are carried into
    limbs. ``limbs`` defaults to :func:`limbs_for` ``x``'s dtype.
    """
    limbs = limbs or limbs_for(x.dtype)
    keep = mask.reshape(mask.shape + (1,) * (x.ndim - 1))
    total = jnp.zeros((*x.shape[1:], limbs), jnp.int32)
    for k, piece in enumerate(_pieces(x)):
        sums = _column_sums(jnp.where(keep, piece, 0))
        low = jnp.sum(jnp.bitwise_and(sums, _MASK), axis=0, dtype=jnp.int32)  # < 2^16 per group
        high = jnp.sum(jnp.right_shift(sums, LIMB_BITS), axis=0, dtype=jnp.int32)  # int32 under x64 too
        total = total.at[..., k].add(low).at[..., k + 1].add(high)
    return normalize(Wide(total))


def segment_sum_rows(x: jax.Array, mask: jax.Array, keys: jax.Array, num_keys: int, limbs: int | None = None) -> Wide:
    """:func:`sum_rows` per key: ``(num_keys, *x.shape[1:])`` exact sums of the rows of each key
    (``keys`` int32 in ``[0, num_keys)`` where ``mask``), in int32 over groups of ``GROUP_ROWS`` rows."""
    limbs = limbs or limbs_for(x.dtype)
    keep = mask.reshape(mask.shape + (1,) * (x.ndim - 1))
    total = jnp.zeros((num_keys, *x.shape[1:], limbs), jnp.int32)
    for k, piece in enumerate(_pieces(x)):
        piece = jnp.where(keep, piece, 0)
        for start in range(0, piece.shape[0], GROUP_ROWS):
            sums = jax.ops.segment_sum(piece[start : start + GROUP_ROWS], keys[start : start + GROUP_ROWS], num_keys)
            total = total.at[..., k].add(jnp.bitwise_and(sums, _MASK)).at[..., k + 1].add(
                jnp.right_shift(sums, LIMB_BITS))
    return normalize(Wide(total))


def to_int(w: Wide | np.ndarray) -> np.ndarray:
    """The exact value on the host: int64, or Python ints (object) when it does not fit."""
    limbs = np.asarray(w.limbs if isinstance(w, Wide) else w)
    weights = 2.0 ** (LIMB_BITS * np.arange(limbs.shape[-1]))
    if limbs.dtype.kind in "iu" and limbs.size and float(np.max(np.abs(limbs.astype(np.float64)) @ weights)) < 2.0**62:
        # every partial sum is below 2^62 in magnitude: int64 arithmetic is exact (no Python ints a value)
        shifted = limbs.astype(np.int64) << (LIMB_BITS * np.arange(limbs.shape[-1], dtype=np.int64))
        return np.asarray(shifted.sum(axis=-1), np.int64)
    total = np.zeros(limbs.shape[:-1], object)
    for k in reversed(range(limbs.shape[-1])):
        total = np.asarray(total * (1 << LIMB_BITS) + limbs[..., k].astype(object), object)
    info = np.iinfo(np.int64)
    if all(info.min <= int(v) <= info.max for v in total.reshape(-1)):
        return total.astype(np.int64)
    return total


def is_wide(x) -> bool:
    """For ``jax.tree.map(..., is_leaf=is_wide)``: treat a :class:`Wide` as one leaf."""
    return isinstance(x, Wide)
