"""Correlation, and the keyed (GroupBy) and weighted (Weighted) forms of Moments, Covariance and
Correlation, against numpy, scipy and pandas in float64."""

import warnings

import jax
import numpy as np
import pandas as pd
import pytest
import scipy.stats

import sharded_scan as ss
from tests.helpers import f64, rel_err

RUN = {"microbatch": 8, "steps_per_call": 2}  # test_statistics' programs


def rows(n, d=4, seed=0, offset=1e4):
    rng = np.random.default_rng(seed)
    return (rng.gamma(2.0, size=(n, d)) @ rng.normal(size=(d, d)) + offset).astype(np.float32)


def corrcoef_of_cov(cov):
    scale = np.sqrt(np.diag(cov))
    return cov / np.outer(scale, scale)


def test_correlation_is_numpys_corrcoef_far_from_zero():
    x = rows(1009)  # ragged over 8 devices
    got = ss.run(ss.Correlation(), x, mesh="data:8", **RUN)
    want = np.corrcoef(f64(x), rowvar=False)
    assert got.count == 1009 and rel_err(got.mean, f64(x).mean(0)) < 1e-6
    np.testing.assert_allclose(got.corr, want, rtol=0, atol=1e-6)
    assert (np.diag(got.corr) == 1).all()
    table = got.to_pandas()
    pd.testing.assert_frame_equal(table, pd.DataFrame(f64(x)).corr(), atol=1e-6, rtol=0)


def test_a_constant_column_has_nan_correlations_and_one_warning():
    x = rows(203)
    x[:, 1] = 7.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = ss.run(ss.Correlation(), x, mesh="data:8", **RUN)
    assert len(caught) == 1 and "[1]" in str(caught[0].message) and caught[0].category is RuntimeWarning
    with np.errstate(invalid="ignore", divide="ignore"):
        want = np.corrcoef(f64(x), rowvar=False)
    np.testing.assert_array_equal(np.isnan(got.corr), np.isnan(want))
    np.testing.assert_allclose(np.nan_to_num(got.corr), np.nan_to_num(want), rtol=0, atol=1e-6)


def weights_for(n, seed=1):
    w = np.random.default_rng(seed).integers(0, 4, size=n).astype(np.float32)  # zeros: omitted rows
    return w


def test_weighted_forms_are_numpys_and_scipys_of_repeated_rows():
    mesh = "data:8"
    x, w = rows(1009, seed=2), weights_for(1009)
    x64, repeated = f64(x), np.repeat(f64(x), w.astype(int), axis=0)
    moments = ss.run(ss.Weighted(ss.Moments()), (w, x), mesh=mesh, **RUN)
    assert moments.count == (w > 0).sum()
    assert rel_err(moments.mean, np.average(x64, axis=0, weights=w)) < 1e-6
    assert rel_err(moments.var, np.average((x64 - moments.mean) ** 2, axis=0, weights=w)) < 1e-5
    np.testing.assert_allclose(moments.skewness, scipy.stats.skew(repeated), rtol=0, atol=1e-5)
    np.testing.assert_allclose(moments.kurtosis, scipy.stats.kurtosis(repeated), rtol=0, atol=1e-5)
    np.testing.assert_array_equal(moments.min, x[w > 0].min(0))
    assert rel_err(moments.norm_l1, (w[:, None] * np.abs(x64)).sum(0)) < 1e-6
    assert rel_err(moments.norm_l2, np.sqrt((w[:, None] * x64**2).sum(0))) < 1e-6
    cov = ss.run(ss.Weighted(ss.Covariance()), (w, x), mesh=mesh, **RUN)
    assert rel_err(cov.cov, np.cov(x64, rowvar=False, aweights=w)) < 1e-5
    corr = ss.run(ss.Weighted(ss.Correlation()), (w, x), mesh=mesh, **RUN)
    np.testing.assert_allclose(corr.corr, corrcoef_of_cov(np.cov(x64, rowvar=False, aweights=w)), rtol=0, atol=1e-6)


