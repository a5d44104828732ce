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


def _cholesky_block(a: jax.Array, deflate_below) -> tuple[jax.Array, jax.Array]:
    """Upper U with UᵀU = a, row by row (for one small block), and its deflated rows; for ``a``
    wider than tall (``[a | B]``), ``[U | U⁻ᵀ B]``: ``[a | I]`` gives ``U⁻ᵀ`` in the same loop.

    Right-looking: row ``j`` of ``U`` is row ``j`` of what is left of ``a`` over its pivot,
    and its outer product leaves the rows after it. Elementwise only (no ``dot``): a small
    loop body to compile, and each entry's sum taken in row order on every backend.
    A pivot whose square is at most ``deflate_below`` (a column that adds nothing to
    the ones before it, in working precision) gets a unit row ``e_j`` instead.
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
        # row j set by a select over the block, not a dynamic-update-slice: the same values, where XLA:CPU's fusion of
        # the update into the slice's place ran element by element (the loop's kernel 3.9 -> 2.8 us, 288 turns a
        # factorization at n = 258)
        here = index[:size] == j
        return (jnp.where(here[:, None], jnp.where(index == j, pivot, after)[None, :], left),
                jnp.where(here, flat, deflated))

    return jax.lax.fori_loop(0, size, row, (a, jnp.zeros_like(a[0, :size], bool)))


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
