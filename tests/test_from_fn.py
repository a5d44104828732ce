"""from_fn: a seed-style scan body as an additive combiner, and the seed's example made right."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import sharded_scan as ss
from tests.helpers import assert_usage_error, f64, rel_err


def gram_body(c, b):
    return c + b.T @ b


def test_seed_example_with_from_fn_and_with_gram():
    # The seed's intent: data ones((1000, 128)), batches of 10 rows, the (128, 128) XᵀX.
    data = np.ones((1000, 128), np.float32)
    want = f64(data).T @ f64(data)
    got = ss.run(ss.from_fn(gram_body, jnp.zeros((128, 128))), data, mesh="data:8", microbatch=10)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(ss.run(ss.Gram(), data, mesh="data:8", microbatch=10), want)


def test_seed_original_body_is_one_clear_line():
    data = np.ones((1000, 128), np.float32)
    with pytest.raises(ss.UsageError) as err:
        ss.run(ss.from_fn(lambda c, b: c + jnp.dot(b, b.T), jnp.zeros((128, 128))), data, microbatch=10)
    message = str(err.value)
    assert "\n" not in message
    assert "from_fn" in message and "(128, 128)" in message


@pytest.mark.parametrize("mesh", ["data:1", "data:2", "data:8", "data:4,model:2"])
@pytest.mark.parametrize("n", [1, 3, 1009])
def test_pytree_carry_matches_numpy(mesh, n):
    # g(0) != 0 here (the +1 per row counts rows): padding must be subtracted exactly.
    def body(c, b):
        return {"sq": c["sq"] + jnp.sum((b + 1.0) ** 2, axis=0), "rows": c["rows"] + b.shape[0]}

    x = np.random.default_rng(0).normal(size=(n, 3)).astype(np.float32)
    init = {"sq": jnp.zeros(3), "rows": jnp.zeros((), jnp.int32)}
    got = ss.run(ss.from_fn(body, init), x, mesh=mesh, microbatch=8, steps_per_call=2)
    assert rel_err(got["sq"], ((f64(x) + 1) ** 2).sum(0)) < 1e-5
    assert got["rows"] == n


def test_callable_init_nonzero_start_and_microbatch_independence():
    x = np.random.default_rng(1).normal(size=(1009, 4)).astype(np.float32)
    want = f64(x).T @ f64(x) + 2.0
    for microbatch, steps in [(1, 1), (64, 3)]:
        combiner = ss.from_fn(gram_body, lambda spec: jnp.full((spec.shape[0],) * 2, 2.0, jnp.float32))
        got = ss.run(combiner, x, microbatch=microbatch, steps_per_call=steps)
        assert rel_err(got, want) < 1e-5


def test_bfloat16_rows_with_float32_carry():
    x = np.random.default_rng(2).normal(size=(515, 4)).astype(ml_dtypes.bfloat16)
    body = lambda c, b: c + jnp.matmul(b.T, b, preferred_element_type=jnp.float32)  # noqa: E731
    got = ss.run(ss.from_fn(body, np.zeros((4, 4), np.float32)), x, microbatch=16)
    assert got.dtype == np.float32
    assert rel_err(got, f64(x).T @ f64(x)) < 1e-5


def test_merge_adds_with_init_as_identity():
    combiner, spec = ss.from_fn(gram_body, jnp.zeros((2, 2))), jax.ShapeDtypeStruct((2,), np.float32)
    combiner.check_spec(spec)
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    a = combiner.add(combiner.init(spec), x, np.array([True, True, False]))
    np.testing.assert_array_equal(combiner.merge(combiner.init(spec), a), a)
    np.testing.assert_array_equal(combiner.finalize(np.asarray(a)), f64(x[:2]).T @ f64(x[:2]))


@pytest.mark.parametrize(
    "body, init, words",
    [
        (gram_body, jnp.zeros((3, 3), jnp.int32), ["int32(3, 3)", "float32(3, 3)", "match"]),
        (lambda c, b: c.sum() + b.sum(), jnp.zeros(3), ["float32(3,)", "float32()"]),
        (lambda c, b: (c, b), jnp.zeros((3, 3)), ["carry like init"]),
    ],
)
def test_carry_mismatch_is_one_clear_line(body, init, words):
    x = np.ones((10, 3), np.float32)
    assert_usage_error(lambda: ss.run(ss.from_fn(body, init), x), words)
