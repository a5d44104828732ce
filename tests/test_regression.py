"""LinearRegression against scikit-learn and numpy lstsq in float64."""

import ml_dtypes
import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan.combiners.linalg.solvers import SOLVERS
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


# Each mesh once, each size on two (every case compiles a re-whitening fold).
@pytest.mark.parametrize("mesh, n", [("data:1", 1009), ("data:2", 7), ("data:8", 1009), ("data:4,model:2", 7)])
def test_least_squares_matches_lstsq(mesh, n):
    x, y = problem(n)
    got = ss.run(ss.LinearRegression(), (x, y), mesh=mesh, microbatch=8, steps_per_call=2)
    coef, intercept = lstsq(x, y)
    assert got.coef.shape == (4,) and np.ndim(got.intercept) == 0
    assert rel_err(got.coef, coef) < 1e-4
    assert rel_err(got.intercept, intercept) < 1e-4


@pytest.mark.parametrize("l2, fit_intercept", [(0.0, True), (3.0, False)])
def test_ridge_matches_scikit_learn_multi_target(l2, fit_intercept):
    linear_model = pytest.importorskip("sklearn.linear_model")
    x, y = problem(1009, t=2, seed=1)  # the rows, mesh and layout of test_every_solver_...: its compiled steps
    got = ss.run(ss.LinearRegression(l2=l2, fit_intercept=fit_intercept), (x, y), mesh="data:3", microbatch=8,
                 steps_per_call=2)
    want = linear_model.Ridge(alpha=l2, fit_intercept=fit_intercept, solver="cholesky").fit(f64(x), f64(y))
    assert got.coef.shape == (2, 4) and got.intercept.shape == (2,)
    assert rel_err(got.coef, want.coef_) < 1e-5
    assert rel_err(got.intercept, want.intercept_) < 1e-5 if fit_intercept else not got.intercept.any()


def test_independent_of_microbatch_and_bfloat16_inputs():
    x, y = problem(515, seed=2)
    coef, intercept = lstsq(x, y)
    got = ss.run(ss.LinearRegression(), (x, y), microbatch=1, steps_per_call=1)
    assert rel_err(got.coef, coef) < 1e-4
    xb, yb = x.astype(ml_dtypes.bfloat16), y.astype(ml_dtypes.bfloat16)
    got = ss.run(ss.LinearRegression(), (xb, yb), microbatch=64, steps_per_call=3)
    coef, intercept = lstsq(xb, yb)
    assert rel_err(got.coef, coef) < 1e-4 and rel_err(got.intercept, intercept) < 1e-4


def test_singular_system_gets_the_minimum_norm_solution_like_lstsq():
    # Was refused ("XᵀX is singular; pass l2 > 0"): numpy solves it, so we do too.
    x, y = problem(50)
    x[:, 3] = 2 * x[:, 1]
    for solver in SOLVERS:
        got = ss.run(ss.LinearRegression(solver=solver), (x, y), mesh="data:3", microbatch=8)
        coef, intercept = lstsq(x, y)
        assert rel_err(got.coef, coef) < 1e-4 and rel_err(got.intercept, intercept) < 1e-4, solver
        assert got.rank == 3 and got.cond > 1e5  # rounding: about 1 / eps, not inf
    got = ss.run(ss.LinearRegression(l2=1e-3), (x, y), mesh="data:3", microbatch=8)
    assert np.isfinite(got.coef).all()


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: ss.run(ss.LinearRegression(), problem(10)[0]), ["(X, y)"]),
        (lambda: ss.run(ss.LinearRegression(), {"x": problem(10)[0], "y": problem(10)[1]}), ["(X, y)"]),
        (lambda: ss.run(ss.LinearRegression(), (problem(10)[0][:, 0], problem(10)[1])), ["(n, d)", "()"]),
        (lambda: ss.run(ss.LinearRegression(), (problem(10)[0], np.zeros((10, 2, 2)))), ["(n, t)", "(2, 2)"]),
        (lambda: ss.LinearRegression(l2=-1.0), ["l2 >= 0"]),
        (lambda: ss.LinearRegression(solver="qr"), ["solver", "'whitened'", "'qr'"]),
        (lambda: ss.PCA(2, solver="svd"), ["solver", "'svd'"]),
    ],
)
def test_bad_input_is_one_clear_line(call, words):
    assert_usage_error(call, words)


