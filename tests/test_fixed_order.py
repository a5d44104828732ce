"""Matrix products with every rounding fixed by the code: each output element is a function of its
row and column alone (float32: products of values rounded to a grid per block of contraction indices,
summed exactly, blocks added in order), whatever the shapes (a column block of a ``model`` axis, a
matrix-vector product, batch dimensions), so no library kernel or fusion choice can change it."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sharded_scan.combiners.statistics.moments import column_sums_and_gram
from sharded_scan.errors import UsageError
from sharded_scan.fixed_order import (
    BITS,
    FOLLOWED,
    ORDER_FREE,
    SUM_BITS,
    block_width,
    fixed_order,
    ordered_column_sums_and_gram,
    ordered_dot_general,
    ordered_qr_r,
    unpinned,
    varying_axes,
)


def pinned(left, right, bits=(BITS, BITS)):
    """sum_k left[k] * right[k] (float32 operands, broadcast over the rest) as fixed_order computes it, in
    numpy: per block (the fewest of at most BLOCK indices, of one width: block_width) each operand rounded (half to
    even) to ``bits`` bits below the power of two just above its largest magnitude there, the block's products
    summed exactly (Python integers), the blocks added in order in float64, rounded once to float32."""
    left, right = np.broadcast_arrays(left.astype(np.float64), right.astype(np.float64))
    acc = np.zeros(left.shape[1:])
    width = block_width(left.shape[0])[1]
    for start in range(0, left.shape[0], width):
        a, b = left[start:start + width], right[start:start + width]
        ea, eb = (np.frexp(np.abs(v).max(axis=0))[1] for v in (a, b))  # largest < 2^e
        qa, qb = (np.rint(np.ldexp(v, bit - e)).astype(np.int64).astype(object) for v, e, bit in
                  ((a, ea, bits[0]), (b, eb, bits[1])))
        exact = (qa * qb).sum(axis=0)  # Python integers: exact
        acc = acc + np.ldexp(exact.astype(np.float64), ea + eb - bits[0] - bits[1])
    return (acc + 0.0).astype(np.float32)


def in_order_float64(left, right):
    """sum_k left[k] * right[k] in float64, one rounding for each product and each add."""
    acc = np.float64(-0.0) + left[0] * right[0]
    for a, b in zip(left[1:], right[1:], strict=True):
        acc = acc + a * b
    return acc


def rows(n, d, seed=0):
    return (3 + np.random.default_rng(seed).normal(size=(n, d))).astype(np.float32)


def multiplies_into_adds(hlo: str) -> list[str]:
    """The adds of an optimized HLO module that take a multiply's result inside one computation
    (through moves only): where XLA:CPU's code generator may contract them into one FMA."""
    moves = ("bitcast", "slice", "reshape", "broadcast", "copy", "dynamic-slice", "transpose")
    found = []
    for body in hlo.split("\n}\n"):
        ops = {}
        for line in body.splitlines():
            name, _, rest = line.strip().removeprefix("ROOT ").partition(" = ")
            head, _, args = rest.partition("(")
            if args and head.split():
                ops[name] = (head.split()[-1], re.findall(r"%[\w.-]+", args))

        def reaches_multiply(name, ops=ops):
            opcode, args = ops.get(name, ("parameter", []))
            return opcode == "multiply" or (opcode in moves and any(reaches_multiply(a) for a in args))

        found += [n for n, (op, args) in ops.items() if op == "add" and any(map(reaches_multiply, args))]
    return found


