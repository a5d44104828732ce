"""Cholesky and triangular inverse in plain XLA ops, against numpy in float64."""

import jax
import numpy as np
import pytest

from sharded_scan.combiners.linalg import dense


@pytest.mark.parametrize("n", [1, 7, 32, 33, 70])
def test_cholesky_and_inverse_match_numpy(n):
    a = np.random.default_rng(n).normal(size=(2 * n + 3, n))
    m = (a.T @ a).astype(np.float32)
    u, deflated, u_inv = jax.jit(dense.cholesky_upper)(m)
    u, u_inv = np.asarray(u, np.float64), np.asarray(u_inv, np.float64)
    want = np.linalg.cholesky(m.astype(np.float64)).T
    assert not np.asarray(deflated).any()
    assert np.abs(u - want).max() < 1e-5 * np.abs(want).max()
    assert (np.tril(u, -1) == 0).all() and (np.tril(u_inv, -1) == 0).all()
    assert np.abs(u_inv @ u - np.eye(n)).max() < 1e-5
    np.testing.assert_allclose(np.asarray(jax.jit(dense.triangular_inverse)(u.astype(np.float32))), u_inv, atol=1e-5)


@pytest.mark.parametrize("n", [6, 40])
def test_a_singular_matrix_deflates_its_dependent_columns(n):
    a = np.random.default_rng(0).normal(size=(3 * n, n))
    a[:, 2] = 2 * a[:, 1]  # column 2 adds nothing
    m = (a.T @ a) / np.outer(np.linalg.norm(a, axis=0), np.linalg.norm(a, axis=0))
    u, deflated, u_inv = jax.jit(dense.cholesky_upper, static_argnums=())(m.astype(np.float32), 1e-5)
    assert np.asarray(deflated).tolist() == [j == 2 for j in range(n)]
    u = np.asarray(u, np.float64)
    keep = ~np.asarray(deflated)
    np.testing.assert_allclose((u[keep].T @ u[keep]), m, atol=1e-5)
    assert np.isfinite(np.asarray(u_inv)).all()


def test_the_inverse_comes_from_the_factorization_two_products_a_block():
    # Issue 45 item 4: U⁻¹ from the elimination of [a|I] (rows [U|U⁻ᵀ]) and each diagonal block's from its own row
    # loop: two matrix products a block, where a block column of U⁻¹ took two more (under logical_shards each is a
    # handful of kernels to compile); without the inverse, U is the same, bit for bit.
    a = np.random.default_rng(3).normal(size=(143, 70))
    m = (a.T @ a / 143).astype(np.float32)
    assert str(jax.make_jaxpr(dense.cholesky_upper)(m)).count("dot_general[") == 2
    u, deflated, u_inv = jax.jit(dense.cholesky_upper)(m)
    alone, alone_deflated, none = jax.jit(lambda m: dense.cholesky_upper(m, inverse=False))(m)
    assert none is None
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(u))
    np.testing.assert_array_equal(np.asarray(alone_deflated), np.asarray(deflated))
    assert np.abs(np.asarray(u, np.float64) @ np.asarray(u_inv, np.float64) - np.eye(70)).max() < 1e-5


def _product_shapes(jaxpr) -> list:
    """The output shapes of every ``dot_general`` in ``jaxpr``, inside loops too."""
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            shapes.append(eqn.outvars[0].aval.shape)
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                shapes += _product_shapes(inner)
    return shapes


def test_the_products_take_only_the_columns_still_to_come():
    # Issue 45 item 4: each block's panel and update take the columns of [a|I] still to come (U's after the block and
    # U⁻ᵀ's up to its end, as many as a's), not all of them: half the work. Under fixed_order (logical_shards) each
    # product element is a function of its row and column alone, so U has the bits of the whole update (the
    # factorization without U⁻¹), deflated columns too.
    from sharded_scan.fixed_order import fixed_order

    a = np.random.default_rng(4).normal(size=(150, 70))
    a[:, 9] = 3 * a[:, 4]
    m = ((a.T @ a) / np.outer(np.linalg.norm(a, axis=0), np.linalg.norm(a, axis=0))).astype(np.float32)
    assert sorted(_product_shapes(jax.make_jaxpr(dense.cholesky_upper)(m).jaxpr)) == [(32, 96), (96, 96)]
    u, deflated, u_inv = jax.jit(fixed_order(lambda m: dense.cholesky_upper(m, 1e-5)))(m)
    alone, alone_deflated, _ = jax.jit(fixed_order(lambda m: dense.cholesky_upper(m, 1e-5, inverse=False)))(m)
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(u))
    np.testing.assert_array_equal(np.asarray(alone_deflated), np.asarray(deflated))
    assert np.asarray(deflated).tolist() == [j == 9 for j in range(70)]
    assert (np.tril(np.asarray(u_inv), -1) == 0).all()
    assert np.abs(np.asarray(u_inv, np.float64) @ np.asarray(u, np.float64) - np.eye(70)).max() < 1e-4


def test_under_fixed_order_a_blocks_rows_come_from_their_ordered_formulation_with_the_same_bits():
    # Issue 45 item 4: under fixed_order (logical_shards) a Cholesky block's rows come from
    # dense._ordered_block_rows (fixed_order.TOGETHER, by the jit's name: a loop XLA:CPU runs in half the time),
    # plain programs from dense._block_rows as they rounded. Both under fixed_order, IEEE's quotient, compiled as a
    # step is (XLA's defaults): the same bits, deflated rows, a zero column and a NaN too. (In the suite's own
    # setting, legacy emitters at O0, XLA contracts a product into its subtraction in one formulation's kernel and
    # not the other's when each is a program of its own; inside the jobs' merges, compiled so, they agree: results
    # hashed against the code before, bench/README.md.)
    from sharded_scan import fixed_order as order
    from tests.helpers import XLA_DEFAULTS

    assert dense._block_rows.__name__ in order.TOGETHER
    rng = np.random.default_rng(5)
    for case in range(4):
        x = rng.normal(size=(96, 32)).astype(np.float32)
        if case == 1:
            x[:, 7] = 2 * x[:, 3]
        if case == 2:
            x[:, 11] = 0
        a = np.concatenate([x.T @ x, np.eye(32, dtype=np.float32)], 1)
        if case == 3:
            a[5, 20] = np.nan
        for below in (-1.0, 1e-3):
            ordered, followed = (jax.jit(order.fixed_order(lambda a, f=f, below=below: f(a, below)),
                                         compiler_options=dict(XLA_DEFAULTS))(a)
                                 for f in (dense._cholesky_block, dense._block_rows))
            for got, want in zip(ordered, followed, strict=True):
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