def test_weighted_moments_are_scikit_learns_standard_scaler():
    preprocessing = pytest.importorskip("sklearn.preprocessing")
    x, w = rows(1009, seed=3), weights_for(1009, seed=4) * 0.37  # not integers
    got = ss.run(ss.Weighted(ss.Moments()), (w, x), mesh="data:8", **RUN)
    scaler = preprocessing.StandardScaler().fit(f64(x), sample_weight=w)
    assert rel_err(got.mean, scaler.mean_) < 1e-6 and rel_err(got.var, scaler.var_) < 1e-5


def test_keyed_forms_are_pandas_groupby():
    mesh = "data:8"
    x = rows(1009, seed=5)
    keys = np.random.default_rng(6).zipf(1.5, size=1009) % 7
    groups = pd.DataFrame(f64(x)).groupby(keys)
    got = ss.run(ss.GroupBy(ss.Moments(), 7), (keys, x), mesh=mesh, **RUN)
    assert rel_err(got.mean, groups.mean().to_numpy()) < 1e-6
    assert rel_err(got.var, groups.var(ddof=0).to_numpy()) < 1e-5
    np.testing.assert_array_equal(got.min, groups.min().to_numpy())
    np.testing.assert_array_equal(got.max, groups.max().to_numpy())
    for k in range(7):
        part = f64(x)[keys == k]
        np.testing.assert_allclose(got.skewness[k], scipy.stats.skew(part), rtol=0, atol=1e-5)
        np.testing.assert_allclose(got.kurtosis[k], scipy.stats.kurtosis(part), rtol=0, atol=1e-5)
    cov = ss.run(ss.GroupBy(ss.Covariance(), 7), (keys, x), mesh=mesh, **RUN)
    for k in range(7):
        assert rel_err(cov.cov[k], groups.get_group(k).cov().to_numpy()) < 1e-5


def test_keyed_weighted_moments_are_pandas_per_group():
    x, w = rows(1009, seed=7), weights_for(1009, seed=8)
    keys = np.random.default_rng(9).zipf(1.5, size=1009) % 7
    got = ss.run(ss.GroupBy(ss.Weighted(ss.Moments()), 7), (keys, (w, x)), mesh="data:8", **RUN)
    frame = pd.DataFrame(f64(x) * w[:, None]).assign(w=w)
    sums = frame.groupby(keys).sum()
    mean = sums.iloc[:, :4].to_numpy() / sums["w"].to_numpy()[:, None]
    assert rel_err(got.mean, mean) < 1e-6
    for k in range(7):
        part, weight = f64(x)[keys == k], w[keys == k]
        assert got.count[k] == (weight > 0).sum() and got.rows[k] == len(weight)
        assert rel_err(got.var[k], np.average((part - mean[k]) ** 2, axis=0, weights=weight)) < 1e-5


def test_a_keyed_fold_without_rows_of_a_key_leaves_it_as_it_was():
    combiner, spec = ss.Moments(), jax.ShapeDtypeStruct((4,), np.float32)
    acc = jax.tree.map(lambda a: np.stack([a, a, a]), combiner.init(spec))
    x = rows(8, seed=10)
    # Jitted, as the engine runs it: one program for both folds (op by op, each of its ops compiled on its own).
    add_keyed = jax.jit(combiner.add_keyed, static_argnums=4)
    once = add_keyed(acc, x, np.ones(8, bool), np.zeros(8, np.int32), 3)
    twice = add_keyed(once, np.full((8, 4), np.nan, np.float32), np.zeros(8, bool), np.ones(8, np.int32), 3)
    for got, want in zip(jax.tree.leaves(twice), jax.tree.leaves(once), strict=True):
        np.testing.assert_array_equal(got, want)
    whole = combiner.finalize(jax.device_get(jax.tree.map(lambda a: a[0], once)))
    assert rel_err(whole.mean, f64(x).mean(0)) < 1e-6