@pytest.mark.parametrize("k", [1, 5, 256, 600])
def test_a_gram_block_is_the_same_function_of_its_columns_as_the_whole(k):
    x = rows(k, 30)
    x[::7, 3] *= 2.0**-30  # values far below their block's largest: rounded to its grid
    dims = (((0,), (0,)), ((), ()))
    whole = np.asarray(jax.jit(lambda x: ordered_dot_general(x, x, dims))(x))
    block = np.asarray(jax.jit(lambda x: ordered_dot_general(x, x[:, 8:16], dims))(x))
    want = pinned(x[:, :, None], x[:, None, :])
    np.testing.assert_array_equal(whole, want)
    np.testing.assert_array_equal(block, want[:, 8:16])
    np.testing.assert_array_equal(whole, whole.T)  # both operands on the same grid: symmetric
    exact = x.astype(np.float64).T @ x.astype(np.float64)  # within the bound exact_block_dot's docstring says
    bound = 2.0 ** -BITS * 2 * np.abs(x).max(0)[:, None] * np.abs(x).sum(0)[None, :] * 2 + np.abs(exact) * 2.0**-24
    assert (np.abs(whole - exact) <= bound + bound.T).all()
    if k == 600:  # xᵀx in a program: each column rounded once, the blocks on and above the diagonal: the same bits
        y = rows(k, 70, seed=1)
        y[::5, 60] *= 2.0**-30
        # a sum of a half ulp of 1 and values below its column's grid for sums (SUM_BITS): it rounds to 1 (a
        # tie, to even), where the tree's sum of them all rounds up
        y[:, 50], y[:3, 50], y[3:block_width(k)[1], 50] = 0, (1, 2.0**-24, 2.0**-50), 2.0**-50  # the first block
        y[7, 2], y[9, 65] = np.inf, np.nan
        gram = np.asarray(jax.jit(fixed_order(lambda y: y.T @ y))(y))
        np.testing.assert_array_equal(gram, np.asarray(jax.jit(lambda y: ordered_dot_general(y, y, dims))(y)))
        # in column groups (as wide Grams are cut): the same exact sums
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda y: ordered_column_sums_and_gram(y, parts=3)[1])(y)),
                                      gram)
        # Covariance's column sums beside its Gram: each column's values rounded below its largest (the pass the
        # Gram's grid takes), SUM_BITS bits, summed exactly
        sums, same = jax.jit(fixed_order(column_sums_and_gram))(y)
        np.testing.assert_array_equal(same, gram)
        finite = np.isfinite(y).all(0)
        grid = pinned(np.ones((k, 1), np.float32), np.where(np.isfinite(y), y, 0), bits=(BITS, SUM_BITS))
        np.testing.assert_array_equal(sums[finite], grid[finite])
        assert sums[2] == np.inf and np.isnan(sums[65]) and sums[50] == 1 and tree_sum(y)[50] > 1
        sums = np.asarray(jax.jit(fixed_order(lambda y: y.sum(0)))(y))  # the float64 tree, column by column
        np.testing.assert_array_equal(sums, tree_sum(y))
        np.testing.assert_array_equal(np.asarray(jax.jit(fixed_order(lambda y: y.sum(0)))(y[:, 3:5])), sums[3:5])
    if k == 256:
        # float64: no product reaches an add in one computation, where XLA:CPU could contract them (as an
        # unrolled loop would let it)
        with jax.enable_x64(True):
            wide = x.astype(np.float64)
            program = jax.jit(lambda x: ordered_dot_general(x, x, dims))
            assert multiplies_into_adds(program.lower(wide).compile().as_text()) == []
            np.testing.assert_array_equal(program(wide), in_order_float64(wide[:, :, None], wide[:, None, :]))

            def chain(x):
                acc = -0.0
                for row in x:
                    acc = acc + row[:, None] * row[None, :]
                return acc

            assert multiplies_into_adds(jax.jit(chain).lower(wide).compile().as_text())  # the check sees them


