"""A streaming QR in a whitened basis: the stability of TSQR at the cost of matmuls.

Like :mod:`.tsqr`, each shard describes the rows ``b = [1 | z - shift]`` (ones column
first, ``shift`` a reference point near the mean), but instead of R it keeps a basis
``W`` (upper triangular) and the Gram matrix of the rows in that basis::

    M = Σ (b W)ᵀ (b W),   so that   Σ bᵀb = W⁻ᵀ M W⁻¹   and   R = chol(M) W⁻¹.

``W`` is chosen so that ``M`` stays close to diagonal: then the float sums of ``M``
keep their digits whatever the conditioning of the data (raw normal equations lose
them as the square of the condition number). A micro-batch costs one matmul
``c = b W`` and one Gram ``cᵀc``; while the data's centred columns are nearly
uncorrelated ``W`` stays diagonal (plus its first row, the shift) and the first
matmul is a column scaling: then it costs what centred co-moments cost.

A young shard, one that has seen fewer than ``2 n`` rows, keeps those rows themselves
instead (in ``gram`` and ``compensation``, ``2 n`` rows of room; a merge of two young shards
appends one's rows to the other's): a few rows cannot tell a weak direction from an empty one.
It whitens once those rows and the micro-batch after them are enough. No QR: a Householder
QR of ``[R; rows]`` a young micro-batch (as TSQR) was most of a small-micro-batch job's time
(``logical_shards``: 256 rows, two QRs of 514 x 258 a shard at d=256) and of its compiles.

``W`` is re-chosen ("re-whitened") only when a micro-batch is large against what ``M``
holds: on the first micro-batch, when the data drifts, while a shard has seen few
rows, and when merging. Re-whitening factors ``M`` (with :mod:`.dense`, no LAPACK),
moves the shift to the running mean, moves ``M`` to the new basis and redoes the
micro-batch in it, twice when the basis is not diagonal (CholeskyQR2: the first pass
shifts the correlations to see weak directions, the second leaves directions without
data alone). Merging adds the other shard's rows (``chol(M) W⁻¹``, or a young shard's own rows).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sharded_scan.combiners import wide
from sharded_scan.combiners.base import row_count
from sharded_scan.combiners.linalg import dense
from sharded_scan.combiners.linalg.lstsq import Factor
from sharded_scan.combiners.linalg.tsqr import augmented, moved, scaled
from sharded_scan.combiners.statistics.moments import reference_point

GROWTH = 16.0          # re-whiten when a micro-batch's correlations exceed this many times M's floor
DIAGONAL_COND = 64.0   # keep a diagonal basis while the centred correlations' condition number is below this
DIAGONAL_OFFSET = 0.9  # and every column's correlation with the ones column (|mean - shift| < 2 sd)
RECENTRE = 1.0  # move the shift to the running mean when it is this many standard deviations away
PASSES = 2             # re-whitening passes over the micro-batch when the basis is not diagonal
POWER_STEPS = 12


class WhitenedAcc(NamedTuple):
    """Rows seen, the reference point, the basis and the Gram of the rows in it."""

    count: wide.Wide
    shift: jax.Array         # (p,)
    sums: jax.Array          # (2, n) Σ b and Σ b² (n = p + 1): the running mean is shift + sums[0, 1:] / sums[0, 0]
    start: jax.Array         # (n,) 1 / column norms of the first micro-batch: the columns' natural units
    basis: jax.Array         # (n, n) upper triangular W, columns of unit norm in `start` units
    gram: jax.Array          # (n, n) M = Σ (b W)ᵀ (b W), less `compensation`; young: the first n rows b
    compensation: jax.Array  # (n, n) Kahan compensation of `gram`; young: the rows b after those
    floor: jax.Array         # () smallest eigenvalue of M's correlations right after the last re-whitening
    diagonal: jax.Array      # () bool: W is diagonal but for its first row (c = b W is a column scaling)
    young: jax.Array         # () bool: fewer than 2n rows so far, held as they are: (gram; compensation)'s
                             # first `count` rows, zero after them (_young_rows)


def init(p: int, dtype) -> WhitenedAcc:
    n = p + 1
    zeros = jnp.zeros((n, n), dtype)
    return WhitenedAcc(
        wide.zeros(), jnp.zeros((p,), dtype), jnp.zeros((2, n), dtype), jnp.ones((n,), dtype),
        jnp.eye(n, dtype=dtype), zeros, zeros, jnp.zeros((), dtype), jnp.ones((), bool), jnp.ones((), bool),
    )


def _times_basis(b: jax.Array, basis: jax.Array) -> jax.Array:
    """``b @ basis`` with each of b's columns and basis's rows moved by the power of two at or below the row's
    largest magnitude (exact: the same products), so that a product whose order is fixed by rounding each row of
    ``b`` below its largest value (``fixed_order.exact_block_dot``, under ``logical_shards``) rounds it below its
    largest contribution instead: a column of data small beside another, which the basis scales back up, keeps
    its bits. A function of ``basis`` alone: each output row still depends on its own row of ``b`` only."""
    power = _power_at_or_below(jnp.max(jnp.where(jnp.isfinite(basis), jnp.abs(basis), 0.0), axis=1))
    return (b * power) @ (basis / power[:, None])


def _power_at_or_below(x: jax.Array) -> jax.Array:
    """The power of two at or below each of ``x`` (finite, >= 0; float32 or float64): its exponent bits alone,
    exact (``exp2(floor(log2))`` is neither on XLA:CPU); 1 for zero and subnormals, which move nothing."""
    uint, mantissa = {4: (jnp.uint32, 23), 8: (jnp.uint64, 52)}[x.dtype.itemsize]
    power = jax.lax.bitcast_convert_type((jax.lax.bitcast_convert_type(x, uint) >> mantissa) << mantissa, x.dtype)
    return jnp.where(power >= jnp.finfo(x.dtype).tiny, power, jnp.ones_like(power))


def _diagonal(m: jax.Array) -> jax.Array:
    """``jnp.diagonal(m)`` by indexing: jnp's is a branch by platform whose other branch sums ``m`` times the identity
    (traced through, under ``logical_shards``, as an ordered sum of ``n x n`` values, where XLA then drops it)."""
    index = jnp.arange(m.shape[0])
    return m[index, index]


def _in_basis(b: jax.Array, basis: jax.Array, diagonal: jax.Array) -> jax.Array:
    """``b W``: a column scaling plus the ones column times W's first row when ``diagonal``."""

    def scaled():
        first = basis[0].at[0].set(0.0)
        return b * _diagonal(basis) + b[:, :1] * first

    return jax.lax.cond(diagonal, scaled, lambda: _times_basis(b, basis))


