"""Small dense factorizations in plain XLA ops: Cholesky and triangular inverse.

``jnp.linalg`` lowers these to LAPACK on CPU, and when XLA runs several CPU devices
at once their calls contend for one OpenBLAS thread pool: a 258 x 258 Cholesky took
~100 ms per call on 8 simulated devices, against ~0.1 ms alone. Here each
factorization is one loop over ``BLOCK``-wide blocks (a small loop inside each, the
rest matmuls): the same on every backend, and a small program to compile whatever
the matrix size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sharded_scan import fixed_order

BLOCK = 32


def _padded(a: jax.Array, block: int) -> jax.Array:
    """``a`` padded with an identity block to a multiple of ``block`` rows and columns."""
    n = a.shape[0]
    size = -(-n // block) * block
    return jnp.eye(size, dtype=a.dtype).at[:n, :n].set(a)


def _row(a: jax.Array, j) -> jax.Array:
    """``a[j]`` for a traced ``0 <= j < len(a)``, without jnp's index arithmetic (a smaller loop body)."""
    return jax.lax.dynamic_index_in_dim(a, j, keepdims=False)


def _set_row(a: jax.Array, row, j) -> jax.Array:
    """``a.at[j].set(row)`` for a traced ``0 <= j < len(a)``, without jnp's index arithmetic."""
    return jax.lax.dynamic_update_index_in_dim(a, jnp.asarray(row, a.dtype), j, 0)


def _block_rows(a: jax.Array, deflate_below) -> tuple[jax.Array, jax.Array]:
    """Upper U with UᵀU = a, row by row (for one small block), and its deflated rows; for ``a``
    wider than tall (``[a | B]``), ``[U | U⁻ᵀ B]``: ``[a | I]`` gives ``U⁻ᵀ`` in the same loop.

    Right-looking: row ``j`` of ``U`` is row ``j`` of what is left of ``a`` over its pivot,
    and its outer product leaves the rows after it. Elementwise only (no ``dot``): a small
    loop body to compile, and each entry's sum taken in row order on every backend.
    A pivot whose square is at most ``deflate_below`` (a column that adds nothing to
    the ones before it, in working precision) gets a unit row ``e_j`` instead.
    Under :func:`~sharded_scan.fixed_order.fixed_order` the same rows come from :func:`_ordered_block_rows`.
    """
    size = a.shape[0]
    index = jnp.arange(a.shape[1])

    def row(j, carry):
        left, deflated = carry  # rows before j: U's; the rest: a less their outer products
        here = _row(left, j)
        square = _row(here, j)
        flat = square <= deflate_below
        pivot = jnp.where(flat, 1.0, jnp.sqrt(jnp.maximum(square, 0.0)))
        after = jnp.where(((index > j) & ~flat) | (index >= size), here / pivot, 0.0)
        left = left - after[:size, None] * after[None, :]
        return _set_row(left, jnp.where(index == j, pivot, after), j), _set_row(deflated, flat, j)

    return jax.lax.fori_loop(0, size, row, (a, jnp.zeros_like(a[0, :size], bool)))


def _ordered_block_rows(a: jax.Array, deflate_below) -> tuple[jax.Array, jax.Array]:
    """:func:`_block_rows`' rows, the same arithmetic in each turn, laid out for XLA:CPU: each turn takes row
    ``j``'s pivot, deflation and row over the pivot from the loop's state, found by the turn before (not recomputed
    from what is left of ``a`` for each entry of the update's kernel), and sets row ``j`` by a select (not a
    dynamic-update-slice, which XLA:CPU fused element by element): a factorization at n = 258 (288 turns)
    2.3-2.4 -> 1.2 CPU-ms under ``logical_shards``. Its plain program rounds as :func:`_block_rows`' under
    :func:`~sharded_scan.fixed_order.fixed_order` only (a division IEEE's there, ``divided``): XLA's simplifier
    makes ``x / pivot`` a product with the reciprocal in some programs and not others, by which broadcasts it
    merges, so plain runs keep :func:`_block_rows` itself, as they rounded."""
    size = a.shape[0]
    index = jnp.arange(a.shape[1])

    def pivoted(left, j):  # [row j over its pivot | the pivot | deflated?], from what is left of a
        here = _row(left, j)
        square = _row(here, j)
        flat = square <= deflate_below
        pivot = jnp.where(flat, 1.0, jnp.sqrt(jnp.maximum(square, 0.0)))
        after = jnp.where(((index > j) & ~flat) | (index >= size), here / pivot, 0.0)
        return jnp.concatenate([after, pivot[None], flat.astype(a.dtype)[None]])

    def row(j, carry):
        left, deflated, pivoting = carry  # pivoting: row j's, one vector (one state to carry, not three)
        after, pivot, flat = pivoting[:-2], pivoting[-2], pivoting[-1] > 0
        left = left - after[:size, None] * after[None, :]
        here = index[:size] == j
        left = jnp.where(here[:, None], jnp.where(index == j, pivot, after)[None, :], left)
        return left, jnp.where(here, flat, deflated), pivoted(left, jnp.minimum(j + 1, size - 1))

    return jax.lax.fori_loop(0, size, row, (a, jnp.zeros_like(a[0, :size], bool), pivoted(a, 0)))[:2]