def test_batched_and_matrix_vector_products_keep_the_order():
    a, b = rows(3 * 7 * 5, 1).reshape(3, 7, 5), rows(3 * 5 * 4, 1, seed=1).reshape(3, 5, 4)
    got = jax.jit(lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b))
    want = np.stack([pinned(a[i].T[:, :, None], b[i][:, None, :]) for i in range(3)])
    np.testing.assert_array_equal(np.asarray(jax.jit(fixed_order(got))(a, b)), want)
    # a matrix-vector product, a vector's product with a matrix and a dot of vectors: the terms exact in float64,
    # added in the tree of a float32 sum (no grid: they keep every bit)
    v, tiny = rows(5, 1, seed=2)[:, 0], a[0] * np.float32(2.0**-30) ** (np.arange(5) % 2)
    terms = tiny.T.astype(np.float64) * v[:, None]
    np.testing.assert_array_equal(np.asarray(jax.jit(fixed_order(jnp.dot))(tiny, v)), tree_sum(terms))
    np.testing.assert_array_equal(np.asarray(jax.jit(fixed_order(jnp.dot))(v, tiny.T)), tree_sum(terms))
    np.testing.assert_array_equal(np.asarray(jax.jit(fixed_order(jnp.dot))(v, tiny[0])), tree_sum(terms[:, :1])[0])
    # longer contractions: the tree's first levels come from slices of the operands in one pass, odd terms carried
    for k in (100, 257):
        m, w = rows(k, 6, seed=3), rows(k, 1, seed=4)[:, 0] * np.float32(2.0**-20) ** (np.arange(k) % 3)
        want = tree_sum(m.astype(np.float64) * w[:, None].astype(np.float64))
        np.testing.assert_array_equal(np.asarray(jax.jit(fixed_order(jnp.dot))(w, m)), want)


def test_data_rows_times_a_whitening_basis_keep_the_bits_of_their_small_columns():
    # LinearRegression's and PCA's whitening under logical_shards: each row of data is rounded to BITS bits below
    # its largest value, so a column 2^14 smaller than another kept 8 bits, and PCA on drifting data was 300x
    # less accurate than the same job without logical_shards (2.9e-4 against 9.4e-7). The basis's rows moved by
    # powers of two first (whitened._times_basis) round each row below its largest contribution instead.
    from sharded_scan.combiners.linalg.whitened import _times_basis

    r = np.random.default_rng(3)
    scales = np.array([1.0, 2.0**14, 3.0, 2.0**-10, 7e3])
    data = (r.normal(size=(40, 5)) * scales).astype(np.float32)
    basis = (np.diag(1 / scales) + np.triu(r.normal(size=(5, 5)), 1) * 1e-3 / scales[:, None]).astype(np.float32)
    exact = data.astype(np.float64) @ basis.astype(np.float64)
    terms = np.abs(data.astype(np.float64)) @ np.abs(basis.astype(np.float64))
    plain = np.asarray(jax.jit(fixed_order(jnp.matmul))(data, basis), np.float64)
    assert np.max(np.abs(plain - exact) / terms) > 0.5  # the 2^-10 column: nothing of it left
    got = np.asarray(jax.jit(fixed_order(_times_basis))(data, basis), np.float64)
    assert (np.abs(got - exact) <= 2.0**-12 * terms).all(), np.max(np.abs(got - exact) / terms)  # 7.9e-5 here
    np.testing.assert_array_equal(got[:7], np.asarray(jax.jit(fixed_order(_times_basis))(data[:7], basis)))
    # the moves are powers of two exactly (XLA:CPU's exp2(floor(log2 x)) is not: the products would change)
    from sharded_scan.combiners.linalg.whitened import _power_at_or_below

    values = np.float32(2.0) ** np.arange(-126, 128).astype(np.float32) * np.float32(1.5)
    want = np.exp2(np.floor(np.log2(values.astype(np.float64)))).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(_power_at_or_below)(values)), want)
    basis[3] = np.float32(1e-39)  # a row whose largest is subnormal (flushed on CPU) moves by nothing: no 0 / 0
    assert np.isfinite(np.asarray(jax.jit(fixed_order(_times_basis))(data, basis))).all()


def test_products_inside_loops_branches_and_gradients_are_fixed_too():
    x, w = rows(64, 6), rows(6, 1, seed=3)[:, 0]

    def fn(x, w):
        def body(carry, row):
            return carry + jnp.outer(row, row), None

        gram = jax.lax.scan(body, jnp.zeros((6, 6)), x.reshape(8, 8, 6)[0])[0]
        grad = jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w)
        return jax.lax.cond(w[0] > 0, lambda g: g @ g, lambda g: g, gram), grad

    got, want = jax.jit(fixed_order(fn))(x, w), jax.jit(fn)(x, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-6)
    # what remains of matmuls: float64 ones (exact_block_dot's, of integers, exact in any order)
    products = [e for e in eqns(fixed_order(fn), x, w) if e.primitive.name == "dot_general"]
    assert products and {v.aval.dtype for e in products for v in e.invars} == {np.dtype(np.float64)}


