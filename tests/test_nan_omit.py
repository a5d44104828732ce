"""nan_policy="omit" skips a NaN or inf where it stands, as pandas' skipna (issue 43, item 1).

Per column for per-column statistics, per pair of columns for Covariance and Correlation (pandas'
pairwise-complete df.cov()/df.corr()), whole rows for the statistics of whole rows; "omit_rows" keeps
the row-wise skip. One frame: NaNs in different rows of different columns, an inf, an all-NaN column,
a column of one finite value, a constant one; 203 rows (ragged steps).
"""

import dataclasses
import warnings

import jax
import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan.admission import memory_estimate
from sharded_scan.program import build_program
from sharded_scan.sources import as_source
from tests.helpers import control_flow

pd = pytest.importorskip("pandas")

N, K = 203, 3
KW = dict(microbatch=8, steps_per_call=2)


def frame():
    rng = np.random.default_rng(43)
    x = rng.normal(size=(N, 6)) * [1, 10, 0.1, 1, 1, 1] + [5, -3, 1e3, 0, 0, 0]
    x[:, 1] += 3 * x[:, 0]  # correlated
    x[rng.random((N, 6)) < 0.1] = np.nan  # NaNs in different rows of different columns
    x[7, 1], x[11, 0] = np.inf, -np.inf  # skipped where they stand, as pandas' cov/corr do
    x[:, 3] = np.nan  # all NaN
    x[:, 4] = np.nan
    x[[5, 9], 4] = 2.0, np.inf  # one finite value: NaN where a pair needs 2
    x[:, 5] = 2.5  # constant (and a NaN)
    x[3, 5] = np.nan
    keys = rng.integers(0, K, N).astype(np.int32)
    return x, keys, pd.DataFrame(np.where(np.isfinite(x), x, np.nan))  # what pandas skips


def run(combiner, data, **kw):
    with warnings.catch_warnings():  # the all-NaN column's "no rows", the constant column's correlation
        warnings.simplefilter("ignore", RuntimeWarning)
        return ss.run(combiner, data, nan_policy=kw.pop("nan_policy", "omit"), **KW, **kw)


def assert_matrix(got, want, scale):
    """``got`` equals pandas' ``want`` where it is a number (to 1e-12 of the entry's scale) and is NaN where it is."""
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    live = ~np.isnan(want)
    np.testing.assert_array_less(np.abs(got - want)[live], (1e-12 * scale)[live] + 1e-300)


def test_omit_skips_each_value_where_it_stands_like_pandas():
    # Eight devices fold 16 to 32 rows each (NaNs in different rows of different columns), then merge: the fold a
    # one-device run makes alone, and the merge of partials.
    x, keys, df = frame()
    mesh = "data:8"
    finite = np.isfinite(x)
    c = run(ss.Correlation(), x, mesh=mesh)
    np.testing.assert_array_equal(c.pair_count, finite.T.astype(int) @ finite)
    np.testing.assert_array_equal(c.count, df.count())
    np.testing.assert_allclose(c.mean, df.mean(), rtol=1e-13)
    assert_matrix(c.corr, df.corr().to_numpy(), np.ones((6, 6)))
    # Moments alone under "omit" (count, nan_count, mean, var, min, max of each column's finite values, against exact
    # rationals, all-NaN and constant columns among them): tests/test_properties.py; here its keyed fold, as pandas'.
    g = run(ss.GroupBy(ss.Moments(ddof=1), K), (keys, x), mesh=mesh).result
    grouped = df.groupby(keys)
    np.testing.assert_array_equal(g.count, grouped.count())  # each column its own count
    np.testing.assert_array_equal(g.nan_count, [np.isnan(x[keys == k]).sum(0) for k in range(K)])
    np.testing.assert_allclose(g.mean, grouped.mean(), rtol=1e-12)
    np.testing.assert_allclose(g.var, grouped.var(), rtol=1e-11)  # NaN where a key holds one value (ddof=1)
    np.testing.assert_array_equal(g.min, grouped.min())
    np.testing.assert_array_equal(g.max, grouped.max())
    assert (g.var[:, 5] == 0).all()  # the constant column
    d = run(ss.Describe(k=256), x, mesh=mesh)  # every row in its sketch, as the default's: its std and counts
    np.testing.assert_array_equal(d.count, df.count())
    np.testing.assert_array_equal(d.nan_count, (~finite).sum(0))  # the values skipped
    np.testing.assert_allclose(d.std, df.std(), rtol=1e-12)


