"""Weighted LinearRegression and PCA against scikit-learn's sample_weight, statsmodels' WLS and
np.cov(aweights=), on every solver; a zero weight omits its row (WLS on the rows of positive weight)."""

import jax
import numpy as np
import pytest

import sharded_scan as ss

RUN = {"microbatch": 64, "steps_per_call": 2}  # one layout for every case: programs shared


def data(n=1001, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)) * [1, 10, 0.1] + 100  # a large mean, unequal scales
    y = x @ [1.0, -2.0, 3.0] + rng.normal(size=n)
    w = rng.random(n) * 3
    w[::7] = 0
    return w, x, y


def wls(x, y, w, fit_intercept=True):
    sm = pytest.importorskip("statsmodels.api")
    keep = w > 0  # statsmodels counts zero-weight rows in nobs; here they are omitted rows
    design = sm.add_constant(x[keep]) if fit_intercept else x[keep]
    return sm.WLS(y[keep], design, weights=w[keep]).fit()


def assert_is_wls(got, fit, fit_intercept, rtol):
    bse = fit.bse[1:] if fit_intercept else fit.bse
    np.testing.assert_allclose(got.coef, fit.params[1:] if fit_intercept else fit.params, rtol=rtol)
    np.testing.assert_allclose(got.r2, fit.rsquared, rtol=rtol)
    np.testing.assert_allclose(got.residual_std, np.sqrt(fit.scale), rtol=rtol)
    np.testing.assert_allclose(got.coef_stderr, bse, rtol=rtol)
    if fit_intercept:
        np.testing.assert_allclose([got.intercept, got.intercept_stderr], [fit.params[0], fit.bse[0]], rtol=rtol)


# Each solver on one mesh: whitened, the dearest to compile, on one device (no merge program; its merges of 8
# devices' partials: test_regression.py, and in float64 test_certified.py); the weighted merges on tsqr's 8 devices
# and comoments' 3. The weights scale rows in the add: a merge sees states as unweighted ones.
SOLVER_MESHES = [("whitened", "data:1"), ("tsqr", "data:8"), ("comoments", "data:3")]


@pytest.mark.parametrize("solver, mesh", SOLVER_MESHES)
def test_weighted_regression_and_pca_are_sklearn_wls_and_np_cov_aweights(solver, mesh):
    linear_model = pytest.importorskip("sklearn.linear_model")
    w, x, y = data()
    with jax.enable_x64(True):
        got = ss.run(ss.Weighted(ss.LinearRegression(solver=solver)), (w, (x, y)), mesh=mesh, **RUN)
        # PCA runs the same weighted fold; whitened's (4 s to compile) is left to LinearRegression.
        pca = None if solver == "whitened" else ss.run(ss.Weighted(ss.PCA(2, solver=solver)), (w, x), mesh=mesh, **RUN)
    want = linear_model.LinearRegression().fit(x, y, sample_weight=w)
    np.testing.assert_allclose(got.coef, want.coef_, rtol=1e-10)
    np.testing.assert_allclose(got.intercept, want.intercept_, rtol=1e-10)
    assert_is_wls(got, wls(x, y, w), True, rtol=1e-9)
    if pca is None:
        return
    values, vectors = np.linalg.eigh(np.cov(x.T, aweights=w, ddof=1))  # PCA's explained_variance: ddof 1
    np.testing.assert_allclose(pca.explained_variance, values[::-1][:2], rtol=1e-10)
    np.testing.assert_allclose(np.abs(pca.components), np.abs(vectors[:, ::-1][:, :2].T), atol=1e-10)  # up to sign
    np.testing.assert_allclose(pca.mean, np.average(x, axis=0, weights=w), rtol=1e-13)


def test_weighted_ridge_and_no_intercept_are_sklearn_ridge_and_wls():
    linear_model = pytest.importorskip("sklearn.linear_model")
    w, x, y = data(503, seed=1)
    with jax.enable_x64(True):
        # The host solve is the same for every solver: the cheapest to compile.
        ridge = ss.run(ss.Weighted(ss.LinearRegression(l2=30.0, solver="tsqr")), (w, (x, y)), mesh="data:1", **RUN)
        origin = ss.run(ss.Weighted(ss.LinearRegression(fit_intercept=False, solver="tsqr")), (w, (x, y)),
                        mesh="data:1", **RUN)
    want = linear_model.Ridge(alpha=30.0).fit(x, y, sample_weight=w)
    np.testing.assert_allclose(ridge.coef, want.coef_, rtol=1e-9)
    np.testing.assert_allclose(ridge.intercept, want.intercept_, rtol=1e-9)
    assert np.isnan(ridge.coef_stderr).all()
    assert_is_wls(origin, wls(x, y, w, fit_intercept=False), False, rtol=1e-9)