# A jit fixed_order knows by its name (TOGETHER): plain, _block_rows; under fixed_order, _ordered_block_rows
_block_rows.__name__ = "sharded_scan.cholesky_block_rows"
_cholesky_block = jax.jit(_block_rows)
fixed_order.TOGETHER[_block_rows.__name__] = (
    lambda a, deflate_below: fixed_order.fixed_order(_ordered_block_rows)(a, deflate_below) if a.ndim == 2 else None)


def _factor_block(a: jax.Array, deflate_below) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(U, deflated, U⁻¹)`` of one small block, from one loop (:func:`_cholesky_block` of ``[a | I]``)."""
    size = a.shape[0]
    rows, deflated = _cholesky_block(jnp.concatenate([a, jnp.eye(size, dtype=a.dtype) + jnp.zeros_like(a)], 1),
                                     deflate_below)
    return rows[:, :size], deflated, rows[:, size:].T


def _inverse_block(u: jax.Array) -> jax.Array:
    """The inverse of a small upper-triangular block, row by row from the bottom.

    Each finished row ``j`` of ``U⁻¹`` is taken off the rows above it at once (times
    their ``U[i, j]``), elementwise: the same small loop body as :func:`_cholesky_block`.
    """
    b = u.shape[0]
    index = jnp.arange(b)

    def row(k, x):  # x: rows after j are U⁻¹'s, the others I less what those rows gave
        j = b - 1 - k
        column = jax.lax.dynamic_index_in_dim(u, j, axis=1, keepdims=False)
        done = _row(x, j) / _row(column, j)
        x = x - jnp.where(index < j, column, 0.0)[:, None] * done[None, :]
        return _set_row(x, done, j)

    return jax.lax.fori_loop(0, b, row, jnp.eye(b, dtype=u.dtype) + jnp.zeros_like(u))


def _column_block(x: jax.Array, u: jax.Array, start, block: int, ukk_inv: jax.Array) -> jax.Array:
    """Block column ``start`` of ``U⁻¹`` from its columns before ``start`` (in ``x``), ``U``'s,
    and the inverse of ``U``'s diagonal block there (``ukk_inv``)."""
    size = u.shape[0]
    above = jnp.where(jnp.arange(size)[:, None] < start, jax.lax.dynamic_slice(u, (0, start), (size, block)), 0.0)
    column = -(x @ above) @ ukk_inv
    return jax.lax.dynamic_update_slice(column, ukk_inv, (start, 0))