# Moments under "omit" folds with a mask per column (mb, d) and a count per column in its state (FiniteMoments).
# Main ran EachColumn(Moments): one-column states under jax.vmap, whose lax.conds became selects, so the batch mean
# of _without_overflow and the NaN count ran every micro-batch (2.7x propagate's CPU, bench/README.md).
@pytest.mark.parametrize("mesh, n", [("data:1", 61), ("data:8", N)])
def test_moments_omit_is_pandas_skipna_per_column_with_the_control_flow_of_propagate(mesh, n):
    from sharded_scan.combiners.wrappers.policies import apply_policies

    f = jax.ShapeDtypeStruct
    x, w, key = f((4,), np.float64), f((), np.float64), f((), np.int32)
    for combiner, spec in ((ss.Moments(), x), (ss.Moments(fields="mean,var"), x), (ss.Weighted(ss.Moments()), (w, x)),
                           (ss.GroupBy(ss.Moments(fields="min,max,skewness"), 3), (key, x)),
                           (ss.GroupBy(ss.Weighted(ss.Moments()), 3), (key, (w, x)))):
        batch = jax.tree.map(lambda s: f((256, *s.shape), s.dtype), spec)  # traced only
        flows = [control_flow(jax.make_jaxpr(c.add)(jax.eval_shape(c.init, spec), batch, f((256,), bool)).jaxpr)
                 for c in (apply_policies(combiner, nan_policy=p) for p in ("propagate", "omit"))]
        assert flows[1] == flows[0], (combiner, flows)
    # Each column's finite values against pandas' skipna (an inf as a NaN): NaNs in different rows of different
    # columns, an inf, an all-NaN column, one of one finite value, a constant one; ragged steps (8-row micro-batches).
    x, _, df = frame()
    x, df = x[:n], df[:n]
    m = run(ss.Moments(ddof=1), x, mesh=mesh)
    count = df.count().to_numpy()
    assert m.count.shape == (6,) and m.count.dtype == np.int64 and m.mean.shape == (6,)
    np.testing.assert_array_equal(m.count, count)
    np.testing.assert_array_equal(m.nan_count, np.isnan(x).sum(0))  # the NaNs skipped, not the infs
    np.testing.assert_allclose(m.mean, df.mean(), rtol=1e-13)
    np.testing.assert_allclose(m.var, df.var(), rtol=1e-12)
    np.testing.assert_allclose(np.sqrt(m.var), df.std(), rtol=1e-12)
    np.testing.assert_array_equal(m.min, df.min())
    np.testing.assert_array_equal(m.max, df.max())
    np.testing.assert_array_equal(m.zeros, (df == 0).sum())
    np.testing.assert_allclose(m.norm_l1, df.abs().sum(), rtol=1e-13)
    # pandas' skew and kurt are the adjusted G1, G2 of the biased g1, g2 (scipy's) MomentsResult holds
    k = count.astype(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        skew = m.skewness * np.sqrt(k * (k - 1)) / (k - 2)
        kurt = (k - 1) / ((k - 2) * (k - 3)) * ((k + 1) * m.kurtosis + 6)
    assert m.var[5] == 0 and np.isnan(m.skewness[3:]).all()  # constant, one value, none: NaN, as pandas'
    np.testing.assert_allclose(skew, df.skew(), rtol=1e-10)
    np.testing.assert_allclose(kurt, df.kurt(), rtol=1e-10)


def test_covariance_is_pairwise_complete_split_over_model_and_logical_shards():
    x, _, df = frame()
    c = run(ss.Covariance(), x, mesh="data:2,model:4", logical_shards=8)
    want = df.cov().to_numpy()  # ddof=1; NaN where a pair has fewer than 2 rows
    diagonal = np.abs(np.diagonal(want))
    assert_matrix(c.cov, want, np.sqrt(np.outer(diagonal, diagonal)))
    assert np.isnan(c.cov[4, 4]) and c.pair_count[4, 4] == 1 and c.cov[5, 5] == 0
    keys = np.arange(N, dtype=np.int32) % 2
    g = run(ss.GroupBy(ss.Covariance(), 2), (keys, x[:, :3]), mesh="data:8").result  # per key, pairwise too
    want = df.iloc[:, :3].groupby(keys).cov().to_numpy().reshape(2, 3, 3)
    assert_matrix(g.cov, want, np.sqrt(np.abs(np.einsum("kii,kjj->kij", want, want))))
    finite = np.isfinite(x[:, :3]).astype(int)
    np.testing.assert_array_equal(g.pair_count, [finite[keys == k].T @ finite[keys == k] for k in (0, 1)])
    d = 64  # the memory estimate counts the per-pair state: 5 float64 (d, d) matrices and exact counts (4 int32)
    held = [memory_estimate(build_program(ss.Covariance(), as_source(np.zeros((16, d))), ss.RunOptions(
        nan_policy=policy, mesh="data:8")), temporaries=False)["accumulator"] for policy in ("propagate", "omit")]
    assert held[0] < 3 * d * d * 8 and held[1] >= d * d * (5 * 8 + 4 * 4), held


def test_omit_rows_skips_every_row_holding_one():
    # (LinearRegression, PCA and Gram skip whole rows under "omit" too: tests/test_no_silent_wrong.py, the properties)
    x, _, _ = frame()
    x = np.delete(x, [3, 4], axis=1)  # not every row skipped
    rows = np.isfinite(x).all(1)
    m = run(ss.Moments(), x, mesh="data:8", nan_policy="omit_rows")
    assert int(m.count) == rows.sum()
    np.testing.assert_allclose(m.mean, x[rows].mean(0), rtol=1e-13)


def test_rows_checked_before_compute_are_those_omit_folds():
    from sharded_scan.combiners.wrappers.policies import apply_policies

    x = np.ones((6, 2))
    x[1, 0] = np.nan
    w, keys = np.ones(6), np.zeros(6, np.int32)
    w[2] = np.nan  # a NaN weight's row: skipped, not refused
    apply_policies(ss.GroupBy(ss.Weighted(ss.Moments()), 2), nan_policy="omit").check_rows((keys, (w, x)))
    keys[1] = 5  # a key out of range in a row holding NaN: its other value is folded, so it is one line
    with pytest.raises(ss.UsageError, match="keys outside"):
        apply_policies(ss.GroupBy(ss.Moments(), 2), nan_policy="omit").check_rows((keys, x))


QS = [0, 0.1, 0.5, 0.9, 1]


def weights():
    w = np.random.default_rng(7).random(N) * 3
    w[[2, 40]] = 0.0, np.nan  # a zero weight omits its row; a NaN one is skipped under omit
    return w


def weighted_quantiles(x, w):
    """Per column, np.quantile(weights=) of its finite values of positive weight (NaN for none), (d, len(QS))."""
    out = np.full((x.shape[1], len(QS)), np.nan)
    for j in range(x.shape[1]):
        m = np.isfinite(x[:, j]) & (np.nan_to_num(w) > 0)
        if m.any():
            out[j] = np.quantile(x[m, j], QS, weights=w[m], method="inverted_cdf")
    return out


def test_quantiles_skip_each_value_where_it_stands_like_nanquantile():
    x, keys, df = frame()
    mesh = "data:8"  # each device's fold of 16 to 32 rows and the merge
    # Quantiles alone under "omit": test_quantiles.py (against np.nanquantile, on one device) and
    # tests/test_properties_sketches.py (eight devices, at the float extremes); here its keyed and weighted folds.
    # k=128 holds every key's rows (at most 72 of 203), as the default 8192 does: nothing compacted in the folds or
    # the merges, so exact; the default's levels cost each step and each merge a pass over them whatever the rows
    g = run(ss.GroupBy(ss.Quantiles(qs=QS, k=128), K), (keys, x), mesh=mesh).result
    want = df.groupby(keys).quantile(QS).to_numpy().reshape(K, len(QS), -1).transpose(0, 2, 1)
    np.testing.assert_allclose(g.quantiles, want, rtol=1e-15)
    np.testing.assert_array_equal(g.count, df.groupby(keys).count())
    w = weights()  # a row's weight counts for a column only where its value there is finite
    g = run(ss.GroupBy(ss.Weighted(ss.Quantiles(qs=QS, k=128, method="inverted_cdf")), K), (keys, (w, x)),
            mesh=mesh).result
    np.testing.assert_array_equal(g.quantiles, [weighted_quantiles(x[keys == k], w[keys == k]) for k in range(K)])
    positive = np.isfinite(x) & (np.nan_to_num(w) > 0)[:, None]
    np.testing.assert_array_equal(g.count, [positive[keys == k].sum(0) for k in range(K)])


def test_exact_quantiles_skip_each_value_split_over_model_and_refuse_an_old_omit_checkpoint():
    from sharded_scan.combiners.wrappers.policies import apply_policies

    x, _, df = frame()
    w = weights()
    for combiner, data, want in (
            (ss.Quantiles(qs=QS, k=16, exact=True, bits=6), x, df.quantile(QS).to_numpy().T),
            (ss.Weighted(ss.Quantiles(qs=QS, k=16, exact=True, bits=6, method="inverted_cdf")), (w, x),
             weighted_quantiles(x, w))):
        # 25 rows a shard: compacted, so refined in passes (of 65 boundaries a rank, bits=6: the default's 1025
        # cost each refining step 16 times the counting)
        got = run(combiner, data, mesh="data:2,model:4")
        assert got.passes > 1
        np.testing.assert_array_equal(got.quantiles, want)
        sketch = dataclasses.replace(combiner.inner if isinstance(combiner, ss.Weighted) else combiner, exact=False)
        # a checkpoint of an omit job that skipped whole rows is another job's: its fingerprint differs
        for job in (sketch, ss.GroupBy(sketch, K), combiner):
            old = {**job.fingerprint(), "nan_policy": "omit"}
            assert apply_policies(job, nan_policy="omit").fingerprint() != old


def pairwise_weighted(x, w, ddof=1):
    """Per pair of columns, over the rows where both are finite and the weight positive: np.cov(aweights=)
    (NaN for ddof rows or fewer), the correlation, the rows."""
    d = x.shape[1]
    cov, corr, rows = np.full((d, d), np.nan), np.full((d, d), np.nan), np.zeros((d, d), int)
    for i in range(d):
        for j in range(d):
            m = np.isfinite(x[:, i]) & np.isfinite(x[:, j]) & (np.nan_to_num(w) > 0)
            rows[i, j] = m.sum()
            if m.sum() > ddof:
                pair = np.cov(x[m][:, [i, j]], rowvar=False, aweights=w[m], ddof=ddof)
                cov[i, j] = pair[0, 1]
                if np.ptp(x[m, i]) > 0 and np.ptp(x[m, j]) > 0:  # neither constant (numpy: a variance ~1e-30)
                    corr[i, j] = np.clip(pair[0, 1] / np.sqrt(pair[0, 0] * pair[1, 1]), -1, 1)
    return cov, corr, rows


def test_weighted_covariance_and_correlation_are_pairwise_complete():
    x, _, _ = frame()
    w = weights()
    cov, corr, rows = pairwise_weighted(x, w)
    c = run(ss.Weighted(ss.Covariance()), (w, x), mesh="data:2,model:4")
    size = np.where(np.isfinite(x), np.abs(x), 0).max(0)  # the constant column's
    assert_matrix(c.cov, cov, np.outer(size, size))  # cov is exactly 0, numpy's within rounding of its mean
    np.testing.assert_array_equal(c.pair_count, rows)  # rows of positive weight where both are finite
    np.testing.assert_array_equal(c.count, np.diagonal(rows))
    live = np.diagonal(rows) > 0
    want = [np.average(x[:, j][m], weights=w[m]) for j in np.flatnonzero(live)
            for m in [np.isfinite(x[:, j]) & (np.nan_to_num(w) > 0)]]
    np.testing.assert_allclose(c.mean[live], want, rtol=1e-13)
    r = run(ss.Weighted(ss.Correlation()), (w, x), mesh="data:8")
    assert_matrix(r.corr, corr, np.ones(corr.shape))
    np.testing.assert_array_equal(r.pair_count, rows)
