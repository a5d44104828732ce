"""Inputs that used to be reduced silently wrong: an iterator with more or fewer rows than it
says, an accumulator that overflows on finite rows, a fit over rows holding NaN."""

import logging
import warnings

import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan.sources import IteratorSource

X = np.ones((5000, 2), np.float32)
KW = {"mesh": "data:2", "microbatch": 64, "steps_per_call": 2}
# The fits' checks (NaN, overflow, no rows) on one device: no merge program to compile, the local steps cheaper
# (LinearRegression's and PCA's are the module's dearest programs). The same checks over merged partials of several
# devices: test_regression's every solver on data:3, the properties' fits on data:8.
FIT = {**KW, "mesh": "data:1"}


def batches(x, size=1000):
    return [x[i : i + size] for i in range(0, len(x), size)]


@pytest.mark.parametrize("num_rows, words", [
    (4900, ["yields 5000 rows, not num_rows=4900", "the last 100 would be dropped", "pass num_rows=5000"]),
    (5100, ["ended at row 5000, before its num_rows=5100"]),
])
def test_an_iterator_with_other_rows_than_it_says_is_one_line(num_rows, words):
    with pytest.raises(ss.UsageError) as err:
        ss.run(ss.Sum(), IteratorSource(batches(X), num_rows), **KW)
    assert "\n" not in str(err.value)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_an_endless_iterator_is_named():
    def endless():
        while True:
            yield X[:100]

    with pytest.raises(ss.UsageError, match="yields more than .* rows, not num_rows=500 .it may be endless"):
        ss.run(ss.Sum(), IteratorSource(endless(), 500), **KW)


def test_an_accumulator_overflowing_on_finite_rows_raises_or_warns(caplog):
    x = np.full((64, 2), 3e37, np.float32)  # finite rows; their Gram is 5.8e76, beyond float32
    overflowed = r"the accumulator overflowed: \d+ of its values are inf or NaN although every row is finite"
    with pytest.raises(ss.UsageError, match=overflowed):
        ss.run(ss.Gram(), x, nan_policy="raise", **KW)
    with caplog.at_level(logging.WARNING, logger="sharded_scan.engine"):
        got = ss.run(ss.Gram(), x, **KW)
    assert np.isinf(got).all() and "accumulator values are inf or NaN" in caplog.text


def test_rows_holding_nan_make_the_fit_nan_not_a_lower_rank_and_zeros():
    # Issue 42, finding 4, with fewer rows: y = X [1, 2, 3] + noise, NaN in 3 rows of column 0 and 3 others of
    # column 1. Under the default nan_policy="propagate" LinearRegression gave coefficients 0, rank 0 and PCA unit
    # axes of variance 0: any statistic computed from a row holding NaN is NaN (every solver, weighted too:
    # test_regression.py, test_weighted_linalg.py).
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 3))
    y = (x @ [1.0, 2.0, 3.0] + 0.1 * rng.normal(size=512)).astype(np.float32)
    rows = rng.permutation(512)
    x[rows[:3], 0], x[rows[3:6], 1] = np.nan, np.nan
    x = x.astype(np.float32)
    fit = ss.run(ss.LinearRegression(), (x, y), **FIT)
    for field in ("coef", "intercept", "cond", "r2", "residual_std", "coef_stderr", "intercept_stderr"):
        assert np.isnan(getattr(fit, field)).all(), (field, getattr(fit, field))
    assert fit.rank == -1 and fit.coef.shape == (3,)
    pca = ss.run(ss.PCA(2), x, **FIT)
    for field in ("components", "explained_variance", "explained_variance_ratio", "mean", "singular_values"):
        assert np.isnan(getattr(pca, field)).all(), (field, getattr(pca, field))
    assert pca.components.shape == (2, 3)
    # nan_policy="omit" fits the 506 rows without NaN, as before.
    keep = np.isfinite(x).all(axis=1)
    fit = ss.run(ss.LinearRegression(), (x, y), nan_policy="omit", **FIT)
    want = np.linalg.lstsq(np.column_stack([x[keep], np.ones(keep.sum())]).astype(np.float64), y[keep], rcond=None)[0]
    np.testing.assert_allclose(fit.coef, want[:3], rtol=1e-4)
    assert fit.rank == 3 and fit.r2 > 0.99


def test_a_solve_on_finite_rows_that_overflowed_says_so():
    rng = np.random.default_rng(0)
    x = np.clip(rng.normal(size=(256, 3)) * 1e38, -3e38, 3e38).astype(np.float32)  # every row finite
    assert np.isfinite(x).all()
    overflowed = r"the rows overflowed the float32 accumulator \(it holds at most 3.4e\+38\); scale the data down"
    folded_finite = r"every row it folded is finite: " + overflowed
    with warnings.catch_warnings(), pytest.raises(ss.UsageError, match=folded_finite) as err:
        warnings.simplefilter("error")  # the one line only: numpy's warning of the inf factor's arithmetic was shown
        ss.run(ss.LinearRegression(), (x, x[:, 0].copy()), nan_policy="omit", **FIT)
    assert "rows hold NaN" not in str(err.value)
    # Under "propagate" NaN/inf rows would reach the accumulator too: both causes, and how to tell.
    with pytest.raises(ss.UsageError, match=r"rows hold NaN/inf \(nan_policy='omit' skips them\), or finite rows "
                                            r"overflowed the float32 accumulator .*nan_policy='raise' tells which"):
        ss.run(ss.LinearRegression(), (x, x[:, 0].copy()), **FIT)


def test_statistics_of_no_rows_are_nan_with_a_warning_as_numpys():
    x = np.random.default_rng(0).normal(size=(300, 4)).astype(np.float32)  # test_statistics' omit programs
    x[:, 1] = np.nan  # every row holds a NaN: nan_policy="omit_rows" skips them all
    with pytest.warns(RuntimeWarning):
        empty_mean = np.mean(np.zeros((0, 4)), axis=0)
    for combiner in (ss.Moments(), ss.Covariance()):
        with pytest.warns(RuntimeWarning, match="no rows"):
            got = ss.run(combiner, x, nan_policy="omit_rows", mesh="data:2", microbatch=8, steps_per_call=2)
        assert int(got.count) == 0
        np.testing.assert_array_equal(got.mean, empty_mean)  # NaN, never 0
        for field in ("var", "min", "max", "cov"):
            if hasattr(got, field):
                assert np.isnan(getattr(got, field)).all(), field


@pytest.mark.parametrize("combiner, data", [
    (ss.LinearRegression(), "xy"), (ss.LinearRegression(solver="tsqr"), "xy"), (ss.PCA(2), "x"),
])
def test_a_fit_on_no_rows_is_one_line(combiner, data):
    x = np.random.default_rng(1).normal(size=(200, 3)).astype(np.float32)  # and FIT: the programs above
    x[:, 0] = np.inf
    rows = (x, x[:, 1].copy()) if data == "xy" else x
    with pytest.raises(ss.UsageError) as err:
        ss.run(combiner, rows, nan_policy="omit", **FIT)
    message = str(err.value)
    assert "\n" not in message and "no rows to fit" in message and type(combiner).__name__ in message
