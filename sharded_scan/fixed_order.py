"""Matrix products whose every rounding the program fixes, not the CPU's matmul library.

XLA:CPU hands a ``dot`` to a library kernel (Eigen's tensor contraction) that chooses how
to cut the contraction at run time: by the size of the process's thread pool (with 4 or
more simulated devices it splits the 256 rows of a ``(256, 96)ᵀ(256, 96)`` product over
threads and adds the pieces, with 1-3 it does not), by the CPU's cache sizes, and by the
output's width (a column block of a ``model`` axis takes other paths than the whole
matrix). The same program then rounds differently on another split of a job or another
machine. :func:`fixed_order` evaluates a function with every floating-point ``dot_general``
computed so that each output element is a function of its row and column alone, every rounding
fixed by the code: for float32 (and narrower), the contraction cut into the fewest blocks of at most 256
indices, of one width, each row (column) of a block rounded to a grid of 22 bits below its largest
magnitude, so that the block's float64 matmul sums integers below 2^53, exact in whatever order the kernel
adds them (threads, caches, FMA or not); the blocks added in index order, rounded once
(:func:`exact_block_dot`). The hardware's matmul does the work, so it costs about what a float64 matmul
costs; the engine uses it only where it promises bitwise results (``logical_shards`` on CPU). A Gram
``xᵀ x`` rounds each column once and computes, of column groups at least 128 wide, the blocks on and above the
diagonal (:func:`ordered_gram`, the same bits); its column sums beside it, where a program asks for both by
name (:data:`TOGETHER`: Covariance's), come from the same pass (:func:`ordered_column_sums_and_gram`). A
matrix-vector product (or a dot of vectors) needs no grid: its terms, exact in float64, are added in the
tree of a float32 sum (below), under half the kernels to compile. float64 products are added one contraction
index after another instead (slower: elementwise loops). A float32 sum is a fixed pairwise tree of float64
adds (:func:`tree_sum64`); QR's R a blocked Householder QR whose updates are such products (:func:`ordered_qr_r`).

Not float32 matmuls: a block's products summed exactly in float32 need ``2 b + log2(BLOCK) <= 24``
for operands of ``b`` bits (integers below ``2^b``: each product below ``2^(2b)``, a block's ``BLOCK`` of
them below ``2^(2b + log2 BLOCK)``, and float32 holds every integer below ``2^24`` exactly, none above
for certain), so ``b = 8`` at ``BLOCK = 256`` (a relative rounding of ``2^-8`` per operand), and
still ``b = 10`` at ``BLOCK = 16`` (then 16 partial matrices to add a micro-batch). The 22 bits kept
here would take operands cut into 8-bit slices: 6 float32 matmuls to keep every term above ``2^-22``,
against one float64 matmul at 1.5-2x the cost of one float32 matmul (measured on XLA:CPU, AVX-512).

It fails closed: every primitive of ``fn`` (inside loops, branches and calls) is one it
rewrites with roundings the code fixes (float ``dot_general``, ``reduce_sum``, ``reduce``, a
scatter-add of repeated indices, cumulative sums and products, ``qr``'s R, and a float ``div``, IEEE's
quotient behind an optimization barrier, which XLA's simplifier cannot make a product with a
reciprocal in one program and leave in another: :func:`divided`), one it follows
(``jit``, ``scan``, ``while``, ``cond``, custom derivative rules, ``remat``), one whose every
output element is the same whatever the order XLA computes it in (:data:`ORDER_FREE`:
elementwise arithmetic, moves, comparisons, max/min, sorts; a scatter-add of unique indices),
or one with integer operands only (exact in any order). Anything else (an LAPACK call other than
QR's R, a convolution, an FFT, a custom call or callback, a nested jaxpr it does not follow) is
refused with a :class:`~sharded_scan.errors.UsageError` when ``fn`` is traced; :func:`unpinned`
names them beforehand (``program.check_pinned`` checks a job's ``add`` and ``merge`` with it
before any compute).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal

from sharded_scan.errors import UsageError

# float64 products: contraction indices a loop iteration adds (one pass over the output), and the most
# product elements a chunk may hold.
CHUNK, CHUNK_ELEMENTS = 2, 1 << 20


def fixed_order(fn: Callable, who: str = "this function") -> Callable:
    """``fn`` with every floating-point matrix product and sum in an order the code fixes.

    Control flow (``scan``, ``while_loop``, ``cond``/``switch``), ``jit`` and custom
    derivative rules inside ``fn`` are followed; an order-free primitive runs as it is; any
    other one raises :class:`~sharded_scan.errors.UsageError` (:func:`refusal`, naming ``who``) as
    ``fn`` is traced.
    """

    def wrapped(*args):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        names = unpinned(closed)
        if names:
            raise UsageError(refusal(who, names))
        out = _evaluate(closed, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out_shape), out)

    return wrapped


def ordered_dot_general(lhs, rhs, dimension_numbers, preferred_element_type=None, **_) -> jax.Array:
    """``lax.dot_general`` with every rounding of each output element fixed by the code, not the kernel.

    A float32 (or narrower) result is :func:`exact_block_dot`'s, rounded once to the result dtype:
    float64 matmuls whose sums are exact in any order, blocks added in index order; a matrix-vector product's
    (one free index on a side, at most ``CHUNK_ELEMENTS`` terms) its terms in float64 (exact) added in
    :func:`tree_sum64`'s tree, within ``ceil(log2 k) 2^-53 sum|a b|``. Any other float
    (float64) is summed in contraction-index order in its own dtype, its products reaching the adds
    through a loop's state (one iteration later, so no add has a multiply in its expression for
    XLA:CPU to contract). ``precision`` does not apply.
    """
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    dtype = np.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
    lhs_free = [d for d in range(lhs.ndim) if d not in lhs_contract and d not in lhs_batch]
    rhs_free = [d for d in range(rhs.ndim) if d not in rhs_contract and d not in rhs_batch]
    batch_shape = [lhs.shape[d] for d in lhs_batch]
    out_shape = (*batch_shape, *(lhs.shape[d] for d in lhs_free), *(rhs.shape[d] for d in rhs_free))
    k = math.prod(lhs.shape[d] for d in lhs_contract)
    b = math.prod(batch_shape)
    m, n = math.prod(lhs.shape[d] for d in lhs_free), math.prod(rhs.shape[d] for d in rhs_free)
    if k == 0:
        return jnp.zeros(out_shape, dtype)

    def operand(x, contract, batch, free, shape, as_dtype):
        return jnp.transpose(x, (*contract, *batch, *free)).reshape(k, *shape).astype(as_dtype)

    if dtype in EXACT_IN_FLOAT64 and min(m, n) == 1 and b * m * n * k <= CHUNK_ELEMENTS:
        # a matrix-vector product (or a dot of vectors): each term exact in float64, added in tree_sum64's order
        with jax.enable_x64(True):
            left = operand(lhs, lhs_contract, lhs_batch, lhs_free, (b, m, 1), np.float64)
            right = operand(rhs, rhs_contract, rhs_batch, rhs_free, (b, 1, n), np.float64)
            # the terms' products made where the tree's first levels read them (each exact: where an add takes its
            # product in, an FMA or not, the sum is the same), those levels one pass (_tree_levels)
            count, rows = _tree_levels(k, lambda i, j: (left[i:j] * right[i:j]).reshape(j - i, b * m * n),
                                       MATVEC_LEVELS)
            return tree_sum64(rows(0, count)).astype(dtype).reshape(out_shape)
    if dtype in EXACT_IN_FLOAT64:
        with jax.enable_x64(True):
            left = jnp.transpose(lhs, (*lhs_batch, *lhs_free, *lhs_contract)).reshape(b, m, k)
            right = jnp.transpose(rhs, (*rhs_batch, *rhs_contract, *rhs_free)).reshape(b, k, n)
            return exact_block_dot(left, right, dtype).reshape(out_shape)
    return _products_summed_a_loop_later(
        operand(lhs, lhs_contract, lhs_batch, lhs_free, (b, m, 1), dtype),
        operand(rhs, rhs_contract, rhs_batch, rhs_free, (b, 1, n), dtype), b * m * n,
    ).reshape(out_shape)


# A matrix-vector product's tree levels computed in its first pass (_tree_levels).
MATVEC_LEVELS = 3
# Float dtypes whose values are exact in float64 with room to spare (significands of at most 24 bits).
EXACT_IN_FLOAT64 = tuple(np.dtype(t) for t in (np.float32, np.float16, jnp.bfloat16))
# exact_block_dot: contraction indices a block (one float64 matmul), and the bits each operand keeps below its
# block's largest magnitude: BITS + BITS + log2(BLOCK) <= 53, so every partial sum of a block is exact.
BLOCK, BITS = 256, 22
# ordered_column_sums_and_gram: the bits a column sum keeps below its block's largest: SUM_BITS + log2(BLOCK) <= 52.
SUM_BITS = 44


def exact_block_dot(left: jax.Array, right: jax.Array, dtype) -> jax.Array:
    """``left @ right`` (``(b, m, k) @ (b, k, n)``, float32 or narrower values) in ``dtype``, rounded in
    a way no kernel chooses: the contraction cut into the fewest blocks of at most :data:`BLOCK` indices, of one
    width (:func:`block_width`); in each block every row
    of ``left`` (column of ``right``) rounded to :data:`BITS` bits below its largest magnitude's power of two
    (an integer times a power of two: elementwise, order-free); each block's matmul then sums integers below
    2^53, exact in any order (thread split, cache blocking, FMA or not); blocks added in index order.

    So each output element is a function of its row and column alone, whatever the shapes, batch, threads
    or CPU: one float64 matmul a block, the hardware's. It differs from the exact product by at most
    ``2^-BITS (max|a| sum|b| + max|b| sum|a|)`` over each block (less than float32's matmul bound, ``k eps
    sum|a b|``, but for values far below their block's largest). Non-finite values as IEEE's sum of
    products (NaN, +-inf); an exact zero is +0.
    """
    b, m, k = left.shape
    n = right.shape[2]
    # the fewest blocks of at most BLOCK indices, of one width (:func:`block_width`), the last padded with zeros, which
    # add nothing and move no block's largest: one matmul for them all (blocks of BLOCK and a ragged last one were two
    # of each kernel where k is a little above BLOCK, as n = 258 is, and padding to BLOCK cost k = 258 a matmul of 512)
    blocks, width = block_width(k)
    pad = blocks * width - k
    left = jnp.pad(left, ((0, 0), (0, 0), (0, pad))).reshape(b, m, blocks, width)
    right = jnp.pad(right, ((0, 0), (0, pad), (0, 0))).reshape(b, blocks, width, n)
    sums = _block_sums(left, right)  # (b, blocks, m, n)
    return _in_block_order(jnp.moveaxis(sums, 1, 0)).astype(dtype)  # rounded once


def block_width(k: int) -> tuple[int, int]:
    """``(blocks, width)``: a contraction of ``k`` indices cut into the fewest blocks of at most :data:`BLOCK`, each
    ``width`` wide (``blocks * width - k < blocks`` zeros after the last index)."""
    blocks = max(1, -(-k // BLOCK))
    return blocks, -(-k // blocks)


def _block_sums(left: jax.Array, right: jax.Array) -> jax.Array:
    """Each block's exact products for :func:`exact_block_dot`: ``(b, m, blocks, w) @ (b, blocks, w, n)`` (float32 or
    narrower) -> ``(b, blocks, m, n)`` (float64), each row of a block (column of ``right``) rounded to its grid, one
    matmul of integers."""
    scale_left, unit_left = _grid(_largest_finite(left, axis=3), BITS)  # (b, m, blocks)
    scale_right, unit_right = _grid(_largest_finite(right, axis=2), BITS)  # (b, blocks, n)
    left, right = left.astype(np.float64), right.astype(np.float64)
    # the blocks before the rows as they are rounded (one pass), so the matmul's batch comes first: no copy of the
    # rounded left operand to move it there (a 256 x 258 one cost a pass, where k = 258 is two blocks); each value
    # on its grid times the grid's power of two (exact), as ordered_column_sums_and_gram's: the products of a row
    # and a column then share one power of two, their sums exact as the integers' (float32 values' powers of two
    # stay far inside float64's range), the same bits; and the m x n fusion after the matmul, where XLA computed
    # each power from its row's and column's largest again for each entry, scales nothing
    q_left = jnp.moveaxis(_rounded(left, scale_left[..., None]) * unit_left[..., None], 2, 1)  # (b, blocks, m, w)
    q_right = _rounded(right, scale_right[:, :, None, :]) * unit_right[:, :, None, :]
    # (b, blocks, m, n): integers below 2^53 times one power of two each, exact whatever order the matmul adds them
    # in; a NaN or inf stays one, and IEEE's NaN (a NaN, inf * 0, +inf + -inf) or +-inf comes out of any order alike
    return jax.lax.dot_general(q_left, q_right, (((3,), (2,)), ((0, 1), (0, 1))))


def ordered_gram(x: jax.Array) -> jax.Array:
    """``xᵀ x`` (``x``: ``(k, d)``, float32 or narrower), bitwise :func:`exact_block_dot`'s ``(xᵀ, x)``: each
    column of a block rounded to its grid once (the product's left rows are its right columns, on the same
    grids), and each block's sums (integers, exact) computed for the blocks of columns on and above the diagonal
    (:func:`gram_parts`), the rest their transposes: every entry is the same exact sum, computed once."""
    return ordered_column_sums_and_gram(x, gram_parts(x.shape[1], GRAM_ALONE_WIDTH))[1]


def ordered_column_sums_and_gram(x: jax.Array, parts: int | None = None) -> tuple[jax.Array, jax.Array]:
    """``(x.sum(0), xᵀ x)`` from one pass for each column's largest (``x``: ``(k, d)``, float32 or narrower): the Gram
    :func:`ordered_gram`'s, and each column's sum per block of :data:`BLOCK` rows that of its values rounded to
    :data:`SUM_BITS` bits below the block's largest (integers below 2^44 times a power of two: summed exactly in
    any order), blocks added in order, rounded once: a function of the column alone, within ``2^-45`` of the
    block's largest per value (:func:`tree_sum64`'s bound is ``8 2^-53 sum|x|`` a block of 256), so the residual
    digits a Covariance keeps of its mean stay. Where a program needs both (:data:`TOGETHER`) the sums take one
    rounding and a sum beside the Gram's, not the tree's passes. Non-finite values as IEEE's sum, an exact zero +0.
    ``parts``: column groups, :func:`gram_parts`'s if None (any gives the same bits)."""
    k, d = x.shape
    if k == 0:
        return jnp.zeros((d,), x.dtype), jnp.zeros((d, d), x.dtype)
    with jax.enable_x64(True):
        blocks, width = block_width(k)  # exact_block_dot's blocks
        values = jnp.pad(x, ((0, blocks * width - k), (0, 0))).reshape(blocks, width, d)
        scale, unit = _grid(_largest_finite(values, axis=1), BITS)  # (blocks, d)
        values = values.astype(np.float64)
        # each value on its column's grid: an integer below 2^22 times the column's power of two, so a block's
        # products for one entry of the Gram are integers times one power of two, their sums exact (as
        # exact_block_dot's, its powers multiplied in before the matmul, not after: the same bits; the d x d
        # fusions after it then scale nothing, where XLA recomputed each power from its column's largest for
        # each entry)
        on_grid = _rounded(values, scale[:, None, :]) * unit[:, None, :]
        # (d, d): each block's exact sums added in block order and rounded to x's dtype before the blocks are put
        # together (elementwise, so the same bits), where the whole float64 matrix was assembled first (a pass)
        gram = _symmetric_products(on_grid, parts or gram_parts(d), lambda p: _in_block_order(p).astype(x.dtype))
        # each block's column sums as the matmul of its rows with ones (integers below 2^(44 + 8): exact; XLA:CPU's
        # matrix-vector product, where a reduce over the rows went to a slower kernel: Covariance's add 0.18 ->
        # 0.17 CPU-ms a micro-batch at d=96, 0.92 -> 0.87 at d=256)
        fine = _rounded(values, (scale * 2.0 ** (SUM_BITS - BITS))[:, None, :])
        ones = jnp.ones((blocks, 1, fine.shape[1]), fine.dtype)
        sums = jax.lax.dot_general(ones, fine, (((2,), (1,)), ((0,), (0,))))[:, 0] * (unit * 2.0 ** (BITS - SUM_BITS))
        return _in_block_order(sums).astype(x.dtype), gram