def _noise(m: jax.Array) -> jax.Array:
    """The relative size of rounding in a Gram of ``n`` columns: ``n eps``."""
    return m.shape[0] * jnp.finfo(m.dtype).eps


def _NOISE_ROOT(dtype) -> float:  # noqa: N802
    """``eps^(3/4)``: between a whitened column's rounding noise (``~√n eps``) and the
    smallest direction data of this dtype can hold after whitening (``~√(eps / n)``)."""
    return float(jnp.finfo(dtype).eps) ** 0.75


def _scales(diagonal: jax.Array) -> jax.Array:
    """Square roots of a Gram's ``diagonal``; the largest one for a column below
    :func:`_NOISE_ROOT` of it (1 for an all-zero Gram).

    The basis columns have unit norm in the data's units, so a column that small is
    rounding noise of the others (a direction without data, e.g. an exactly collinear
    column): left at the common scale it stays small against them, so it is deflated
    and its noise is never scaled up to look like data.
    """
    scale = jnp.sqrt(jnp.maximum(diagonal, 0.0))
    top = jnp.max(scale)
    scale = jnp.where(scale >= _NOISE_ROOT(diagonal.dtype) * top, scale, top)
    return jnp.where(scale > 0, scale, 1.0)


def _correlation_root(m: jax.Array, deflate, inverse: bool = True
                      ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """``(scale, U, deflated, U⁻¹)`` with ``UᵀU`` the correlations ``m / (scale scaleᵀ)`` (``U⁻¹`` None unless
    ``inverse``).

    Columns of ``m`` that are all zero get a unit diagonal (left alone). Where
    ``deflate`` (a bool, may be traced), directions ``m`` does not span in working
    precision get unit rows (``deflated``); elsewhere the correlations are shifted by
    ``n eps`` to be definite, which keeps a direction that is merely weak in the
    current basis (CholeskyQR's first pass).
    """
    scale = _scales(_diagonal(m))
    k = m / jnp.outer(scale, scale)
    k = jnp.where(jnp.diag(_diagonal(m) <= 0), 1.0, k)
    noise = _noise(m)
    eye = jnp.eye(m.shape[0], dtype=m.dtype)
    shifted = k + jnp.where(deflate, 0.0, noise) * eye
    return (scale, *dense.cholesky_upper(shifted, jnp.where(deflate, noise, -1.0), inverse=inverse))


def _power_estimate(apply, v: jax.Array) -> jax.Array:
    """About the largest eigenvalue of the symmetric PSD operator ``apply``, by power steps from ``v`` (any
    length: the first step's quotient, of ``v`` as it is, is not the one returned)."""

    def step(_, carry):  # the Rayleigh quotient of v beside the next v: `apply` traced once, in the loop
        v, _ = carry
        w = apply(v)
        squares, quotient = jnp.stack([w, v]) @ w  # w @ w and v @ w in one ordered product
        return w / jnp.maximum(jnp.sqrt(squares), jnp.finfo(w.dtype).tiny), quotient

    return jax.lax.fori_loop(0, POWER_STEPS + 1, step, (v, jnp.zeros_like(v[0])))[1]


# _exceeds' margin on its bound: far above the relative rounding of a power estimate or a row sum (n eps)
BOUND_MARGIN = 2.0**-10


def _exceeds(batch: jax.Array, scale: jax.Array, limit: jax.Array) -> jax.Array:
    """Whether the largest eigenvalue of the symmetric PSD ``scaled = batch / (scale scaleᵀ)``, by its power
    estimate (and at least its largest diagonal), exceeds ``limit``. Where ‖scaled‖∞ (which bounds every eigenvalue)
    does not reach ``limit``, false without the power steps: the same answer (a NaN bound runs them),
    at the cost of one pass over ``batch`` where the steps took 13 (most micro-batches of a shard,
    once it holds many of them). ``scaled`` is formed where it is read, so the bound's pass is its only one."""

    def scaled():
        return batch / jnp.outer(scale, scale)

    def estimate():
        operator = scaled()
        largest = _power_estimate(lambda v: operator @ v, jnp.ones_like(operator[0]))
        return jnp.maximum(largest, jnp.max(_diagonal(operator))) > limit

    # ‖·‖∞ from column sums: `batch` is symmetric (a Gram), so they are the row sums, and a sum along the rows
    # needs no transposed copy (under logical_shards bitwise the row sums: the same tree over the same values);
    # |batch| / (scale scaleᵀ) is |scaled| (scale > 0), an expression apart from the estimate's, so XLA keeps it in
    # the sum's first pass instead of a copy
    bound = jnp.max(jnp.sum(jnp.abs(batch) / jnp.outer(scale, scale), axis=0))
    never = jax.lax.full_like(bound, False, bool)  # varies as bound does inside shard_map
    return jax.lax.cond(bound * (1 + BOUND_MARGIN) <= limit, lambda: never, estimate)


def _power_of_two_below(x: jax.Array) -> jax.Array:
    """The largest power of two ``<= x`` (``x > 0``).

    The floor only sets when to re-whiten; as a power of two it does not carry the last
    bits of a power estimate, which XLA rounds differently in programs compiled for other
    device counts (``logical_shards`` promises the same accumulator on every split).
    """
    _, exponent = jnp.frexp(x)
    return jnp.ldexp(jnp.ones_like(x), exponent - 1)


def _root(m: jax.Array) -> jax.Array:
    """Rows ``F`` with ``FᵀF = m`` (symmetric PSD): its Cholesky factor, zero rows where it is singular."""
    scale, u, deflated, _ = _correlation_root(m, deflate=True, inverse=False)
    flat = deflated | (_diagonal(m) <= 0)
    return jnp.where(flat[:, None], 0.0, u) * scale[None, :]


class _Rows(NamedTuple):
    """The rows a fold adds, as blocks of one row count (:func:`_row_blocks`, zero rows after the last ones, which add
    nothing): before ``b``'s where the fold has them, a young shard's rows (``head``, ``2 n``, in parts stacked in
    order); ``first``, the first block to fold (past the young rows' where there are none). One loop over the blocks
    serves both: the transform and Gram of the rows are compiled once per fold, where ``b``'s and the young rows' were
    two copies of them. The young rows are cut into blocks only in the loop's turns that read them (a branch), not
    copied beside ``b``'s each fold: an adult's ``add`` at d=256 spent 0.06-0.08 ms of about 1.8 a 256-row
    micro-batch under ``logical_shards`` copying 2n rows it never read."""

    blocks: jax.Array  # (count, rows, n): b's
    head: tuple = ()   # a young shard's rows, parts stacked in order
    first: jax.Array | int = 0

    @classmethod
    def of(cls, b: jax.Array, head: tuple = (), has_head: jax.Array | None = None) -> _Rows:
        rows = min(BLOCK_ROWS, max(b.shape[0], sum(part.shape[0] for part in head)))
        out = cls(_row_blocks(b, rows), tuple(head))
        return out._replace(first=jnp.where(has_head, 0, out.heads)) if head else out

    @property
    def heads(self) -> int:
        """The head's blocks."""
        return -(-sum(part.shape[0] for part in self.head) // self.blocks.shape[1])

    def map(self, f) -> _Rows:
        """The same (row-wise) transform of every row."""
        blocks = f(self.blocks.reshape(-1, self.blocks.shape[2])).reshape(self.blocks.shape)
        return self._replace(blocks=blocks, head=tuple(map(f, self.head)))

    def block(self, i) -> jax.Array:
        """Block ``i`` of the head's blocks and then ``b``'s."""
        heads, size = self.heads, self.blocks.shape[1]

        def of_b():
            return jax.lax.dynamic_index_in_dim(self.blocks, jnp.maximum(i - heads, 0), keepdims=False)

        def of_head():
            rows = jnp.concatenate(self.head)
            rows = jnp.pad(rows, ((0, heads * size - rows.shape[0]), (0, 0)))
            return jax.lax.dynamic_slice_in_dim(rows, jnp.minimum(i, heads - 1) * size, size)

        return jax.lax.cond(i < heads, of_head, of_b) if heads else of_b()

    def reduce(self, reduce) -> jax.Array:
        """``reduce`` (a sum over rows) of all the rows: its values on the blocks added in order, ``reduce`` traced
        once. A block has at most ``BLOCK_ROWS`` rows: XLA:CPU splits a longer reduction between threads by how many
        devices the process has, so a young shard's rows and a micro-batch summed at once would make the fold depend
        on the device count."""
        blocks = self.blocks
        out = jax.eval_shape(reduce, blocks[0])
        zero = jnp.zeros(out.shape, out.dtype) + jnp.zeros_like(blocks[0, 0, 0])  # varying like rows in shard_map

        def one(i, total):
            return total + reduce(self.block(i))

        return jax.lax.fori_loop(self.first, self.heads + blocks.shape[0], one, zero)

    def gram(self, to_basis) -> jax.Array:
        """``cᵀc`` of the rows taken to a basis (``c = to_basis(rows)``)."""
        return self.reduce(lambda part: _gram(to_basis(part)))


def _row_blocks(rows: jax.Array, size: int) -> jax.Array:
    """``rows`` as blocks of ``size`` rows, zero rows after the last ones."""
    count = -(-rows.shape[0] // size)
    return jnp.pad(rows, ((0, count * size - rows.shape[0]), (0, 0))).reshape(count, size, rows.shape[1])


class _Whitening(NamedTuple):
    basis: jax.Array
    gram: jax.Array      # the rows seen before this micro-batch, in `basis`
    batch: jax.Array     # this micro-batch's Gram in `basis`
    floor: jax.Array
    diagonal: jax.Array


def _rewhiten(state: _Whitening, rows: _Rows, start: jax.Array, targets: int, deflate) -> _Whitening:
    """One pass: a basis that whitens ``gram + batch``; ``gram`` moved to it, ``rows`` redone in it.

    The new basis columns are scaled to unit norm in the ``start`` units, so a direction
    without data (noise) is never amplified from pass to pass. Whether a diagonal basis
    still does is decided on the centred ``X`` columns: with the ones column first,
    ``U[1:, 1:]`` factors the correlations of the centred columns (a Schur complement),
    the ones column's correlations say how far the shift is from the mean, and the last
    ``targets`` columns (a regression's ``y``, collinear with ``X`` when the fit is
    good) are no reason to whiten.
    """
    scale, u, deflated, u_inv = _correlation_root(state.gram + state.batch, deflate)
    lead = u.shape[0] - targets
    centred = u[1:lead, 1:lead]
    inverse = u_inv[1:lead, 1:lead]
    smallest = 1.0 / _power_estimate(lambda v: inverse @ (inverse.T @ v), jnp.ones_like(inverse[0]))
    largest = jnp.max(jnp.sum(jnp.abs(centred.T @ centred), axis=1))  # ‖·‖∞ bounds the largest eigenvalue
    offset = jnp.max(jnp.abs(u[0, 1:lead]), initial=0.0)
    stay = state.diagonal & (largest <= DIAGONAL_COND * smallest) & (offset <= DIAGONAL_OFFSET)

    def keep_diagonal():  # a column scaling suffices: the sums keep their digits as they are
        return state._replace(floor=_power_of_two_below(smallest))

    def full():
        v = u_inv / scale[:, None]  # Vᵀ (gram + batch) V = I where it spans
        basis, v = _null_free(state.basis @ v, v, start, deflated)
        norms = jnp.linalg.norm(basis / start[:, None], axis=0)
        norms = jnp.where(norms > 0, norms, 1.0)[None, :]
        basis, v = basis / norms, v / norms
        batch = rows.gram(lambda part: _times_basis(part, basis))
        floor = jnp.full_like(smallest, 0.5)
        return _Whitening(basis, v.T @ state.gram @ v, batch, floor, jnp.zeros_like(state.diagonal))

    return jax.lax.cond(stay, keep_diagonal, full)


def _null_free(basis: jax.Array, v: jax.Array, start: jax.Array, null: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(basis T, v T)`` for the unit upper-triangular ``T`` such that the columns of ``w T`` (``w = basis /
    start``, the basis in the data's units) after a ``null`` column have no component along it (Gram-Schmidt in
    coefficient space).

    A column the data does not span (``b w_j = 0`` exactly) adds nothing to ``b w_k`` in
    exact arithmetic whatever its multiple in ``w_k``, but its rounding does: taking it
    out keeps a later column (a regression's ``y``) free of that noise.

    Only the ``null`` columns, in order, take a turn: another column's turn took out nothing. A turn takes
    column ``j`` (times ``beta``) off the columns after it in both, elementwise: ``basis T`` and ``v T`` without
    a matrix product (none at all where no column is null, most passes; under ``logical_shards`` each product is a
    handful of kernels to compile).
    """
    n = basis.shape[0]

    def after(j):  # the first null column after j; n where none is
        later = null & (jnp.arange(n) > j)
        return jnp.where(jnp.any(later), jnp.argmax(later), n)

    def one(carry):
        j, basis, v = carry
        w = basis / start[:, None]
        wj = w[:, j]
        products = wj @ w  # its j-th: wj @ wj (the same sum, term for term)
        beta = products / jnp.maximum(products[j], jnp.finfo(w.dtype).tiny)
        beta = jnp.where(jnp.arange(n) > j, beta, 0.0)
        return after(j), basis - jnp.outer(basis[:, j], beta), v - jnp.outer(v[:, j], beta)

    return jax.lax.while_loop(lambda carry: carry[0] < n, one, (after(-1), basis, v))[1:]


# The most rows one reduction of the fold sums at once (_Rows); as many as a micro-batch of a job with
# logical_shards (layout.REPRODUCIBLE_MICROBATCH), which XLA:CPU reduces in one thread.
BLOCK_ROWS = 256


def _gram(c: jax.Array) -> jax.Array:
    """``cᵀc`` of a block of at most ``BLOCK_ROWS`` rows."""
    return c.T @ c


def row_sums(b: jax.Array) -> jax.Array:
    """``(2, n)``: the column sums of ``b`` and of its squares."""
    # two sums, each column's (as one of both side by side was): under logical_shards each a tree whose first adds
    # read b (and square it) as they go, where the pair cost a copy of b beside its squares and a pass to square
    return jnp.stack([jnp.sum(b, axis=0), jnp.sum(b * b, axis=0)])


def _after_ones(delta: jax.Array) -> jax.Array:
    """``[0 | delta]``: a move of the shift as a whole row of ``b``'s columns (the ones column moves
    by exactly 0), so the sums and rows update in whole rows, not by scatters into their tails."""
    return jnp.concatenate([jnp.zeros_like(delta[:1]), delta])


def _recentred(acc: WhitenedAcc, rows: _Rows, sums: jax.Array) -> tuple[WhitenedAcc, _Rows]:
    """``acc`` and ``rows`` with the shift moved to the running mean (``sums`` include ``b``'s)
    in the columns whose mean is more than ``RECENTRE`` standard deviations from it.

    ``[1 | z - new] = [1 | z - old] T`` with ``T = [[1, (old - new)ᵀ], [0, I]]``; the basis
    becomes ``T⁻¹ W`` (its first row changes), so ``M`` stays as it is.
    """
    count = jnp.maximum(sums[0, 0], 1.0)
    mean = sums[0, 1:] / count
    variance = jnp.maximum(sums[1, 1:] / count - mean * mean, 0.0)
    delta = jnp.where(mean * mean > RECENTRE**2 * variance, mean, 0.0)
    basis = acc.basis.at[0].add(_times_basis(delta[None], acc.basis[1:])[0])
    move = _after_ones(delta)
    total, squares = sums[0], sums[1]
    sums = jnp.stack([total - sums[0, 0] * move, squares - 2 * move * total + sums[0, 0] * move * move])
    rows = rows.map(lambda b: b - b[:, :1] * move[None, :])
    return acc._replace(shift=acc.shift + delta, basis=basis, sums=sums), rows


def fold(acc: WhitenedAcc, rows: _Rows | jax.Array, rows_sums: jax.Array, targets: int = 0) -> WhitenedAcc:
    """Adds the rows (``[1 | z - shift]``; zero rows add nothing), whose data sums are ``rows_sums``."""
    rows = rows if isinstance(rows, _Rows) else _Rows.of(rows)
    sums = acc.sums + rows_sums
    batch = rows.gram(lambda part: _in_basis(part, acc.basis, acc.diagonal))
    # the running Gram's diagonal alone (its scales): the whole of it only where the fold re-whitens
    scale = _scales(_diagonal(acc.gram) - _diagonal(acc.compensation))
    big = _exceeds(batch, scale, GROWTH * acc.floor) & (rows_sums[0, 0] > 0)  # never for an empty micro-batch

    def rewhiten(acc):
        acc, moved_rows = _recentred(acc, rows, sums)  # moved @ new basis == rows @ old: batch and gram stand
        gram = acc.gram - acc.compensation
        state = _Whitening(acc.basis, gram, batch, acc.floor, acc.diagonal)

        def again(carry):
            i, s = carry
            return (i < PASSES) & ((i == 0) | ~s.diagonal)

        def one(carry):
            i, s = carry
            return i + 1, _rewhiten(s, moved_rows, acc.start, targets, deflate=i > 0)

        state = jax.lax.while_loop(again, one, (0, state))[1]
        return acc._replace(basis=state.basis, gram=state.gram, compensation=jnp.zeros_like(gram),
                            floor=state.floor, diagonal=state.diagonal), state.batch

    acc, batch = jax.lax.cond(big, rewhiten, lambda acc: (acc._replace(sums=sums), batch), acc)
    y = batch - acc.compensation  # Kahan: gram - compensation is the running sum
    total = acc.gram + y
    # y again for the compensation, apart (XLA then computes it inside both passes: two over n x n, not three)
    batch, compensation = jax.lax.optimization_barrier((batch, acc.compensation))
    return acc._replace(gram=total, compensation=(total - acc.gram) - (batch - compensation))


def _fresh(acc: WhitenedAcc, rows: _Rows) -> WhitenedAcc:
    """An empty whitened accumulator with ``acc``'s shift, in the units of ``rows``."""
    norms = jnp.sqrt(rows.reduce(lambda part: jnp.sum(part * part, axis=0)))
    start = 1.0 / jnp.where(norms > 0, norms, 1.0)
    zeros = jnp.zeros_like(acc.gram)
    return acc._replace(
        sums=jnp.zeros_like(acc.sums), start=start, basis=jnp.diag(start), gram=zeros, compensation=zeros,
        floor=jnp.zeros_like(acc.floor), diagonal=jnp.ones_like(acc.diagonal), young=jnp.zeros_like(acc.young),
    )


def _young_parts(acc: WhitenedAcc) -> tuple[jax.Array, jax.Array]:
    """A young accumulator's rows in the two parts that hold them, in order (:func:`_young_rows`)."""
    return acc.gram, acc.compensation


def _young_rows(acc: WhitenedAcc) -> jax.Array:
    """A young accumulator's rows ``b`` (``2 n`` of room: its first ``count`` rows, zero after them)."""
    return jnp.concatenate(_young_parts(acc))


def _grown(acc: WhitenedAcc, rows: jax.Array, keep: jax.Array, sums: jax.Array) -> WhitenedAcc:
    """A young accumulator with the ``rows`` where ``keep`` appended to its own, in order (``sums`` the
    data's sums of them); the caller knows they fit (fewer than ``2 n`` rows in all). Each row is moved
    whole (a scatter of unique places; the others dropped), so the rows stay exactly what they were."""
    n = acc.gram.shape[0]
    kept = jnp.cumsum(keep.astype(jnp.int32)) - 1  # integers: the same on every split
    here = wide.to_float(acc.count, jnp.float32).astype(jnp.int32)  # below 2 n
    place = jnp.where(keep, here + kept, 2 * n + jnp.arange(keep.shape[0]))  # out of range: dropped
    out = _young_rows(acc).at[place].set(rows, mode="drop", unique_indices=True)
    return acc._replace(gram=out[:n], compensation=out[n:], sums=acc.sums + sums)


def _young_enough(acc: WhitenedAcc, more) -> jax.Array:
    """Whether a young accumulator has, with ``more`` rows, the ``2 n`` rows to whiten."""
    return wide.to_float(acc.count, acc.gram.dtype) + more >= 2 * acc.gram.shape[0]


def add(acc: WhitenedAcc, z: jax.Array, mask: jax.Array, targets: int = 0, weights: jax.Array | None = None
        ) -> WhitenedAcc:
    """Folds the rows ``z`` where ``mask`` is True; the last ``targets`` columns of ``z`` are ``y``.
    With ``weights`` each row is scaled by ``√w`` (:func:`.tsqr.scaled`; the sums that steer
    re-centring are then those of the scaled rows, which only moves when it happens)."""
    z = z.astype(acc.gram.dtype)
    nb = row_count(mask)
    fresh = wide.is_zero(acc.count)
    shift = jnp.where(fresh, reference_point(acc.shift, z, mask, nb), acc.shift)
    acc = acc._replace(shift=shift)
    b = scaled(augmented(z, shift, mask), weights)
    sums = row_sums(b)

    stays_young = acc.young & ~_young_enough(acc, nb.astype(z.dtype))
    folded = jax.lax.cond(stays_young, lambda acc: _grown(acc, b, mask, sums),
                          lambda acc: _whiten(acc, b, sums, targets), acc)
    return folded._replace(count=wide.add_int32(acc.count, nb))


def _whiten(acc: WhitenedAcc, b: jax.Array, sums: jax.Array, targets: int) -> WhitenedAcc:
    """``acc`` with the rows ``b`` folded in (``sums``: the data's sums of them): an adult folds them; a
    young accumulator, which then has enough rows, becomes one with its own rows and ``b``."""
    grows_up = acc.young
    rows = _Rows.of(b, _young_parts(acc), grows_up)  # an adult's gram and compensation: never read
    rows_sums = jnp.where(grows_up, acc.sums + sums, sums)
    acc = jax.lax.cond(grows_up, lambda acc: _fresh(acc, rows), lambda acc: acc, acc)
    return fold(acc, rows, rows_sums, targets)


def _rows(acc: WhitenedAcc) -> jax.Array:
    """Rows ``F`` (2n x n) with ``FᵀF = Σ bᵀb``: a young accumulator's own rows, else ``chol(M) W⁻¹``
    and n zero rows. A diagonal ``W`` (but for its first row ``u``: ``W = D + e₀uᵀ``, ``u₀ = 0``) has
    ``W⁻¹ = D⁻¹ - D⁻¹e₀uᵀD⁻¹``, so ``chol(M) W⁻¹`` is a column scaling and a rank-one term, elementwise: no
    triangular inverse and product (under ``logical_shards``, compiled cheaply: about 25 ms of a 60 ms merge)."""
    root = _root(acc.gram - acc.compensation)

    def diagonal():
        scale = _diagonal(acc.basis)
        first = acc.basis[0].at[0].set(0.0) / scale
        return root / scale[None, :] - (root[:, :1] / scale[0]) * first[None, :]

    adult = jax.lax.cond(acc.diagonal, diagonal, lambda: root @ dense.triangular_inverse(acc.basis))
    return jnp.where(acc.young, _young_rows(acc), jnp.concatenate([adult, jnp.zeros_like(adult)]))


def _moved_sums(sums: jax.Array, old: jax.Array, new: jax.Array) -> jax.Array:
    """Sums of ``z - old`` and their squares, as sums of ``z - new``."""
    move = _after_ones(old - new)
    total, squares = sums[0], sums[1]
    return jnp.stack([total + sums[0, 0] * move, squares + 2 * move * total + sums[0, 0] * move**2])


def merge(a: WhitenedAcc, b: WhitenedAcc, targets: int = 0) -> WhitenedAcc:
    """Adds ``b``'s rows to ``a``; into ``b`` instead when only ``a`` is young. Two young accumulators'
    rows are appended while they fit (fewer than ``2 n`` in all), else whitened, as ``add`` does."""
    a_empty, b_empty = wide.is_zero(a.count), wide.is_zero(b.count)
    into_b = a.young & ~b.young
    host, guest = jax.lax.cond(into_b, lambda: (b, a), lambda: (a, b))  # copies, not a select kernel a leaf
    rows = moved(_rows(guest), guest.shift, host.shift)
    sums = _moved_sums(guest.sums, guest.shift, host.shift)
    stays_young = host.young & ~_young_enough(host, wide.to_float(guest.count, rows.dtype))  # then both young
    merged = jax.lax.cond(stays_young, lambda h: _grown(h, rows, jnp.ones(rows.shape[:1], bool), sums),
                          lambda h: _whiten(h, rows, sums, targets), host)
    out = jax.lax.switch(jnp.where(a_empty, 0, jnp.where(b_empty, 1, 2)), [lambda: b, lambda: a, lambda: merged])
    return out._replace(count=wide.add(a.count, b.count))


def _host_root(m: np.ndarray) -> np.ndarray:
    """A float64 ``F`` with ``FᵀF = m`` (symmetric, positive semidefinite): Cholesky of the
    correlations when definite, else a square root from their eigen-decomposition.

    Columns with a zero diagonal (a constant column: exactly zero in every basis) stay
    exactly zero, so no eigenvector rounding makes them look like data.
    """
    live = np.diag(m) > 0
    sub = m[np.ix_(live, live)]
    scale = np.sqrt(np.diag(sub))
    k = (sub + sub.T) / 2 / np.outer(scale, scale)
    try:
        root = np.linalg.cholesky(k).T
    except np.linalg.LinAlgError:
        values, vectors = np.linalg.eigh(k)
        root = np.sqrt(np.maximum(values, 0.0))[:, None] * vectors.T
    out = np.zeros_like(m, dtype=np.float64)
    out[np.ix_(live, live)] = root * scale
    return out


def _right_divide_upper(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``a W⁻¹`` for an upper-triangular ``W``, by substitution (componentwise stable)."""
    x = np.zeros_like(a)
    for j in range(w.shape[0]):
        x[:, j] = (a[:, j] - x[:, :j] @ w[:j, j]) / w[j, j]
    return x


def factor(acc: WhitenedAcc) -> Factor:
    """The host :class:`Factor`, in float64: R of ``chol(M) W⁻¹`` (or of a young shard's rows), its
    first row giving the mean."""
    gram, compensation = np.asarray(acc.gram, np.float64), np.asarray(acc.compensation, np.float64)
    if bool(np.asarray(acc.young)):
        rows = np.concatenate([gram, compensation])
    else:
        # an accumulator that overflowed holds inf: its NaN factor is what the solve reports, in one line, so no
        # numpy warning of the arithmetic on the way
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            rows = _right_divide_upper(_host_root(gram - compensation), np.asarray(acc.basis, np.float64))
    r = np.linalg.qr(rows, mode="r")
    count = int(wide.to_int(acc.count))
    head = r[0, 0] if count and r[0, 0] else 1.0
    mean = np.asarray(acc.shift, np.float64) + r[0, 1:] / head
    eps = np.finfo(np.asarray(acc.gram).dtype).eps
    return Factor(count, mean, r[1:, 1:], noise=eps * max(r.shape[0], 10))