def everyday_rows(n=200_000, seed=0, lognormal=False):
    """The issue's float32 rows: year 1990..2020, income ~5e4 (normal or lognormal), age ~40."""
    rng = np.random.default_rng(seed)
    year = rng.integers(1990, 2021, n).astype(np.float64)
    income = rng.lognormal(np.log(5e4), 0.5, n) if lognormal else rng.normal(5e4, 1e4, n)
    age = rng.normal(40, 10, n)
    return np.stack([year, income, age], axis=1).astype(np.float32), rng


def test_everyday_float32_regression_matches_float64_scikit_learn():
    # Raw float32 normal equations called XᵀX "singular" here (means far from zero).
    linear_model = pytest.importorskip("sklearn.linear_model")
    x, rng = everyday_rows()
    y = f64(x) @ [250, 0.8, -30] + 1000 + rng.normal(0, 50, len(x))
    y = y.astype(np.float32)
    got = ss.run(ss.LinearRegression(), (x, y), mesh="data:4")
    want = linear_model.LinearRegression().fit(f64(x), f64(y))
    assert np.abs(got.coef / want.coef_ - 1).max() < 1e-3
    assert abs(got.intercept / want.intercept_ - 1) < 1e-3
    assert got.rank == 3 and 1 <= got.cond < 10


def test_ridge_on_lognormal_income_matches_scikit_learn_ridge():
    # Raw float32 sums centred on the host gave [-9.69, 1.97e-4, 0.491] for [3.0001, 2.0e-4, 0.49995].
    linear_model = pytest.importorskip("sklearn.linear_model")
    x, rng = everyday_rows(lognormal=True, seed=1)
    y = (f64(x) @ [3, 2e-4, 0.5] + rng.normal(0, 1, len(x))).astype(np.float32)
    got = ss.run(ss.LinearRegression(l2=1.0), (x, y), mesh="data:4")
    want = linear_model.Ridge(alpha=1.0).fit(f64(x), f64(y))
    assert np.abs(got.coef / want.coef_ - 1).max() < 1e-3
    assert abs(got.intercept - want.intercept_) < 1e-6 * abs(f64(y).mean())  # ~0.1: within y's float32 ulps


def test_rank_is_scale_invariant_and_constant_columns_get_zero_like_scikit_learn():
    linear_model = pytest.importorskip("sklearn.linear_model")
    rng = np.random.default_rng(3)
    x = np.stack([rng.normal(0, 1, 3000), rng.normal(0, 1e4, 3000), np.full(3000, 7.0), np.zeros(3000)], axis=1)
    x = x.astype(np.float32)
    y = (x[:, 0] + 1e-4 * x[:, 1] + rng.normal(0, 0.1, 3000)).astype(np.float32)
    # The mesh, micro-batch and (n, 4) rows of test_least_squares_matches_lstsq: its compiled step.
    got = ss.run(ss.LinearRegression(), (x, y), mesh="data:8", microbatch=8, steps_per_call=2)
    want = linear_model.LinearRegression().fit(f64(x), f64(y))
    assert got.rank == 2  # variances 1 and 1e8 are independent, not "singular"; the constant columns are
    np.testing.assert_allclose(got.coef, want.coef_, rtol=1e-4, atol=1e-9)
    assert got.coef[2] == 0 and got.coef[3] == 0
    assert abs(got.intercept / want.intercept_ - 1) < 1e-4


@pytest.mark.parametrize("solver", list(SOLVERS))
def test_every_solver_matches_lstsq_and_is_in_the_fingerprint(solver):
    x, y = problem(1009, t=2, seed=4)
    x[:, 0] += 1e3  # a large mean
    got = ss.run(ss.LinearRegression(solver=solver), (x, y), mesh="data:3", microbatch=8, steps_per_call=2)
    coef, intercept = lstsq(x, y)
    assert rel_err(got.coef, coef) < 1e-4 and rel_err(got.intercept, intercept) < 1e-4
    assert ss.LinearRegression(solver=solver).fingerprint()["solver"] == repr(solver)