def _rounded(values: jax.Array, scale: jax.Array) -> jax.Array:
    """``values`` times ``scale`` (powers of two: exact) rounded half to even: integers."""
    return jax.lax.round(values * scale, jax.lax.RoundingMethod.TO_NEAREST_EVEN)


def _in_block_order(blocks: jax.Array) -> jax.Array:
    """The exact per-block results ``blocks`` (leading axis) added in block order, an exact zero +0."""
    acc = blocks[0]
    for block in range(1, blocks.shape[0]):  # the program's own adds, which XLA keeps
        acc = acc + blocks[block]
    return jnp.where(acc == 0, 0.0, acc)


# Calls fixed_order computes by a rule of its own rather than primitive by primitive, known by their ``jit``'s name
# (a dotted one, which no ``def`` of a user's can take): the statistics family's ``column_sums_and_gram``
# (``(column sums of v, vᵀv)``: Covariance's, Correlation's co-moments) gets both from one pass for each column's
# largest. Its arguments and results as the call's; a rule
# returns None for operands it does not take (a vmapped call), whose body is then followed. A module may add its own
# (``dense``'s Cholesky block rows: under fixed_order a formulation XLA:CPU runs faster, the same bits, where the
# plain program keeps the one it rounded with).
def _column_sums_and_gram(v, *rest):
    if rest or v.ndim != 2 or np.dtype(v.dtype) not in EXACT_IN_FLOAT64:
        return None
    return ordered_column_sums_and_gram(v)