def test_a_vmapped_while_of_data_dependent_length_runs_each_element_its_own_trips():
    # vmap turns a while whose predicate depends on the element into one whose predicate is a vector
    # (GroupBy's per-key sketch folds under logical_shards): each element stops on its own.
    def halvings(x, m):
        def body(state):
            value, trips = state
            return m @ value * 0.5, trips + 1

        return jax.lax.while_loop(lambda s: jnp.abs(s[0]).max() > 1.0, body, (x, 0))

    x = jnp.array([[1.5, 0.2], [40.0, -3.0], [0.5, 0.1], [1e3, 1.0]], jnp.float32)
    m = jnp.eye(2, dtype=jnp.float32)
    got, want = jax.jit(fixed_order(jax.vmap(halvings, (0, None))))(x, m), jax.vmap(halvings, (0, None))(x, m)
    assert np.asarray(got[1]).tolist() == np.asarray(want[1]).tolist() == [1, 6, 0, 10]
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), atol=4 * 2.0**-BITS)  # 0.1 on 1.5s grid


def test_integer_products_are_left_to_xla():
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    assert "dot_general" in str(jax.make_jaxpr(fixed_order(jnp.matmul))(a, a.T))
    np.testing.assert_array_equal(jax.jit(fixed_order(jnp.matmul))(a, a.T), a @ a.T)


def test_non_finite_products_and_sums_are_ieee():
    # inf * 0 is NaN, +inf and -inf add to NaN, a NaN anywhere in a row or column reaches its elements
    x = np.array([[1.0, np.inf, 0.0, -0.0], [2.0, 1.0, -np.inf, 1.0], [np.nan, 0.0, 1.0, -0.0]], np.float32)
    dims = (((0,), (0,)), ((), ()))
    program = jax.jit(lambda x: ordered_dot_general(x, x, dims))
    sums = jax.jit(fixed_order(lambda x: x.sum(0)))
    for rows_ in (x[:2], x, np.concatenate([x[:2], -x[:2]])):
        with np.errstate(invalid="ignore"):
            want = rows_.astype(np.float64).T @ rows_.astype(np.float64)
        got = np.asarray(program(rows_))
        np.testing.assert_array_equal(got, want)
        assert not np.signbit(got[want == 0]).any()  # an exact zero is +0
        with np.errstate(invalid="ignore"):
            np.testing.assert_array_equal(np.asarray(sums(rows_)), rows_.astype(np.float64).sum(0))


def test_a_division_is_ieees_quotient_in_every_program():
    # XLA's simplifier turns a division into a product with a reciprocal (a second rounding) where it sees a
    # broadcast, a constant, a sqrt or a quotient as the divisor, in some programs and not others: the whitened
    # solver's Cholesky divided its rows by their pivot as a quotient in the step compiled for one device and with
    # a reciprocal in the one for two, so LinearRegression's and PCA's bits differed between data:1 and data:2.
    # Under fixed_order every float division is IEEE's quotient (numpy's, here), wherever it sits.
    r = np.random.default_rng(5)
    x, y, z = (r.uniform(1, 10, size=(48, 6)).astype(np.float32) for _ in range(3))
    s = np.float32(7.3)
    cases = [
        (lambda x, y, z, s: x / s, x / s),  # a scalar broadcast
        (lambda x, y, z, s: x / x[:, :1], x / x[:, :1]),  # a column broadcast
        (lambda x, y, z, s: x / 3.0, x / np.float32(3.0)),  # a constant
        (lambda x, y, z, s: x / jnp.sqrt(y), x / np.sqrt(y)),
        (lambda x, y, z, s: (x / y) / z, (x / y) / z),
        (lambda x, y, z, s: jax.lax.fori_loop(0, 3, lambda i, v: v / s, x), x / s / s / s),
        (lambda x, y, z, s: jax.vmap(lambda row: row / row[0])(x), x / x[:, :1]),
    ]
    for i, (fn, want) in enumerate(cases):
        np.testing.assert_array_equal(np.asarray(jax.jit(fixed_order(fn))(x, y, z, s)), want, err_msg=str(i))
    # inside shard_map, a divisor the same on every device over a row that varies (fixed_order casts the operands)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    local = jax.shard_map(fixed_order(lambda x, s: x / s), mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))
    np.testing.assert_array_equal(np.asarray(jax.jit(local)(x, s)), x / s)