@pytest.mark.parametrize("solver", list(SOLVERS))
def test_rows_holding_nan_give_every_solver_nan_not_zeros(solver):
    # Issue 42, finding 4: under nan_policy="propagate" a NaN row reached the whitened solve as a zero column
    # (coefficients 0, a lower rank) and failed the others' solve; now every field is NaN (rank -1).
    x, y = problem(1009, t=2, seed=4)  # the programs of test_every_solver_...
    x[:, 0] += 1e3
    x[[5, 600], 1], y[700, 1] = np.nan, np.nan
    got = ss.run(ss.LinearRegression(solver=solver), (x, y), mesh="data:3", microbatch=8, steps_per_call=2)
    for field in ("coef", "intercept", "cond", "r2", "residual_std", "coef_stderr", "intercept_stderr"):
        assert np.isnan(getattr(got, field)).all(), (field, getattr(got, field))
    assert got.rank == -1 and got.coef.shape == (2, 4) and got.intercept.shape == (2,)


def test_merge_is_associative_with_init_as_identity():
    import jax

    combiner = ss.LinearRegression()
    spec = (jax.ShapeDtypeStruct((4,), np.float32), jax.ShapeDtypeStruct((), np.float32))
    x, y = problem(30, seed=5)
    x += 1e3
    mask = np.ones(10, bool)
    # add and merge each one program, as the engine runs them (called op by op, each operation compiled its own)
    add, merge = jax.jit(combiner.add), jax.jit(combiner.merge)
    a, b, c = (add(combiner.init(spec), (x[i : i + 10], y[i : i + 10]), mask) for i in (0, 10, 20))
    empty = combiner.init(spec)
    for merged in (merge(empty, a), merge(a, empty)):
        for leaf_got, leaf_want in zip(jax.tree.leaves(merged), jax.tree.leaves(a), strict=True):
            np.testing.assert_array_equal(leaf_got, leaf_want)
    left = combiner.finalize(jax.device_get(merge(merge(a, b), c)))
    right = combiner.finalize(jax.device_get(merge(a, merge(b, c))))
    coef, intercept = lstsq(x, y)
    for got in (left, right):
        assert rel_err(got.coef, coef) < 1e-4 and rel_err(got.intercept, intercept) < 1e-4


def test_resumes_from_a_checkpoint_on_another_device_count(tmp_path):
    x, y = problem(1009, seed=6)
    x[:, 1] += 1e3

    class StopError(Exception):
        pass

    def stop_after_three(progress):
        if progress.step == 3:
            raise StopError

    options = ss.CheckpointOptions(str(tmp_path), every_steps=1)
    with pytest.raises(StopError):
        # Meshes, micro-batch and rows of test_least_squares_matches_lstsq: its compiled steps.
        ss.run(ss.LinearRegression(), (x, y), mesh="data:8", microbatch=8, steps_per_call=2, checkpoint=options,
               progress=stop_after_three)
    # Resumed with the directory's default options (no save a step: 28 steps of orbax saves were most of the test)
    got, report = ss.run_with_report(
        ss.LinearRegression(), (x, y), mesh="data:2", microbatch=8, steps_per_call=2, checkpoint=str(tmp_path)
    )
    assert report.resumed_from_cursor and 0 < report.rows_this_run < 1009  # the saved partials were folded
    coef, intercept = lstsq(x, y)
    assert rel_err(got.coef, coef) < 1e-4 and rel_err(got.intercept, intercept) < 1e-4


def ols(x, y, fit_intercept=True):
    """statsmodels' OLS of one target on ``x`` (a constant first when ``fit_intercept``)."""
    sm = pytest.importorskip("statsmodels.api")
    return sm.OLS(f64(y), sm.add_constant(f64(x), has_constant="add") if fit_intercept else f64(x)).fit()


def assert_diagnostics_match(got, want, rtol, fit_intercept=True):
    """``got``'s r2, residual_std and standard errors (one target) against statsmodels' fit ``want``."""
    assert abs(got.r2 - want.rsquared) < rtol * (1 - want.rsquared)  # relative to the unexplained part
    np.testing.assert_allclose(got.residual_std, np.sqrt(want.scale), rtol=rtol)
    bse = want.bse[1:] if fit_intercept else want.bse
    np.testing.assert_allclose(got.coef_stderr, bse, rtol=rtol)
    if fit_intercept:
        np.testing.assert_allclose(got.intercept_stderr, want.bse[0], rtol=rtol)
    else:
        assert np.isnan(got.intercept_stderr)  # fixed at 0, not estimated