TOGETHER: dict[str, Callable] = {"sharded_scan.column_sums_and_gram": _column_sums_and_gram}


# ordered_gram cuts a Gram's columns into groups at least GRAM_ALONE_WIDTH wide, a Gram beside its column sums
# (ordered_column_sums_and_gram: Covariance's) at least GRAM_PART_WIDTH (at most GRAM_MAX_PARTS), and computes the
# blocks on and above the diagonal. 128 was chosen when the products were Eigen's (XLA:CPU's kernel for a contraction
# over the rows' axis, xᵀx as stored), which split a small block's 256-row sum between threads and packed each part
# (8 simulated devices on 2 cores, CPU-ms a 256-row block: d=96 in halves 0.19-0.22 against 0.14-0.15 whole; d=256
# in halves 0.79 against 0.88). The products now take both operands as rows (_symmetric_products: YNNPACK's kernel,
# one thread), and 64-wide groups (d=256 in quarters: 10 products of 16) make a steady add at d=256 cheaper where
# the rounding writes each group's rows itself (--add, three pairs, load 2-5: Gram 0.43-0.47 -> 0.38-0.41 CPU-ms,
# LinearRegression 0.90-0.92 -> 0.75-0.84), not Covariance's, whose rounded values its column sums read too and which
# are then copied into each group (ratios 0.39-0.51 against 0.49-0.69). The same bits for any groups.
GRAM_PART_WIDTH, GRAM_MAX_PARTS = 128, 4
GRAM_ALONE_WIDTH = 64


