"""Matrix products in a fixed summation order: each output element is the plain float sum of
its products in contraction order, whatever the shapes (a column block of a ``model`` axis, a
matrix-vector product, batch dimensions), so no library kernel or fusion choice can change it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharded_scan.fixed_order import fixed_order, ordered_dot_general


def in_order(left, right):
    """sum_k left[k] * right[k] in float32, one rounding for each product and each add."""
    acc = np.float32(-0.0) + left[0] * right[0]
    for a, b in zip(left[1:], right[1:], strict=True):
        acc = acc + a * b
    return acc


def rows(n, d, seed=0):
    return (3 + np.random.default_rng(seed).normal(size=(n, d))).astype(np.float32)


@pytest.mark.parametrize("k", [1, 2, 5, 37, 256])
def test_a_gram_block_is_its_products_added_in_row_order(k):
    x = rows(k, 30)
    dims = (((0,), (0,)), ((), ()))
    whole = np.asarray(jax.jit(lambda x: ordered_dot_general(x, x, dims))(x))
    block = np.asarray(jax.jit(lambda x: ordered_dot_general(x, x[:, 8:16], dims))(x))
    want = in_order(x[:, :, None], x[:, None, :])
    np.testing.assert_array_equal(whole, want)
    np.testing.assert_array_equal(block, want[:, 8:16])


def test_batched_and_matrix_vector_products_keep_the_order():
    a, b = rows(3 * 7 * 5, 1).reshape(3, 7, 5), rows(3 * 5 * 4, 1, seed=1).reshape(3, 5, 4)
    got = jax.jit(lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b))
    want = np.stack([in_order(a[i].T[:, :, None], b[i][:, None, :]) for i in range(3)])
    np.testing.assert_array_equal(np.asarray(jax.jit(fixed_order(got))(a, b)), want)
    v = rows(5, 1, seed=2)[:, 0]
    np.testing.assert_array_equal(np.asarray(jax.jit(fixed_order(jnp.dot))(a[0], v)), in_order(a[0].T, v[:, None]))


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
    jaxpr = jax.make_jaxpr(fixed_order(fn))(x, w)
    assert "dot_general" not in str(jaxpr)


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
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


def test_integer_products_are_left_to_xla():
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    assert "dot_general" in str(jax.make_jaxpr(fixed_order(jnp.matmul))(a, a.T))
    np.testing.assert_array_equal(jax.jit(fixed_order(jnp.matmul))(a, a.T), a @ a.T)


def test_non_finite_products_are_ieee():
    x = np.array([[1.0, np.inf], [2.0, 1.0], [np.nan, 0.0]], np.float32)
    dims = (((0,), (0,)), ((), ()))
    for rows_ in (x[:2], x):
        with np.errstate(invalid="ignore"):
            want = rows_.T @ rows_
        np.testing.assert_array_equal(jax.jit(lambda x: ordered_dot_general(x, x, dims))(rows_), want)