# The meshes, micro-batch and float32 (n, 4) rows of test_least_squares_matches_lstsq: no new compilations.
@pytest.mark.parametrize("mesh, n", [("data:1", 1009), ("data:8", 203)])
def test_diagnostics_are_statsmodels_ols_in_float32(mesh, n):
    x, y = problem(n, seed=7)
    x[:, 0] += 100  # an offset the centred factor must not feel
    got = ss.run(ss.LinearRegression(), (x, y), mesh=mesh, microbatch=8, steps_per_call=2)
    assert np.ndim(got.r2) == np.ndim(got.residual_std) == np.ndim(got.intercept_stderr) == 0
    assert got.coef_stderr.shape == (4,)
    assert_diagnostics_match(got, ols(x, y), rtol=5e-4)  # measured: 5e-5 (the float32 accumulation)
    table = got.to_pandas()
    np.testing.assert_array_equal(table["coef_stderr"], got.coef_stderr)
    assert (table["r2"] == got.r2).all()


def test_diagnostics_are_statsmodels_ols_in_float64_per_target():
    import jax

    x, y = problem(1009, t=2, seed=8)
    x, y = f64(x), f64(y)
    x[:, 0] += 100
    with jax.enable_x64(True):  # one device: the diagnostics are the host's, of the merged state; float64 merges of
        # 8 devices' partials: test_certified.py's (to 9 certified digits)
        fits = {b: ss.run(ss.LinearRegression(fit_intercept=b), (x, y), mesh="data:1", microbatch=8, steps_per_call=2)
                for b in (True, False)}
    for fit_intercept, got in fits.items():
        assert got.r2.shape == got.residual_std.shape == got.intercept_stderr.shape == (2,)
        assert got.coef_stderr.shape == (2, 4)
        for j in range(2):
            one = got._replace(**{f: getattr(got, f)[j] for f in ("r2", "residual_std", "coef_stderr",
                                                                   "intercept_stderr")})
            assert_diagnostics_match(one, ols(x, y[:, j], fit_intercept), rtol=1e-9, fit_intercept=fit_intercept)
    assert list(fits[True].to_pandas().columns[2:4]) == ["coef_stderr_0", "coef_stderr_1"]