def gram_parts(d: int, width: int = GRAM_PART_WIDTH) -> int:
    """How many column groups a ``d``-wide Gram is cut into, each at least ``width`` wide."""
    return max(1, min(GRAM_MAX_PARTS, d // width))


def _symmetric_products(q: jax.Array, parts: int, finish: Callable) -> jax.Array:
    """``finish`` (elementwise over the last two axes) of ``qᵀ q`` per leading block (exact sums of integers below
    2^53, so each block of the result is the same whichever matmul computes it): the blocks on and above the diagonal
    of ``parts`` column groups computed and finished, the rest their transposes.

    Each product takes both operands as rows (``qᵀ``'s, a row per column of ``q``: ``A Bᵀ``), which XLA:CPU hands to
    YNNPACK's float64 kernel, where ``q``'s columns contracted over its rows went to Eigen's, split between the
    thread pool's threads: the three products of a d=256 Gram's halves 0.52 -> 0.29 CPU-ms (jitted alone), a steady
    ``logical_shards`` ``add`` (``python bench/fixed_order.py --add --only "d=256"``) Gram 0.63-0.80 -> 0.44-0.47,
    Covariance 0.77-0.97 -> 0.52-0.62, LinearRegression 1.13-1.55 -> 0.95. A Gram's rounding writes each
    group's rows of ``qᵀ`` as it goes (Covariance's, which its column sums read too, is copied into them)."""
    d = q.shape[2]
    rows_of = jnp.swapaxes(q, 1, 2)

    def product(i0, i1, j0, j1):
        return finish(jax.lax.dot_general(rows_of[:, i0:i1], rows_of[:, j0:j1], (((2,), (2,)), ((0,), (0,)))))

    if parts == 1:
        return product(0, d, 0, d)
    edges = [d * i // parts for i in range(parts + 1)]
    product = {(i, j): product(edges[i], edges[i + 1], edges[j], edges[j + 1])
               for i in range(parts) for j in range(i, parts)}
    rows = [jnp.concatenate([product[i, j] if j >= i else product[j, i].T for j in range(parts)], axis=1)
            for i in range(parts)]
    return jnp.concatenate(rows, axis=0)


def _largest_finite(x: jax.Array, axis: int) -> jax.Array:
    """The largest finite magnitude along ``axis`` (0 where none), in float64: found in ``x``'s own dtype (exact),
    where a float64 copy's cost a pass more to convert it (XLA kept the copy apart from the maximum), and the largest
    magnitude first, non-finite values dropped in a second pass only where one shows in it (a NaN shows whether the
    maximum propagates NaN or skips it: then it is the finite values' largest, or -inf where there are none)."""
    largest = jnp.max(jnp.abs(x), axis=axis)

    def of_finite():
        return jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), 0), axis=axis)

    return jax.lax.cond(jnp.all(jnp.isfinite(largest)), lambda: largest, of_finite).astype(np.float64)


