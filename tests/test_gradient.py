"""Gradient: the full-dataset mean loss and its gradient, against numpy by hand."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import sharded_scan as ss
from tests.helpers import assert_usage_error, f64, rel_err


def logistic_loss(params, batch):
    x, y = batch
    logits = x @ params["w"] + params["b"][0]
    return jnp.logaddexp(0.0, logits) - y * logits  # per-row cross-entropy


def problem(n, d=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = (rng.random(n) < 0.5).astype(np.float32)
    params = {"w": rng.normal(size=d).astype(np.float32), "b": np.array([0.3], np.float32)}
    return (x, y), params


def reference(data, params):
    """Mean logistic loss and its gradient, by hand in float64."""
    x, y = f64(data[0]), f64(data[1])
    logits = x @ f64(params["w"]) + f64(params["b"])[0]
    loss = np.logaddexp(0.0, logits) - y * logits
    residual = 1 / (1 + np.exp(-logits)) - y
    return loss.mean(), {"w": x.T @ residual / len(x), "b": np.array([residual.mean()])}


def check(got, data, params, tol=1e-5):
    loss, grad = reference(data, params)
    assert got.count == len(data[0])
    assert rel_err(got.loss, loss) < tol
    assert jax.tree.structure(got.grad) == jax.tree.structure(grad)
    for leaf, want in zip(jax.tree.leaves(got.grad), jax.tree.leaves(grad), strict=True):
        assert rel_err(leaf, want) < tol


# One device, eight (ragged), and a 2-D mesh: a gradient merges by psum like Sum's, whose data:2 is test_engine's
@pytest.mark.parametrize("mesh", ["data:1", "data:8", "data:4,model:2"])
@pytest.mark.parametrize("n", [1, 3, 1009])
def test_mean_loss_and_gradient_match_numpy(mesh, n):
    data, params = problem(n)
    check(ss.run(ss.Gradient(logistic_loss, params), data, mesh=mesh, microbatch=8, steps_per_call=2), data, params)


def test_matches_jax_grad_of_full_batch_and_is_independent_of_microbatch():
    data, params = problem(1009, seed=1)
    loss, grad = jax.value_and_grad(lambda p: logistic_loss(p, data).mean())(params)
    for microbatch, steps in [(1, 1), (8, 2)]:  # (8, 2): test_mean_loss_and_gradient_match_numpy's data:8 program
        got = ss.run(ss.Gradient(logistic_loss, params), data, mesh="data:8", microbatch=microbatch,
                     steps_per_call=steps)
        assert rel_err(got.loss, loss) < 1e-5
        assert rel_err(got.grad["w"], grad["w"]) < 1e-5 and rel_err(got.grad["b"], grad["b"]) < 1e-5


def test_bfloat16_data():
    (x, y), params = problem(515, seed=2)
    data = (x.astype(ml_dtypes.bfloat16), y.astype(ml_dtypes.bfloat16))
    check(ss.run(ss.Gradient(logistic_loss, params), data, microbatch=16), data, params)


def test_padding_rows_with_a_nan_loss_do_not_count():
    # A loss that is NaN at an all-zero (padding) row: masking must keep it out.
    def loss(params, x):
        return jnp.where(x[:, 0] == 0, jnp.nan, (x @ params) ** 2)

    x = np.random.default_rng(3).normal(size=(13, 2)).astype(np.float32) + 5
    w = np.array([1.0, -2.0], np.float32)
    got = ss.run(ss.Gradient(loss, w), x, microbatch=4)
    assert rel_err(got.loss, (f64(x) @ w).__pow__(2).mean()) < 1e-5
    assert rel_err(got.grad, 2 * f64(x).T @ (f64(x) @ w) / 13) < 1e-5


def test_merge_adds_with_init_as_identity():
    data, params = problem(10)
    combiner = ss.Gradient(logistic_loss, params)
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), data)
    a = jax.jit(combiner.add)(combiner.init(spec), data, np.ones(10, bool))  # one program, not op by op
    for got, want in zip(jax.tree.leaves(combiner.merge(combiner.init(spec), a)), jax.tree.leaves(a), strict=True):
        np.testing.assert_array_equal(got, want)
    check(combiner.finalize(jax.device_get(a)), data, params)


@pytest.mark.parametrize(
    "loss, words",
    [
        (lambda p, b: logistic_loss(p, b).mean(), ["one loss per row", "(3,)", "()"]),
        (lambda p, b: b[0] @ p["w"][:2], ["fails", "3 rows"]),
    ],
)
def test_bad_loss_is_one_clear_line(loss, words):
    data, params = problem(10)
    assert_usage_error(lambda: ss.run(ss.Gradient(loss, params), data), words)


def test_integer_params_are_rejected():
    with pytest.raises(ss.UsageError, match="float params"):
        ss.run(ss.Gradient(lambda p, x: x @ p, np.ones(2, np.int32)), np.ones((4, 2), np.float32))
