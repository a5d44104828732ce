"""TSQR: the R factor of the rows ``[1 | z - shift]``, by Householder QR on the devices.

Each shard keeps the upper-triangular R of ``A = [1 | Z - shift]`` (the ones column
first; ``shift`` is a reference point taken from the shard's first rows, so that large
means cost no digits). Adding a micro-batch is the QR of ``[R; rows]``, merging two
shards the QR of their stacked R's (Benson, Gleich, Demmel 2013; as
``dask.array.linalg.tsqr``). Householder QR is backward stable, so R is the exact R of
rows within a few ulps of the data's, column by column.

With the ones column first, ``R = [[√n, r0ᵀ], [0, Rc]]`` where ``r0 = Σ(z - shift)/√n``
and ``Rc`` is the R of the centred rows: the mean and the centred factor come out of R
without ever subtracting sums of squares.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sharded_scan.combiners import wide
from sharded_scan.combiners.base import masked, row_count
from sharded_scan.combiners.linalg.lstsq import Factor
from sharded_scan.combiners.statistics.moments import reference_point


class TSQRAcc(NamedTuple):
    """Rows seen, the reference point, and the R of ``[1 | z - shift]``."""

    count: wide.Wide
    shift: jax.Array  # (p,)
    r: jax.Array      # (p + 1, p + 1) upper triangular


def augmented(z: jax.Array, shift: jax.Array, mask: jax.Array) -> jax.Array:
    """The rows ``[1 | z - shift]``, all zero where ``mask`` is False (zero rows change no R)."""
    ones = mask.astype(z.dtype)[:, None]
    return jnp.concatenate([ones, masked(z - shift, mask)], axis=1)


def moved(r: jax.Array, old: jax.Array, new: jax.Array) -> jax.Array:
    """The R for reference point ``new`` from the R for ``old`` (still upper triangular).

    ``[1 | z - new] = [1 | z - old] @ T`` with ``T = [[1, (old - new)ᵀ], [0, I]]``.
    """
    return r.at[:, 1:].add(r[:, :1] * (old - new)[None, :])


def init(p: int, dtype) -> TSQRAcc:
    return TSQRAcc(wide.zeros(), jnp.zeros((p,), dtype), jnp.zeros((p + 1, p + 1), dtype))


def add(acc: TSQRAcc, z: jax.Array, mask: jax.Array, weights: jax.Array | None = None) -> TSQRAcc:
    """Adds the rows ``z`` where ``mask``; with ``weights`` (``(rows,)``) each row scaled by
    ``√w`` (then ``R``'s corner is ``√Σw`` and ``r0 / √Σw`` the weighted mean's offset)."""
    z = z.astype(acc.r.dtype)
    nb = row_count(mask)
    shift = jnp.where(wide.is_zero(acc.count), reference_point(acc.shift, z, mask, nb), acc.shift)
    r = jnp.linalg.qr(jnp.concatenate([acc.r, scaled(augmented(z, shift, mask), weights)]), mode="r")
    return TSQRAcc(wide.add_int32(acc.count, nb), shift, r)


def scaled(b: jax.Array, weights: jax.Array | None) -> jax.Array:
    """The rows ``b`` times ``√w`` (``Σ w bᵀb`` is their Gram); ``b`` itself when unweighted."""
    return b if weights is None else b * jnp.sqrt(weights.astype(b.dtype))[:, None]


def merge(a: TSQRAcc, b: TSQRAcc) -> TSQRAcc:
    a_empty, b_empty = wide.is_zero(a.count), wide.is_zero(b.count)
    r = jnp.linalg.qr(jnp.concatenate([a.r, moved(b.r, b.shift, a.shift)]), mode="r")
    r = jnp.where(a_empty, b.r, jnp.where(b_empty, a.r, r))
    return TSQRAcc(wide.add(a.count, b.count), jnp.where(a_empty, b.shift, a.shift), r)


def factor(acc: TSQRAcc) -> Factor:
    """The host :class:`Factor`: mean ``shift + r0 / √n`` and the centred R, in float64."""
    r = np.asarray(acc.r, np.float64)
    count = int(wide.to_int(acc.count))
    head = r[0, 0] if count else 1.0
    mean = np.asarray(acc.shift, np.float64) + r[0, 1:] / head
    eps = np.finfo(np.asarray(acc.r).dtype).eps
    return Factor(count, mean, r[1:, 1:], noise=eps * max(r.shape[0], 10))