def eqns(fn, *args):
    """Every equation of ``fn``'s jaxpr, those inside its calls and control flow too."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            found.append(eqn)
            for value in eqn.params.values():
                for item in value if isinstance(value, (tuple, list)) else (value,):
                    if hasattr(item, "jaxpr") and hasattr(item, "consts"):
                        walk(item.jaxpr)
                    elif hasattr(item, "eqns"):
                        walk(item)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_the_jaxpr_facts_fixed_order_matches_are_this_jaxs():
    # fixed_order reads jaxprs by primitive name and params: a JAX that renames them fails here (and a
    # primitive it does not know is refused, never run unpinned: the built-ins' test below)
    from jax.extend.core import ClosedJaxpr

    x = rows(6, 4)

    @jax.custom_jvp
    def jvp(x):
        return x * 2

    jvp.defjvp(lambda p, t: (jvp(*p), t[0] * 2))

    @jax.custom_vjp
    def vjp(x):
        return x * 3

    vjp.defvjp(lambda x: (vjp(x), None), lambda _, g: (g * 3,))

    def fn(x):
        q_unused_r = jnp.linalg.qr(x, mode="r")
        folded = jax.lax.reduce((x, x), (0.0, 1.0), lambda a, b: (a[0] + b[0], a[1] * b[1]), (0,))
        scanned = jax.lax.scan(lambda c, r: (c + r, r), jnp.zeros(4), x)
        looped = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: c + 1, x[0])
        branched = jax.lax.cond(x[0, 0] > 0, lambda x: x.T @ x, lambda x: x.T @ x, x)
        return (q_unused_r, folded, scanned, looped, branched, x.sum(0), jvp(x), vjp(x),
                x.at[jnp.arange(2)].add(1.0, unique_indices=True))

    by_name = {}
    for eqn in eqns(fn, x):
        by_name.setdefault(eqn.primitive.name, eqn)
    assert {"qr", "reduce", "scan", "while", "cond", "dot_general", "reduce_sum", "jit", "custom_jvp_call",
            "custom_vjp_call", "scatter-add"} <= set(by_name)
    qr = by_name["qr"].params
    assert (qr["pivoting"], qr["full_matrices"], len(by_name["qr"].outvars)) == (False, False, 2)  # (q, r)
    assert by_name["dot_general"].params["dimension_numbers"] == (((1,), (0,)), ((), ()))  # x.T @ x
    assert "preferred_element_type" in by_name["dot_general"].params and by_name["reduce_sum"].params["axes"] == (0,)
    assert by_name["reduce"].params["dimensions"] == (0,) and isinstance(by_name["reduce"].params["jaxpr"], ClosedJaxpr)
    assert {"num_consts", "num_carry", "jaxpr", "length", "reverse", "unroll"} <= set(by_name["scan"].params)
    assert {"cond_nconsts", "body_nconsts", "cond_jaxpr", "body_jaxpr"} <= set(by_name["while"].params)
    assert by_name["cond"].params["branches"] and by_name["cond"].invars[0].aval.dtype == jnp.int32  # index first
    assert isinstance(by_name["jit"].params["jaxpr"], ClosedJaxpr)
    for name in ("custom_jvp_call", "custom_vjp_call"):  # the first jaxpr of their params is the function's
        first = next(v for v in by_name[name].params.values() if isinstance(v, ClosedJaxpr))
        assert first is by_name[name].params["call_jaxpr"], name
    assert by_name["scatter-add"].params["unique_indices"] is True
    assert set(FOLLOWED) >= {"jit", "scan", "while", "cond", "custom_jvp_call", "custom_vjp_call"}
    import gc

    from jax.extend.core import Primitive

    known = {o.name for o in gc.get_objects() if isinstance(o, Primitive)}
    assert ORDER_FREE | set(FOLLOWED) <= known, sorted(ORDER_FREE | set(FOLLOWED) - known)  # no name matches nothing
    assert unpinned(jax.make_jaxpr(fn)(x)) == []
    seen = []  # inside shard_map: where a value varies, read from its aval (fixed_order casts mixed operands)

    def local(x):
        seen.extend([varying_axes(x), varying_axes(jnp.float32(1))])
        return x

    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    split = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.NamedSharding(mesh, P("data")))
    jax.make_jaxpr(jax.shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(split)
    assert seen == [frozenset({"data"}), frozenset()]
    # exact_block_dot's grid: round half to even, and a float64's exponent from its bits
    halves = jnp.array([0.5, 1.5, 2.5, -0.5, -2.5, 3.0])
    assert np.asarray(jax.lax.round(halves, jax.lax.RoundingMethod.TO_NEAREST_EVEN)).tolist() == [0, 2, 2, 0, -2, 3]
    with jax.enable_x64(True):
        bits = jax.lax.bitcast_convert_type(jnp.array([1.0, 0.75, 2.0**-140]), jnp.int64) >> 52
        assert (np.asarray(bits) - 1022).tolist() == [1, 0, -139]  # largest < 2^exponent
    folds = lambda x: (fn(x)[1], x.sum(0))  # noqa: E731 - the rewritten reductions, each in a fixed order
    got = jax.jit(fixed_order(folds))(x)
    np.testing.assert_array_equal(got[0][0], tree_sum(x))
    np.testing.assert_array_equal(got[1], tree_sum(x))
    np.testing.assert_allclose(got[0][1], np.prod(x, axis=0), rtol=1e-6)


def tree_sum(x):
    """Sums over the first axis as fixed_order computes a float32 sum, in numpy: the values in float64 added in a
    pairwise tree (halves added, an odd one carried), rounded once to float32, an exact zero +0."""
    terms = x.astype(np.float64)
    while len(terms) > 1:
        half = len(terms) // 2
        terms = np.concatenate([terms[:half] + terms[half : 2 * half], terms[2 * half :]])
    return np.where(terms[0] == 0, 0.0, terms[0]).astype(np.float32)


def builtins():
    import sharded_scan as ss

    d = 6

    x, xy = jax.ShapeDtypeStruct((d,), jnp.float32), (jax.ShapeDtypeStruct((d,), jnp.float32),
                                                       jax.ShapeDtypeStruct((), jnp.float32))
    # those that run under logical_shards nowhere else in the suite (test_reproducible runs Sum, Gram, Covariance,
    # Moments, PCA, Histogram, Gradient, LinearRegression's whitened and tsqr solvers; test_describe, test_quantiles,
    # test_topk and test_wide_model run Describe, Quantiles, TopK and Weighted Histogram): a refusal fails them there
    return {
        "Correlation": (ss.Correlation(), x), "DistinctCount": (ss.DistinctCount(), x),
        "LinearRegression comoments": (ss.LinearRegression(solver="comoments"), xy),
        # float scatter-adds of repeated indices (keys) and a cumulative sum of weights
        "Weighted Quantiles": (ss.Weighted(ss.Quantiles(qs=[0.5], method="inverted_cdf")),
                               (jax.ShapeDtypeStruct((), jnp.float32), x)),
        "GroupBy Moments": (ss.GroupBy(ss.Moments(), num_keys=4), (jax.ShapeDtypeStruct((), jnp.int32), x)),
    }


def test_every_builtins_add_and_merge_is_pinned_and_an_unpinnable_sum_is_one_line_before_compute():
    from sharded_scan.combiners.base import rows_spec

    for name, (combiner, spec) in builtins().items():
        bound = combiner.bind(jax.tree.map(np.asarray, combiner.operands(spec)))
        acc = jax.eval_shape(lambda c=combiner, s=spec: c.init(s))
        add = jax.make_jaxpr(bound.add)(acc, rows_spec(spec, 16), jax.ShapeDtypeStruct((16,), bool))
        assert unpinned(add) == [] and unpinned(jax.make_jaxpr(bound.merge)(acc, acc)) == [], name

    # what it cannot pin, wherever it hides (a branch inside a loop), is named, each once
    def hidden(x):
        def body(c, row):
            conv = lambda r: c + jnp.convolve(r, r, "same")  # noqa: E731
            return jax.lax.cond(row[0] > 0, conv, lambda r: c + jnp.fft.fft(r).real, row), None

        return jax.lax.scan(body, jnp.zeros(x.shape[1]), x)[0] + jnp.linalg.eigh(x.T @ x)[0]

    x = rows(5, 3)
    assert unpinned(jax.make_jaxpr(hidden)(x)) == ["fft", "conv_general_dilated", "eigh"]  # cond: false first
    with pytest.raises(UsageError, match="^this function is not bitwise under logical_shards: it uses 'fft', "
                                         "'conv_general_dilated', 'eigh', whose float summation order"):
        jax.jit(fixed_order(hidden))(x)
    assert unpinned(jax.make_jaxpr(lambda x: jnp.linalg.qr(x)[0])(x)) == ["qr's Q"]  # it computes R alone
    assert unpinned(jax.make_jaxpr(lambda x: x.at[jnp.array([0, 0])].multiply(2.0))(x)) == ["scatter-mul"]
    assert unpinned(jax.make_jaxpr(lambda x: jnp.cumsum(x.astype(jnp.int32)))(x)) == []  # integers: exact
    # a float scatter-add of repeated indices: its updates added in their order; a cumulative sum: a fixed tree
    updates, at = rows(40, 3, seed=5), np.random.default_rng(5).integers(0, 4, 40)
    added, summed = jax.jit(fixed_order(lambda u: (jnp.zeros((4, 3)).at[at].add(u), jnp.cumsum(u, axis=0))))(updates)
    want = np.zeros((4, 3), np.float32)
    np.add.at(want, at, updates)  # one row after another, each add rounded to float32
    np.testing.assert_array_equal(added, want)
    np.testing.assert_array_equal(summed, jax.lax.associative_scan(jnp.add, updates))

    import sharded_scan as ss
    from sharded_scan.program import build_program
    from sharded_scan.sources import ArraySource

    user = ss.from_fn(lambda c, b: c + jnp.fft.fft(b, axis=1).real.sum(0), jnp.zeros(3, jnp.float32))  # per row
    options = ss.RunOptions(logical_shards=8, microbatch=16)
    with pytest.raises(UsageError) as refused:
        build_program(user, ArraySource(rows(64, 3)), options)  # resolves the job, computes nothing
    message = str(refused.value)
    assert "\n" not in message and message.startswith("FnCombiner is not bitwise under logical_shards: it uses "
                                                       "'fft'") and "leave logical_shards out" in message
    assert np.isfinite(ss.run(user, rows(64, 3), microbatch=16)).all()  # without logical_shards it runs


def test_the_r_of_a_qr_is_lapacks_to_rounding_and_the_same_in_any_batch():
    rng = np.random.default_rng(4)
    tall = rng.normal(size=(40, 19)).astype(np.float32)  # 19 columns: panels of QR_PANEL (8), the last padded
    tall[5:9] = 0  # masked rows (zero rows change no R)
    tall[:, [3, 12]] = 0  # zero columns: their reflections are the identity
    for a in (tall, tall[:5], tall[:13], rng.normal(size=(1, 4)).astype(np.float32), tall[:, :1]):
        want = np.linalg.qr(a.astype(np.float64), mode="r")  # LAPACK's signs: R[j, j] = -sign(alpha) |x|
        got = np.asarray(jax.jit(fixed_order(lambda a: jnp.linalg.qr(a, mode="r")))(a))
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=5e-6 * np.abs(want).max())
    batched = np.stack([tall, tall[::-1], 2 * tall])
    one = np.asarray(jax.jit(ordered_qr_r)(tall))
    np.testing.assert_array_equal(np.asarray(jax.jit(ordered_qr_r)(batched))[0], one)  # no kernel picks the order
    poisoned = tall.copy()
    poisoned[20, 2] = np.nan
    r = np.asarray(jax.jit(ordered_qr_r)(poisoned))  # the NaN reaches its column's reflection and all after it
    assert np.isnan(r.diagonal()[2:]).all() and np.isfinite(r[:2, :2]).all()