def test_negative_weights_are_one_line_before_compute():
    w, x, y = data(301, seed=2)
    w[5] = -1
    with pytest.raises(ss.UsageError, match="negative or non-finite weights"):
        ss.run(ss.Weighted(ss.LinearRegression(solver="tsqr")), (w, (x, y)), mesh="data:1", **RUN)


@pytest.mark.parametrize("solver, mesh", SOLVER_MESHES)
def test_weighted_fits_over_rows_holding_nan_are_nan(solver, mesh):
    # Issue 42, finding 4, weighted: under nan_policy="propagate" a row of positive weight holding NaN makes every
    # field NaN (rank -1); a row of zero weight is an omitted row, its NaN too. The programs of the test above.
    w, x, y = data()
    x[3, 2], x[7, 0] = np.nan, np.nan  # w[7] == 0: omitted
    assert w[3] > 0 and w[7] == 0
    with jax.enable_x64(True):
        got = ss.run(ss.Weighted(ss.LinearRegression(solver=solver)), (w, (x, y)), mesh=mesh, **RUN)
        pca = None if solver == "whitened" else ss.run(ss.Weighted(ss.PCA(2, solver=solver)), (w, x), mesh=mesh, **RUN)
        x[3, 2] = 1.0  # only the zero-weight row holds NaN now
        kept = ss.run(ss.Weighted(ss.LinearRegression(solver=solver)), (w, (x, y)), mesh=mesh, **RUN)
    for field in ("coef", "intercept", "cond", "r2", "residual_std", "coef_stderr", "intercept_stderr"):
        assert np.isnan(getattr(got, field)).all(), (field, getattr(got, field))
    assert got.rank == -1
    assert pca is None or all(np.isnan(v).all() for v in pca[:5]), pca
    x[7, 0] = 0.0
    assert_is_wls(kept, wls(x, y, w), True, rtol=1e-9)


def nan_weights(tmp_path=None):
    """data(301, seed=2) with a NaN and an inf weight; the weights that omit those rows; and the rows in Parquet."""
    w, x, y = data(301, seed=2)
    w[5], w[9] = np.nan, np.inf
    path = None
    if tmp_path is not None:
        pd = pytest.importorskip("pandas")
        pytest.importorskip("pyarrow")
        path = tmp_path / "rows.parquet"
        pd.DataFrame({"w": w, "a": x[:, 0], "b": x[:, 1], "c": x[:, 2], "y": y}).to_parquet(path)
    return w, x, y, np.where(np.isfinite(w), w, 0.0), path


def test_nan_weights_are_skipped_under_omit_in_memory():
    # Issue 42: in memory a NaN weight was refused under nan_policy="omit", while read from Parquet it was skipped.
    # Both skip its row now, as pandas' skipna would; "propagate" and "raise" still refuse it in one line.
    w, x, y, omitted, _ = nan_weights()
    with jax.enable_x64(True):
        got = ss.run(ss.Weighted(ss.LinearRegression(solver="tsqr")), (w, (x, y)), nan_policy="omit", mesh="data:1",
                     **RUN)
        with pytest.raises(ss.UsageError, match="2 rows have negative or non-finite weights"):
            ss.run(ss.Weighted(ss.LinearRegression(solver="tsqr")), (w, (x, y)), mesh="data:1", **RUN)
    assert_is_wls(got, wls(x, y, omitted), True, rtol=1e-9)


def test_nan_weights_are_skipped_under_omit_from_parquet(tmp_path):
    from sharded_scan.sources import ParquetSource

    w, x, y, omitted, path = nan_weights(tmp_path)
    source = ParquetSource(path, columns=("w", (["a", "b", "c"], "y")))
    with jax.enable_x64(True):  # the program of the test above
        got = ss.run(ss.Weighted(ss.LinearRegression(solver="tsqr")), source, nan_policy="omit", mesh="data:1", **RUN)
        with pytest.raises(ss.UsageError, match="2 rows have negative or non-finite weights"):
            ss.run(ss.Weighted(ss.LinearRegression(solver="tsqr")), source, mesh="data:1", **RUN)
    assert_is_wls(got, wls(x, y, omitted), True, rtol=1e-9)