def test_standard_errors_are_nan_where_the_ols_formula_does_not_hold():
    # The mesh and micro-batch of test_singular_system_gets_the_minimum_norm_solution_like_lstsq.
    import warnings

    linear_model = pytest.importorskip("sklearn.linear_model")
    x, y = problem(50, seed=9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # NaN by decision, not by numpy's 0/0
        ridge = ss.run(ss.LinearRegression(l2=1.0), (x, y), mesh="data:3", microbatch=8)
        x_singular = x.copy()
        x_singular[:, 3] = 2 * x_singular[:, 1]
        singular = ss.run(ss.LinearRegression(), (x_singular, y), mesh="data:3", microbatch=8)
        exact = ss.run(ss.LinearRegression(), (x[:5], y[:5]), mesh="data:3", microbatch=8)  # n = 5 parameters
    # Ridge: R² and the residual standard error of its own residuals; no OLS standard errors.
    residual = f64(y) - linear_model.Ridge(alpha=1.0).fit(f64(x), f64(y)).predict(f64(x))
    rss, tss = (residual**2).sum(), ((f64(y) - f64(y).mean()) ** 2).sum()
    assert abs(ridge.r2 - (1 - rss / tss)) < 1e-4 * rss / tss
    np.testing.assert_allclose(ridge.residual_std, np.sqrt(rss / (50 - 5)), rtol=1e-4)
    assert np.isnan(ridge.coef_stderr).all() and np.isnan(ridge.intercept_stderr)
    # Rank-deficient: statsmodels' pinv fit has the same residuals and n - rank - 1 degrees of freedom.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # statsmodels says the design is rank-deficient: we know
        want = ols(x_singular, y)
    assert singular.rank == 3 and want.df_resid == 50 - 4
    assert abs(singular.r2 - want.rsquared) < 1e-4 * (1 - want.rsquared)
    np.testing.assert_allclose(singular.residual_std, np.sqrt(want.scale), rtol=1e-4)
    assert np.isnan(singular.coef_stderr).all() and np.isnan(singular.intercept_stderr)
    # As many parameters as rows: a perfect fit with no degree of freedom left.
    assert exact.rank == 4 and abs(exact.r2 - 1) < 1e-4
    assert np.isnan(exact.residual_std) and np.isnan(exact.coef_stderr).all() and np.isnan(exact.intercept_stderr)


def test_the_whitened_power_estimate_traces_its_operator_once_and_estimates_the_top_eigenvalue():
    # Its operator (a matrix product, rewritten by fixed_order under logical_shards) in the loop only: the
    # solver's add and merge hold it twice each, and every copy is a program's worth of kernels to compile.
    import jax

    from sharded_scan.combiners.linalg import whitened

    m = np.diag(np.arange(1.0, 9.0, dtype=np.float32))
    traced = []

    def apply(v):
        traced.append(v)
        return m @ v

    jax.make_jaxpr(lambda v: whitened._power_estimate(apply, v))(np.ones(8, np.float32))
    assert len(traced) == 1
    assert abs(float(whitened._power_estimate(lambda v: m @ v, np.ones(8, np.float32))) - 8) < 0.2


def test_a_re_whitening_pass_multiplies_by_the_old_basis_once():
    # Issue 45 item 4: each matrix product of LinearRegression's pair merge is a handful of kernels to compile under
    # logical_shards. A re-whitening pass took three products with the old basis (for _null_free's columns, their
    # norms and the new basis) and _null_free's T a fourth; it now takes one (_null_free updates the basis and V
    # elementwise), and the Cholesky two a block where it took four: a pass 18 -> 12 products, the merge 30 -> 22.
    import jax
    import jax.numpy as jnp

    from sharded_scan.combiners.linalg import whitened

    p = 69
    acc = whitened.init(p, np.float32)
    state = whitened._Whitening(acc.basis, acc.gram, acc.gram, acc.floor, acc.diagonal)
    rows = whitened._Rows.of(jnp.zeros((2 * p + 2, p + 1), jnp.float32))
    one_pass = jax.make_jaxpr(lambda s, r: whitened._rewhiten(s, r, acc.start, 1, True))(state, rows)
    assert str(one_pass).count("dot_general[") <= 12
    assert str(jax.make_jaxpr(lambda a, b: whitened.merge(a, b, 1))(acc, acc)).count("dot_general[") <= 22


def test_a_young_whitened_shard_keeps_its_rows_as_they_are_and_neither_add_nor_merge_runs_a_qr():
    # Issue 45 item 4: a young shard (fewer than 2n rows) kept the R of its rows, a Householder QR of [R; rows]
    # a micro-batch, and a merge of two young shards ran another: under logical_shards (micro-batches of 256
    # rows) two QRs of 514 x 258 a shard at d=256, most of the job's time and a large part of its compiles. Now
    # it keeps the rows themselves (2n rows of room), in order, masked rows left out; a merge appends.
    import jax

    from sharded_scan.combiners import wide
    from sharded_scan.combiners.linalg import tsqr, whitened

    p, n = 3, 4
    z = np.arange(15, dtype=np.float32).reshape(5, p) / 7
    mask = np.array([True, False, True, True, False])
    fresh = whitened.init(p, np.float32)
    b = tsqr.augmented(z, np.zeros(p, np.float32), mask)
    young = whitened._grown(fresh, b, mask, whitened.row_sums(b))._replace(count=wide.of_int32(3))
    rows = np.zeros((2 * n, n), np.float32)
    rows[:3] = np.c_[np.ones(3), z[mask]]
    np.testing.assert_array_equal(whitened._young_rows(young), rows)
    both = whitened._grown(young, rows, np.ones(2 * n, bool), whitened.row_sums(rows))  # a merge's: they fit
    np.testing.assert_array_equal(whitened._young_rows(both), np.r_[rows[:3], rows[:5]])
    # the host's factor of a young accumulator: the mean of its rows and their centred co-moments
    factor, kept = whitened.factor(young), f64(z[mask]) - f64(z[mask]).mean(axis=0)
    assert rel_err(factor.mean, f64(z[mask]).mean(axis=0)) < 1e-12
    assert rel_err(factor.centred.T @ factor.centred, kept.T @ kept) < 1e-12
    for program in (jax.make_jaxpr(whitened.add)(fresh, z, mask), jax.make_jaxpr(whitened.merge)(fresh, fresh)):
        assert "= qr[" not in str(program)
