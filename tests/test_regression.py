"""LinearRegression against scikit-learn and numpy lstsq in float64."""

import ml_dtypes
import numpy as np
import pytest

import sharded_scan as ss
from tests.helpers import assert_usage_error, f64, rel_err


def problem(n, d=4, t=None, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    w = rng.normal(size=(d,) if t is None else (d, t))
    y = x @ w + 0.5 + 0.1 * rng.normal(size=(n,) if t is None else (n, t))
    return x, y.astype(np.float32)


def lstsq(x, y, fit_intercept=True):
    x, y = f64(x), f64(y)
    a = np.hstack([x, np.ones((len(x), 1))]) if fit_intercept else x
    sol = np.linalg.lstsq(a, y, rcond=None)[0]
    return (sol[:-1].T, sol[-1]) if fit_intercept else (sol.T, np.zeros(sol.shape[1:]))


@pytest.mark.parametrize("mesh", ["data:1", "data:2", "data:8", "data:4,model:2"])
@pytest.mark.parametrize("n", [7, 1009])
def test_least_squares_matches_lstsq(mesh, n):
    x, y = problem(n)
    got = ss.run(ss.LinearRegression(), (x, y), mesh=mesh, microbatch=8, steps_per_call=2)
    coef, intercept = lstsq(x, y)
    assert got.coef.shape == (4,) and np.ndim(got.intercept) == 0
    assert rel_err(got.coef, coef) < 1e-4
    assert rel_err(got.intercept, intercept) < 1e-4


@pytest.mark.parametrize("l2", [0.0, 3.0])
@pytest.mark.parametrize("fit_intercept", [True, False])
def test_ridge_matches_scikit_learn_multi_target(l2, fit_intercept):
    linear_model = pytest.importorskip("sklearn.linear_model")
    x, y = problem(1009, t=3, seed=1)
    got = ss.run(ss.LinearRegression(l2=l2, fit_intercept=fit_intercept), (x, y), microbatch=8)
    want = linear_model.Ridge(alpha=l2, fit_intercept=fit_intercept, solver="cholesky").fit(f64(x), f64(y))
    assert got.coef.shape == (3, 4) and got.intercept.shape == (3,)
    assert rel_err(got.coef, want.coef_) < 1e-5
    assert rel_err(got.intercept, want.intercept_) < 1e-5 if fit_intercept else not got.intercept.any()


def test_independent_of_microbatch_and_bfloat16_inputs():
    x, y = problem(515, seed=2)
    coef, intercept = lstsq(x, y)
    for microbatch, steps in [(1, 1), (64, 3)]:
        got = ss.run(ss.LinearRegression(), (x, y), microbatch=microbatch, steps_per_call=steps)
        assert rel_err(got.coef, coef) < 1e-4
    xb, yb = x.astype(ml_dtypes.bfloat16), y.astype(ml_dtypes.bfloat16)
    got = ss.run(ss.LinearRegression(), (xb, yb), microbatch=16)
    coef, intercept = lstsq(xb, yb)
    assert rel_err(got.coef, coef) < 1e-4 and rel_err(got.intercept, intercept) < 1e-4


def test_singular_system_asks_for_l2():
    x, y = problem(50)
    x[:, 3] = 2 * x[:, 1]
    with pytest.raises(ss.UsageError, match="l2 > 0"):
        ss.run(ss.LinearRegression(), (x, y), microbatch=8)
    got = ss.run(ss.LinearRegression(l2=1e-3), (x, y), microbatch=8)
    assert np.isfinite(got.coef).all()


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: ss.run(ss.LinearRegression(), problem(10)[0]), ["(X, y)"]),
        (lambda: ss.run(ss.LinearRegression(), {"x": problem(10)[0], "y": problem(10)[1]}), ["(X, y)"]),
        (lambda: ss.run(ss.LinearRegression(), (problem(10)[0][:, 0], problem(10)[1])), ["(n, d)", "()"]),
        (lambda: ss.run(ss.LinearRegression(), (problem(10)[0], np.zeros((10, 2, 2)))), ["(n, t)", "(2, 2)"]),
        (lambda: ss.LinearRegression(l2=-1.0), ["l2 >= 0"]),
    ],
)
def test_bad_input_is_one_clear_line(call, words):
    assert_usage_error(call, words)