def cholesky_upper(a: jax.Array, deflate_below=0.0, block: int = BLOCK, inverse: bool = True
                   ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Upper-triangular ``U`` with ``UᵀU = a`` (symmetric positive semidefinite), and ``U⁻¹``.

    Right-looking by blocks. ``U⁻¹`` comes from the same elimination: ``[a | I]`` factored as far as
    ``a`` goes has ``[U | U⁻ᵀ]`` for rows (``UᵀU⁻ᵀ = I``), so each block row's panel and the update
    after it carry ``U⁻ᵀ``'s columns beside ``U``'s: two matrix products a block, where a block column of
    ``U⁻¹`` of its own took two more (under ``logical_shards`` each product is a handful of kernels to
    compile); the diagonal block's ``U⁻¹`` comes from its own row loop the same way (:func:`_factor_block`).
    Those products take only the columns still to come, as many as ``a``'s (padded) and next to each other in
    ``[a | I]``: ``U``'s after the block and ``U⁻ᵀ``'s up to its end. Half the whole's work, and each element the
    same bits as the whole's (a function of its row and column alone, as :mod:`sharded_scan.fixed_order`'s products
    are); the zeros outside stay zeros, where an inf (a zero pivot) made some of them NaN.
    ``U``'s columns are products of ``U``'s alone, the same with or without ``U⁻ᵀ``'s. A pivot whose
    square is at most ``deflate_below`` (a direction ``a`` does not span, in working precision) gets the unit
    row ``e_j`` and adds nothing to the later columns, so ``U`` stays finite and invertible where ``a`` is
    singular.

    Returns:
      ``(U, deflated, U⁻¹)``: ``UᵀU = a`` up to the rows ``deflated`` marks; ``U⁻¹`` None unless ``inverse``.
    """
    n = a.shape[0]
    if n <= block:  # one block: no outer loop (a much smaller program to compile)
        if inverse:
            return _factor_block(a, deflate_below)
        return (*_cholesky_block(a, deflate_below), None)
    a = _padded(a, block)
    size = a.shape[0]
    if inverse:
        a = jnp.concatenate([a, jnp.eye(size, dtype=a.dtype) + jnp.zeros_like(a)], axis=1)  # varying like a
    columns = jnp.arange(size)

    def step(k, carry):
        a, u, deflated = carry
        start = k * block
        after = start + block
        ukk, flat, ukk_inv = _factor_block(jax.lax.dynamic_slice(a, (start, start), (block, block)), deflate_below)
        if inverse:
            blank = jnp.zeros_like(a[:block, :size])
            # the columns still to come: U's after the block and U⁻ᵀ's up to its end, ``size`` in a row (U⁻ᵀ is lower
            # triangular); the ones outside hold zeros the products would only carry along
            live = jax.lax.dynamic_slice(a, (0, after), (size, size))
            panel = ukk_inv.T @ jax.lax.dynamic_slice_in_dim(live, start, block)
            # U's columns of rows that are not deflated; U⁻ᵀ's whole (a deflated row's too: its unit pivot leaves
            # what is left of I's rows there)
            panel = jnp.where(~flat[:, None] | (columns[None, :] >= size - after), panel, 0.0)
            # U's part of the panel in a's columns (zero before `after`), each product element as the whole
            # matrix's: a function of its row and column alone
            head = jax.lax.dynamic_slice_in_dim(jnp.concatenate([blank, panel], 1), size - after, size, 1)
            a = jax.lax.dynamic_update_slice(a, live - head.T @ panel, (0, after))
            u = jax.lax.dynamic_update_slice(jax.lax.dynamic_update_slice(u, panel, (start, after)), ukk,
                                             (start, start))
        else:
            panel = ukk_inv.T @ jax.lax.dynamic_slice_in_dim(a, start, block)
            # U's columns after the block, of rows that are not deflated
            panel = jnp.where((columns[None, :] >= after) & ~flat[:, None], panel, 0.0)
            a = a - panel.T @ panel
            u = jax.lax.dynamic_update_slice(u, jax.lax.dynamic_update_slice(panel, ukk, (0, start)), (start, 0))
        return a, u, jax.lax.dynamic_update_slice(deflated, flat, (start,))

    _, u, deflated = jax.lax.fori_loop(0, size // block, step, (a, jnp.zeros_like(a), jnp.zeros_like(a[0, :size]) > 0))
    return u[:n, :n], deflated[:n], u[:n, size : size + n].T if inverse else None


def triangular_inverse(u: jax.Array, block: int = BLOCK) -> jax.Array:
    """The inverse of the upper-triangular ``u`` (nonzero diagonal), block column by block column."""
    n = u.shape[0]
    if n <= block:
        return _inverse_block(u)
    u = _padded(u, block)

    def step(k, x):
        start = k * block
        ukk_inv = _inverse_block(jax.lax.dynamic_slice(u, (start, start), (block, block)))
        return jax.lax.dynamic_update_slice(x, _column_block(x, u, start, block, ukk_inv), (0, start))

    return jax.lax.fori_loop(0, u.shape[0] // block, step, jnp.zeros_like(u))[:n, :n]
