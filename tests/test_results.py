"""Results as pandas users expect them: to_pandas() of every per-column result against pandas' own
answers, names kept for (DataFrame, Series), a Series as one column, TopK's integers as integers."""

import numpy as np
import pandas as pd
import pytest
import scipy.stats

import sharded_scan as ss

KW = {"mesh": "data:2", "microbatch": 16, "steps_per_call": 2}


@pytest.fixture(scope="module")
def frame():
    r = np.random.default_rng(0)
    return pd.DataFrame({"age": r.integers(18, 90, 500), "income": r.lognormal(10, 1, 500),
                         "score": r.normal(size=500)}).astype(np.float32)


def reference(frame):
    return frame.astype(np.float64)


def test_moments_sum_and_covariance_frames_are_pandas(frame):
    want = reference(frame)
    moments = ss.run(ss.Moments(ddof=1), frame, **KW).to_pandas()
    expected = want.agg(["count", "mean", "var", "min", "max"]).T
    assert moments.index.tolist() == ["age", "income", "score"] and moments["count"].dtype == np.int64
    pd.testing.assert_frame_equal(moments[expected.columns], expected, check_dtype=False, rtol=1e-5)
    more = pd.DataFrame({"skewness": scipy.stats.skew(want), "kurtosis": scipy.stats.kurtosis(want),
                         "nan_count": 0, "zeros": (want == 0).sum(), "norm_l1": want.abs().sum(),
                         "norm_l2": np.sqrt((want**2).sum())}, index=want.columns)
    pd.testing.assert_frame_equal(moments[more.columns], more, check_dtype=False, rtol=1e-4)
    summed = ss.run(ss.Sum(), frame, **KW).to_pandas()
    np.testing.assert_allclose(summed["sum"], want.sum(), rtol=1e-6)
    assert (summed["count"] == 500).all()
    cov = ss.run(ss.Covariance(), frame, **KW).to_pandas()
    assert cov.index.tolist() == cov.columns.tolist() == want.columns.tolist()
    scale = np.outer(want.std(), want.std())  # float32 rows: each entry to float32 rounding of its scale
    assert (np.abs(cov.to_numpy() - want.cov().to_numpy()) <= 1e-5 * scale).all()


def test_quantiles_distinct_and_histogram_frames(frame):
    want = reference(frame)
    qs = [0.1, 0.5, 0.9]
    got = ss.run(ss.Quantiles(qs=qs), frame, **KW).to_pandas()
    pd.testing.assert_frame_equal(got, want.quantile(qs).T, rtol=1e-12)
    distinct = ss.run(ss.DistinctCount(), frame["age"], **KW)  # a Series: one column, named
    assert distinct.columns.tolist() == ["age"]
    table = distinct.to_pandas()
    assert table.index.tolist() == ["age"] and table.loc["age", "count"] == want["age"].nunique()
    assert table.loc["age", "exact"]
    hist = ss.run(ss.Histogram(4, (0.0, 100.0)), frame[["age", "score"]], **KW).to_pandas()
    assert hist.index.names == [None, "bin"] and len(hist) == 8
    counts, edges = np.histogram(want["age"], 4, (0, 100))
    np.testing.assert_array_equal(hist.loc["age", "count"], counts)
    np.testing.assert_array_equal(hist.loc["age", "left"], edges[:-1])
    np.testing.assert_array_equal(hist.loc["age", "right"], edges[1:])


def test_topk_of_integers_stays_integer_and_its_frame_is_value_counts():
    r = np.random.default_rng(1)
    ids = r.choice(np.array([3, 17, 17, 17, 42, 42, 100_000_007], np.int32), 300)
    few = np.tile(np.array([5, 5, 9], np.int32), 22)  # more than one step's rows: the step compiled for ids
    got = ss.run(ss.TopK(k=4), ids, **KW)
    assert got.values.dtype == np.int64 and got.certain
    table = got.to_pandas()
    want = pd.Series(ids).value_counts()
    assert table["values"].tolist() == want.index.tolist() and table["counts"].tolist() == want.tolist()
    assert table["values"].dtype == np.int64
    short = ss.run(ss.TopK(k=4), few, **KW)  # two values: empty slots count 0
    np.testing.assert_array_equal(short.values, [5, 9, 0, 0])
    np.testing.assert_array_equal(short.counts, [44, 22, 0, 0])
    assert len(short.to_pandas()) == 2


def test_names_are_kept_for_a_frame_and_a_series(frame):  # a Series as one column: the DistinctCount above
    y = (2 * frame["age"] - frame["score"] + 1).rename("target")
    fit = ss.run(ss.LinearRegression(solver="comoments"), (frame, y), **KW)  # names are the result's: the cheap solver
    assert fit.columns.tolist() == ["age", "income", "score"]
    table = fit.to_pandas()
    np.testing.assert_allclose(table.loc[["age", "score"], "coef"], [2, -1], rtol=1e-3)
    assert table["intercept"].iloc[0] == pytest.approx(1, abs=1e-2)
    pca = ss.run(ss.PCA(2, solver="comoments"), frame, **KW).to_pandas()
    assert pca.index.tolist() == ["age", "income", "score"] and pca.columns.tolist() == ["PC1", "PC2", "mean"]