def _grid(largest: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
    """``(2^(bits - e), 2^(e - bits))`` for ``2^e`` the power of two just above ``largest`` (>= 0): values up
    to ``largest`` times the first are at most ``2^bits``; rounded, they are integers times the second."""
    exponent = (jax.lax.bitcast_convert_type(largest, jnp.int64) >> 52) - 1022  # largest < 2^exponent
    exponent = jnp.where(largest > 0, exponent, 0)  # float32 values: largest is 0 or normal in float64

    def power_of_two(e):
        return jax.lax.bitcast_convert_type((e + 1023) << 52, jnp.float64)

    return power_of_two(bits - exponent), power_of_two(exponent - bits)


def _products_summed_a_loop_later(left: jax.Array, right: jax.Array, outputs: int) -> jax.Array:
    """``sum_k left[k] * right[k]`` in index order in their dtype, each chunk's products added in the
    next loop iteration."""
    k = left.shape[0]
    # Chunks of contraction indices; at least 3, so the loop below runs at least twice
    # (XLA inlines a loop of one iteration, and the products would meet the adds again).
    chunk = max(1, min(CHUNK, -(-k // 3), CHUNK_ELEMENTS // max(outputs, 1)))
    chunks = max(3, -(-k // chunk))

    def split(x):
        x = jnp.pad(x, ((0, chunks * chunk - k),) + ((0, 0),) * (x.ndim - 1))  # zero products add nothing
        return x.reshape(chunks, chunk, *x.shape[1:])

    left, right = split(left), split(right)

    def add_in_order(acc, products):
        for i in range(chunk):
            acc = acc + products[i]
        return acc

    def fold(carry, pair):
        acc, products = carry
        return (add_in_order(acc, products), pair[0] * pair[1]), None

    first = left[0] * right[0]
    zero = jax.lax.full_like(first[0], -0.0)  # -0.0 + p is p, signed zeros too; varies as first does
    acc, products = jax.lax.scan(fold, (zero, first), (left[1:], right[1:]))[0]
    return add_in_order(acc, products)


# Primitives whose every output element is one fixed expression of its inputs, or exact in any
# order (max, min, selections, sorts, moves): XLA computes them alike on every split. Matched by
# name (tests/test_fixed_order.py pins the names and params the rules below read).
_ORDER_FREE_NAMES = """
    abs acos acosh add add_any and argmax argmin asin asinh atan atan2 atanh bitcast_convert_type broadcast_in_dim
    cbrt ceil clamp clz complex concatenate conj convert_element_type copy cos cosh cummax cummin
    digamma div dynamic_slice dynamic_update_slice eq eq_to erf erf_inv erfc exp exp2 expm1 floor gather ge gt
    igamma igammac imag integer_pow iota is_finite le le_to lgamma log log1p logistic lt lt_to max min mul ne
    neg nextafter not optimization_barrier or pad platform_index population_count pow pvary real reduce_and
    reduce_max reduce_min reduce_or reduce_precision reduce_xor rem reshape rev round rsqrt scatter
    scatter-max scatter-min select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinh
    slice sort split sqrt square squeeze stack stop_gradient sub tan tanh top_k transpose xor
    axis_index bessel_i0e bessel_i1e broadcast_to device_put layout_constraint mulhi polygamma reshard
    sharding_constraint tile unstack zeta zeros_like
"""
ORDER_FREE = frozenset(_ORDER_FREE_NAMES.split())
# Scatters that combine duplicates by a float sum or product: order-free with unique indices; a float
# scatter-add of others is rewritten (its updates added one after another, in their order).
SCATTER_ARITHMETIC = ("scatter-add", "scatter-sub", "scatter-mul")
# Cumulative float folds, rewritten as lax.associative_scan's fixed tree of the same operation.
CUMULATIVE = {"cumsum": jax.lax.add, "cumprod": jax.lax.mul, "cumlogsumexp": jnp.logaddexp}
# Calls and control flow whose bodies it evaluates in turn (the params that hold them: _bodies).
FOLLOWED = ("jit", "closed_call", "remat2", "custom_jvp_call", "custom_vjp_call", "scan", "while", "cond")


def _floats(eqn) -> bool:
    avals = [v.aval for v in (*eqn.invars, *eqn.outvars) if hasattr(v.aval, "dtype")]
    return any(jnp.issubdtype(a.dtype, jnp.inexact) for a in avals)


def _bodies(eqn) -> list[ClosedJaxpr]:
    """The jaxprs an equation holds in its params (a closed one, or an open one closed over nothing)."""
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, ClosedJaxpr):
                found.append(item)
            elif hasattr(item, "eqns") and hasattr(item, "outvars"):
                found.append(ClosedJaxpr(item, ()))
    return found


def _refusal(eqn) -> str | None:
    """Why fixed_order cannot pin ``eqn``'s float sums (the primitive's name), or None if it can."""
    name, params = eqn.primitive.name, eqn.params
    if name in FOLLOWED or name in ("dot_general", "reduce_sum", "reduce") or name in ORDER_FREE:
        return None
    if name == "qr":
        return "qr with pivoting" if params.get("pivoting") else None
    if name in SCATTER_ARITHMETIC and (params.get("unique_indices") or not _floats(eqn)):
        return None
    if name == "scatter-add" and not params["dimension_numbers"].operand_batching_dims:
        return None
    if name in CUMULATIVE:
        return None
    if not _floats(eqn) and not _bodies(eqn):
        return None  # integers only: exact in any order
    return name


def unpinned(closed: ClosedJaxpr) -> list[str]:
    """The primitives of ``closed`` (inside its calls and control flow too) whose summation order
    :func:`fixed_order` cannot pin, by name, each once: empty when ``fixed_order`` promises it all."""
    found: dict[str, None] = {}
    used = _used(closed.jaxpr)
    for eqn in closed.jaxpr.eqns:
        why = _refusal(eqn)
        if eqn.primitive.name == "qr" and eqn.outvars[0] in used:
            why = "qr's Q"  # it computes R alone
        if why is not None:
            found[why] = None
        elif eqn.primitive.name not in ORDER_FREE:
            for body in _bodies(eqn):
                found.update(dict.fromkeys(unpinned(body)))
    return list(found)


def refusal(who: str, names: list[str]) -> str:
    """The one line that says ``who`` cannot be bitwise under ``logical_shards`` (``names``: :func:`unpinned`'s)."""
    return (f"{who} is not bitwise under logical_shards: it uses {', '.join(map(repr, names))}, whose float "
            "summation order sharded_scan cannot fix on CPU; leave logical_shards out (results then agree to "
            "rounding across splits), or compute it with matrix products, sums and elementwise operations.")


def _used(jaxpr) -> set:
    """The variables ``jaxpr``'s equations or outputs read."""
    reads = [*(v for eqn in jaxpr.eqns for v in eqn.invars), *jaxpr.outvars]
    return {v for v in reads if not isinstance(v, Literal)}


def _is_float(eqn) -> bool:
    return jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.inexact)


def _evaluate(closed: ClosedJaxpr, args: list) -> list:
    """Evaluates ``closed`` on ``args`` (traced or concrete), float sums in fixed order."""
    jaxpr = closed.jaxpr
    env: dict[Any, Any] = {}

    def read(var):
        return var.val if isinstance(var, Literal) else env[var]

    env.update(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    transposed = {}  # a matrix's transpose's variable: the matrix's (xᵀ x, a Gram: ordered_gram)
    for eqn in jaxpr.eqns:
        gram = _gram_of(eqn, transposed)
        outs = [ordered_gram(env[gram])] if gram is not None else _apply(eqn, [read(v) for v in eqn.invars])
        if eqn.primitive.name == "transpose" and eqn.params["permutation"] == (1, 0):
            transposed[eqn.outvars[0]] = eqn.invars[0]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _gram_of(eqn, transposed: dict):
    """The variable ``x`` when ``eqn`` is the float32 (or narrower) ``xᵀ x`` of a matrix ``x``, else None."""
    if eqn.primitive.name != "dot_general" or eqn.params["dimension_numbers"] != (((1,), (0,)), ((), ())):
        return None
    left, right = eqn.invars
    dtype = np.dtype(eqn.params.get("preferred_element_type") or eqn.outvars[0].aval.dtype)
    if isinstance(left, Literal) or transposed.get(left) is not right or dtype not in EXACT_IN_FLOAT64:
        return None
    return right if right.aval.dtype == eqn.outvars[0].aval.dtype else None


def _as_fn(closed: ClosedJaxpr) -> Callable:
    return lambda *args: _evaluate(closed, list(args))


def _apply(eqn, invals: list) -> list:
    """One equation (one :func:`unpinned` passes): float sums in fixed order; control flow and calls followed."""
    prim, params = eqn.primitive, eqn.params
    name = prim.name
    if name == "dot_general" and _is_float(eqn):
        return [ordered_dot_general(*invals, **params)]
    if name == "reduce_sum" and _is_float(eqn):
        return [ordered_sum(invals[0], params["axes"])]
    if name == "reduce" and (_floats(eqn) or any(map(_floats, params["jaxpr"].jaxpr.eqns))):
        return _reduce(params, invals)
    if name == "qr":
        return [None, ordered_qr_r(invals[0], params["full_matrices"])]
    if name == "scatter-add" and _floats(eqn) and not params["unique_indices"]:
        return [_scatter_add_in_order(params, *invals)]
    if name in CUMULATIVE and _floats(eqn):
        return [jax.lax.associative_scan(CUMULATIVE[name], invals[0], params["reverse"], params["axis"])]
    if name == "div" and _is_float(eqn):
        return [divided(*invals)]
    if name == "jit" and params["name"] in TOGETHER:
        out = TOGETHER[params["name"]](*invals)
        if out is not None:
            return [_varying_like(o, *invals) for o in out]
    if name in ("jit", "closed_call", "remat2", "custom_jvp_call", "custom_vjp_call"):
        # Evaluated for their value: the derivative rules were applied when ``fn`` was traced.
        return _evaluate(_bodies(eqn)[0], invals)
    if name == "scan":
        return _scan(params, invals)
    if name == "while":
        return _while(params, invals)
    if name == "cond":
        index, *operands = invals
        return list(jax.lax.switch(index, [_as_fn(b) for b in params["branches"]], *operands))
    if name != "pvary":  # inside shard_map, operands vary alike (a jaxpr traced outside it, a reducer's, mixes them)
        invals = [_varying_like(x, *invals) for x in invals]
    with eqn.ctx.manager:
        out = prim.bind(*invals, **prim.get_bind_params(params))
    return list(out) if prim.multiple_results else [out]


def divided(numerator, divisor) -> jax.Array:
    """``numerator / divisor`` (broadcast against each other) as IEEE's quotient in every program: both operands,
    at the quotient's shape, behind one optimization barrier, which XLA's simplifier does not look through (the
    barrier leaves the program before code generation: the division fuses as before). Seen, a division by a
    broadcast value became a product with its reciprocal (``x / s`` as ``x * (1 / s)``, a second rounding) in some
    programs and not others, by the program around it (``dense.cholesky_upper``'s rows over their pivot: the
    whitened solver's basis differed between a step compiled for one device and one for two); and ``x / sqrt(y)``,
    a quotient of quotients and a division by a constant come out of a plain ``jit`` other than IEEE's quotient.
    :func:`fixed_order` divides so (a float ``div``), and so does its own code."""
    dtype = jnp.result_type(numerator, divisor)
    numerator, divisor = jnp.broadcast_arrays(jnp.asarray(numerator, dtype), jnp.asarray(divisor, dtype))
    numerator, divisor = (_varying_like(v, numerator, divisor) for v in (numerator, divisor))
    return jax.lax.div(*jax.lax.optimization_barrier((numerator, divisor)))


def ordered_sum(x: jax.Array, axes) -> jax.Array:
    """``x`` summed over ``axes`` with every rounding fixed by the code (:func:`tree_sum64`)."""
    axes = tuple(axes)
    keep = [d for d in range(x.ndim) if d not in axes]
    k = math.prod(x.shape[a] for a in axes)
    out_shape = [x.shape[d] for d in keep]
    dtype = x.dtype
    if not jnp.issubdtype(dtype, jnp.floating) or np.dtype(dtype) not in EXACT_IN_FLOAT64:
        ones = jnp.ones([x.shape[a] for a in axes], dtype)
        return ordered_dot_general(x, ones, ((axes, tuple(range(len(axes)))), ((), ())))
    if k == 0:
        return jnp.zeros(out_shape, dtype)
    with jax.enable_x64(True):  # the summed axes first: no transpose for a column sum, reduced along rows
        columns = jnp.transpose(x, (*axes, *keep)).reshape(k, math.prod(out_shape))
        return tree_sum64(columns).astype(dtype).reshape(out_shape)


def _reduce(params: dict, invals: list) -> list:
    """A ``lax.reduce`` with a float reducer: its operands folded one reduced index after another,
    in index order, from the initial values (each output element its own fold)."""
    n = len(invals) // 2
    operands, inits = invals[:n], invals[n:]
    dims = tuple(params["dimensions"])
    keep = [d for d in range(operands[0].ndim) if d not in dims]
    k = math.prod(operands[0].shape[d] for d in dims)
    rest = [operands[0].shape[d] for d in keep]
    size = math.prod(rest)
    # all varying alike (a scan's carry keeps its type)
    rows = [_varying_like(jnp.transpose(x, (*dims, *keep)).reshape(k, size), *invals) for x in operands]
    init = tuple(_varying_like(jnp.broadcast_to(i, (size,)), *invals) for i in inits)
    reducer = jax.vmap(lambda *a: tuple(_evaluate(params["jaxpr"], list(a))))
    out = jax.lax.scan(lambda acc, row: (reducer(*acc, *row), None), init, tuple(rows))[0]
    return [o.reshape(rest) for o in out]


def _varying_like(x: jax.Array, *others: jax.Array) -> jax.Array:
    """``x``, inside ``shard_map``, varying over every manual axis any of ``others`` varies over (as the
    original equation's operands were where it mixed them; a primitive bound directly does not cast)."""
    axes = set().union(*map(varying_axes, others)) - varying_axes(x)
    return jax.lax.pcast(x, tuple(sorted(axes)), to="varying") if axes else x


def varying_axes(x) -> frozenset:
    """The manual axes ``x`` varies over inside ``shard_map`` (its aval's ``manual_axis_type``, ``vma`` before
    JAX 0.10; tests/test_fixed_order.py pins it)."""
    aval = jax.typeof(x)
    kind = getattr(aval, "manual_axis_type", None)
    return frozenset(kind.varying if kind is not None else getattr(aval, "vma", ()))


def _scatter_add_in_order(params: dict, operand: jax.Array, indices: jax.Array, updates: jax.Array) -> jax.Array:
    """A float ``scatter-add``: its updates added one after another in their (row-major) order, each a
    scatter of one index (unique), so duplicates sum in that order whatever XLA's scatter does."""
    dims = params["dimension_numbers"]
    window = list(dims.update_window_dims)
    scattered = [d for d in range(updates.ndim) if d not in window]
    count = math.prod(updates.shape[d] for d in scattered)
    one = dims._replace(update_window_dims=tuple(range(1, len(window) + 1)))
    indices = indices.reshape(count, 1, indices.shape[-1])
    updates = jnp.transpose(updates, (*scattered, *window)).reshape(count, 1, *(updates.shape[d] for d in window))

    def add_one(acc, update):
        index, value = update
        return jax.lax.scatter_add(acc, index, value, one, indices_are_sorted=True, unique_indices=True,
                                   mode=params["mode"]), None

    return jax.lax.scan(add_one, _varying_like(operand, indices, updates), (indices, updates), unroll=8)[0]


def tree_sum64(columns: jax.Array) -> jax.Array:
    """The sums of ``columns`` ``(k, m)`` over their first axis (float32 or narrower values, in float64 or their own
    dtype: converted as the tree's first adds read them, not in a pass of their own): :func:`_tree_sum`'s fixed
    pairwise tree of float64 adds, the program's own, which XLA keeps (no product reaches them: a float32 product
    is converted first, so nothing is contracted into an FMA). Each of the
    ``ceil(log2 k)`` levels rounds by at most 2^-53 of what it adds, so the error is at most
    ``ceil(log2 k) 2^-53 sum|x|``: below exact blocks rounded to 45 bits under their largest (the
    formulation before, ``256 * 2^-46 max|x|`` a block) and below float32's half ulp unless the terms cancel to
    2^-20 of ``sum|x|``. Non-finite values as IEEE's sum (any order gives it); an exact zero is +0. One pass,
    where the blocks rounded to a grid cost a pass for the largest, one to round, and the sum: a Covariance
    ``add`` at d=96 0.277 -> 0.20 CPU-ms a 256-row micro-batch."""
    acc = _tree_sum(columns, np.float64)
    return jnp.where(acc == 0, 0.0, acc)


def _tree_sum(terms: jax.Array, dtype=None) -> jax.Array:
    """``terms`` summed over their leading axis in a fixed pairwise tree (halves added, an odd one
    carried): the adds are the program's own, whose order XLA keeps. ``dtype``: the adds' (``terms``' if None),
    each half converted to it as it is first read (exact, widening), where a converted copy of the whole cost a
    pass of its own."""
    dtype = terms.dtype if dtype is None else dtype
    if terms.shape[0] == 0:
        return jnp.zeros(terms.shape[1:], dtype)
    while (count := terms.shape[0]) > 1:
        half = count // 2
        pairs = terms[:half].astype(dtype) + terms[half : 2 * half].astype(dtype)
        terms = jnp.concatenate([pairs, terms[2 * half :].astype(dtype)]) if count % 2 else pairs
    return terms[0].astype(dtype)


def _tree_levels(count: int, rows: Callable, levels: int) -> tuple[int, Callable]:
    """The first ``levels`` levels of :func:`_tree_sum`'s tree over ``count`` terms, as an expression: ``rows(i, j)``
    gives terms ``i`` to ``j`` (an array, leading axis), and so does the callable returned, of the level ``levels``
    down (its ``count`` returned beside it). Each of its rows is the same adds of the same terms, in the same order,
    as :func:`_tree_sum`'s at that level, read from slices of the terms: one expression XLA computes in one pass,
    where each level of its own was a pass that wrote its sums and the next read them."""
    for _ in range(levels):
        if count <= 1:
            break
        half = count // 2

        def pairs(i, j, rows=rows, half=half):
            parts = [rows(i, min(j, half)) + rows(i + half, min(j, half) + half)] if i < half else []
            if j > half:  # the odd term, carried: the last one
                parts.append(rows(2 * half, 2 * half + 1))
            return parts[0] if len(parts) == 1 else jnp.concatenate(parts)

        rows, count = pairs, half + count % 2
    return count, rows


# ordered_qr_r: columns a panel of Householder reflections holds (factored one column after another), whose
# product then updates the columns to its right in three matrix products (LAPACK's geqrf, compact WY). One column
# at a time over the whole matrix cost about 290 CPU-ms for a (514, 258) float32 R, a young LinearRegression shard's
# micro-batch at d=256 (each of its 258 reflections passes over every column); panels of 8, 20-30 ms. The panels
# are one loop, not one program each (unrolled, 17 panels of 16 compiled in 18.6 CPU-s, the loop in 1.4).
QR_PANEL = 8


def ordered_qr_r(a: jax.Array, full_matrices: bool = False, panel: int = QR_PANEL) -> jax.Array:
    """The R of ``a``'s QR decomposition by Householder reflections (LAPACK's ``geqrf`` and its signs:
    ``R[j, j] = -sign(alpha) ‖x‖``), every rounding fixed by the code: the R XLA:CPU's LAPACK call computes to
    rounding, the same on every split and machine. Blocked as LAPACK's: ``panel`` columns at a time factored by
    :func:`_householder_panel` (sums in :func:`_tree_sum`'s order), their reflections ``I - V T Vᵀ`` applied to the
    columns to their right by :func:`ordered_dot_general`'s products. Batched over leading axes."""
    if a.ndim > 2:
        return jax.vmap(lambda x: ordered_qr_r(x, full_matrices, panel))(a)
    m, n = a.shape
    k = min(m, n)
    width = min(panel, k) if k else 1
    panels = -(-k // width)
    padded = jnp.pad(a, ((0, 0), (0, panels * width - n))) if panels * width > n else a  # zero columns: no act
    cols = jnp.arange(padded.shape[1])[None, :]

    def one(i, a):
        p = i * width
        factored, v, tau = _householder_panel(jax.lax.dynamic_slice_in_dim(a, p, width, axis=1), p)
        a = jax.lax.dynamic_update_slice_in_dim(a, factored, p, axis=1)
        # Hw..H1 C = (I - V Tᵀ Vᵀ) C for the columns right of the panel (V is 0 above row p, so rows above
        # stay; the columns left of it are 0 from row p down, so VᵀC is 0 there)
        update = _ordered_matmul(v, _small_matmul(_wy_factor(v, tau).T, _ordered_matmul(v.T, a)))
        return jnp.where(cols >= p + width, a - update, a)

    r = jnp.triu(jax.lax.fori_loop(0, panels, one, padded)[:, :n])
    return r if full_matrices else r[:k]


def _ordered_matmul(left: jax.Array, right: jax.Array) -> jax.Array:
    return ordered_dot_general(left, right, (((1,), (0,)), ((), ())))


def _small_matmul(left: jax.Array, right: jax.Array) -> jax.Array:
    """``left @ right`` as elementwise products summed in :func:`_tree_sum`'s order (few products: less to
    compile than :func:`exact_block_dot`'s)."""
    return _tree_sum(left.T[:, :, None] * right[:, None, :])


def _householder_panel(a: jax.Array, offset) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``a`` (m, w), the columns from ``offset`` on of a matrix whose rows above ``offset`` are done, reduced by
    its Householder reflections one column after another (LAPACK's ``geqr2``), each sum in :func:`_tree_sum`'s
    order: ``(a reduced, V, tau)``, ``H_j = I - tau_j v_j v_jᵀ``, ``v_j`` ``V``'s column ``j`` (1 at row
    ``offset + j``, 0 above)."""
    m, n = a.shape
    rows, cols = jnp.arange(m)[:, None], jnp.arange(n)[None, :]

    def reflect(j, carry):
        a, vs, taus = carry
        row = offset + j
        column = jax.lax.dynamic_index_in_dim(a, j, axis=1, keepdims=False)
        alpha = jax.lax.dynamic_index_in_dim(column, row, keepdims=False)
        x = jnp.where(rows[:, 0] > row, column, 0)
        scale = jnp.max(jnp.abs(x))
        scaled = divided(x, jnp.where(scale > 0, scale, 1))
        norm = scale * jnp.sqrt(_tree_sum(scaled * scaled))  # no overflow for large entries, as LAPACK's snrm2
        acts = (norm != 0) & (row < m)  # NaN too: it propagates as LAPACK's does
        beta = jnp.where(acts, -jnp.copysign(jnp.hypot(alpha, norm), alpha), alpha)
        tau = jnp.where(acts, divided(beta - alpha, jnp.where(acts, beta, 1)), 0)
        below_row = divided(x, jnp.where(acts, alpha - beta, 1))
        v = jnp.where(rows[:, 0] == row, 1, jnp.where(acts & (rows[:, 0] > row), below_row, 0)).astype(a.dtype)
        below = jnp.where(rows >= row, a, 0)
        w = _tree_sum(v[:, None] * below)
        updated = a - tau * (v[:, None] * w[None, :])
        a = jnp.where(acts & (rows >= row) & (cols > j), updated, a)
        new_column = jnp.where(rows[:, 0] == row, beta, jnp.where(rows[:, 0] > row, 0, column))
        a = jax.lax.dynamic_update_index_in_dim(a, new_column[:, None], j, axis=1)
        vs = jax.lax.dynamic_update_index_in_dim(vs, v[:, None], j, axis=1)
        return a, vs, jax.lax.dynamic_update_index_in_dim(taus, tau.astype(a.dtype), j, axis=0)

    zeros = jnp.zeros_like(a)  # varies as a does inside shard_map
    return jax.lax.fori_loop(0, min(m, n), reflect, (a, zeros, zeros[0]))


def _wy_factor(v: jax.Array, tau: jax.Array) -> jax.Array:
    """The upper triangular ``T`` with ``H_1 H_2 .. H_w = I - V T Vᵀ`` (LAPACK's ``larft``, forward, columnwise):
    ``T[:j, j] = -tau_j T[:j, :j] (V[:, :j]ᵀ v_j)``, ``T[j, j] = tau_j``; ``VᵀV`` by one ordered product."""
    w = tau.shape[0]
    s = _small_matmul(v.T, v)
    index = jnp.arange(w)

    def column(j, t):
        sj = jnp.where(index < j, jax.lax.dynamic_index_in_dim(s, j, axis=1, keepdims=False), 0)
        tj = jax.lax.dynamic_index_in_dim(tau, j, keepdims=False)
        new = jnp.where(index == j, tj, jnp.where(index < j, -tj * _tree_sum((t * sj[None, :]).T), 0))
        return jax.lax.dynamic_update_index_in_dim(t, new[:, None], j, axis=1)

    return jax.lax.fori_loop(0, w, column, jnp.zeros_like(s))


def _scan(params: dict, invals: list) -> list:
    num_consts, num_carry = params["num_consts"], params["num_carry"]
    consts, rest = invals[:num_consts], invals[num_consts:]
    carry, xs = rest[:num_carry], rest[num_carry:]
    body = _as_fn(params["jaxpr"])

    def step(carry, x):
        out = body(*consts, *carry, *x)
        return out[:num_carry], out[num_carry:]

    carry, ys = jax.lax.scan(
        step, carry, xs, length=params["length"], reverse=params["reverse"], unroll=params["unroll"]
    )
    return [*carry, *ys]


def _while(params: dict, invals: list) -> list:
    cond_n, body_n = params["cond_nconsts"], params["body_nconsts"]
    cond_consts, body_consts, init = invals[:cond_n], invals[cond_n : cond_n + body_n], invals[cond_n + body_n :]
    cond, body = _as_fn(params["cond_jaxpr"]), _as_fn(params["body_jaxpr"])

    def pred(state):
        return cond(*cond_consts, *state)[0]

    if not params["cond_jaxpr"].out_avals[0].shape:
        return list(jax.lax.while_loop(pred, lambda s: tuple(body(*body_consts, *s)), tuple(init)))

    # A batched predicate (vmap's while, e.g. GroupBy's per-key sketch folds): as XLA lowers it, the loop
    # runs while any element's holds and advances only those elements (the predicate leads every carry's shape).
    def step(state):
        keep = pred(state)
        new = body(*body_consts, *state)
        lead = lambda x: keep.reshape(keep.shape + (1,) * (x.ndim - keep.ndim))  # noqa: E731
        return tuple(jnp.where(lead(x), n, x) for n, x in zip(new, state, strict=True))

    return list(jax.lax.while_loop(lambda s: jnp.any(pred(s)), step, tuple(init)))
