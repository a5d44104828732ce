"""Covariance, Moments and PCA against numpy/scikit-learn float64, stable far from zero."""

import functools

import jax
import ml_dtypes
import numpy as np
import pytest
import scipy.stats

import sharded_scan as ss
from tests.helpers import CrashError, assert_usage_error, crash_at, f64, rel_err

# The module's two meshes: 8 devices (ragged shards, merges of 8 partials, most shards empty for 1 and 3 rows) and
# a model axis (the co-moments split by columns). Moments and Covariance on 1, 2 and 3 devices: test_dtypes,
# test_tabular, test_correlation_and_forms, test_float_extremes; the engine's every device count: test_engine.
MESHES = ["data:8", "data:4,model:2"]
KW = {"microbatch": 8, "steps_per_call": 2}  # every run of CASES' layout shares its compiled programs


def rows(n, d=4, dtype=np.float32, seed=0, offset=0.0):
    x = np.random.default_rng(seed).normal(size=(n, d)) * np.arange(1, d + 1) + offset
    return x.astype(dtype)


def check_covariance(got, x, ddof, tol=1e-5):
    x = f64(x)
    assert got.count == len(x)
    assert rel_err(got.mean, x.mean(0)) < 1e-6
    assert rel_err(got.cov, np.cov(x, rowvar=False, ddof=ddof).reshape(got.cov.shape)) < tol


def check_moments(got, x, ddof, tol=1e-5):
    x = f64(x)
    assert got.count == len(x)
    assert rel_err(got.mean, x.mean(0)) < 1e-6
    assert rel_err(got.var, x.var(0, ddof=ddof)) < tol
    np.testing.assert_array_equal(got.min, x.min(0))
    np.testing.assert_array_equal(got.max, x.max(0))
    with np.errstate(invalid="ignore", divide="ignore"):  # scipy's NaN for one row, or a constant column
        skew, kurt = scipy.stats.skew(x), scipy.stats.kurtosis(x)
    np.testing.assert_allclose(got.skewness, np.where(x.var(0) > 0, skew, np.nan), rtol=0, atol=1e-5)
    np.testing.assert_allclose(got.kurtosis, np.where(x.var(0) > 0, kurt, np.nan), rtol=0, atol=1e-5)
    np.testing.assert_array_equal(got.nan_count, np.isnan(x).sum(0))
    np.testing.assert_array_equal(got.zeros, (x == 0).sum(0))
    assert rel_err(got.norm_l1, np.abs(x).sum(0)) < 1e-6
    assert rel_err(got.norm_l2, np.linalg.norm(x, axis=0)) < 1e-6


# 1009 rows on both meshes; 1 and 3 rows (empty shards merged in, one row, ddof=1 on 3) where
# most shards are empty. With a model axis 5 columns: the co-moments split by columns, padded to 6 (3 a device).
CASES = [(n, mesh) for n in (1009, 1, 3) for mesh in MESHES]


@pytest.mark.parametrize("n, mesh", CASES)
def test_covariance_and_moments_match_numpy(mesh, n):
    x = rows(n, d=5 if "model" in mesh else 4)
    ddof = 1 if n > 1 else 0
    check_covariance(ss.run(ss.Covariance(ddof=ddof), x, mesh=mesh, **KW), x, ddof)
    check_moments(ss.run(ss.Moments(ddof=ddof), x, mesh=mesh, **KW), x, ddof)


@pytest.mark.parametrize("d", [3, 40])
def test_moments_of_long_micro_batches_match_numpy(d):
    # 1536 rows a micro-batch: narrow rows fold 512-row groups in one pass and add 3 partials (a
    # ragged last one, padding never a minimum or a zero); from d = 32 the separate reductions.
    # One device (3 micro-batches and a ragged fourth; its programs compile in about two thirds of eight's): the
    # fold of a micro-batch is the subject, the merges of devices' partials CASES'.
    x = rows(5001, d, seed=4, offset=3.0)
    x[[7, 4000], 0] = 0.0
    check_moments(ss.run(ss.Moments(), x, mesh="data:1", microbatch=1536, steps_per_call=1), x, 0)


def test_default_ddof_is_numpys():
    x, kw = rows(97), {"mesh": "data:8", "microbatch": 8, "steps_per_call": 2}  # test_covariance_and_moments_...'s
    got = ss.run(ss.Covariance(), x, **kw)
    assert rel_err(got.cov, np.cov(f64(x), rowvar=False)) < 1e-5
    assert rel_err(ss.run(ss.Moments(), x, **kw).var, f64(x).var(0)) < 1e-5


def test_large_mean_offset_stays_accurate():
    x = rows(1009, offset=1e4, seed=3)
    got = ss.run(ss.Covariance(), x, mesh="data:8", microbatch=8, steps_per_call=2)
    # Tighter than elsewhere: a plain Chan merge with float32 means from zero gives ~1e-5 here.
    check_covariance(got, x, 1, tol=1e-6)
    check_moments(ss.run(ss.Moments(), x, mesh="data:8", microbatch=8, steps_per_call=2), x, 0, tol=1e-6)
    # The naive float32 formula E[x²] - E[x]² loses every digit here: the test can fail.
    x32 = x.astype(np.float32)
    naive = (x32 * x32).mean(0, dtype=np.float32) - x32.mean(0, dtype=np.float32) ** 2
    assert rel_err(naive, f64(x).var(0)) > 1e-3


@pytest.mark.parametrize("microbatch, steps_per_call", [(1, 1), (7, 3), (8, 2)])  # (8, 2): CASES' programs
def test_independent_of_microbatch_and_steps(microbatch, steps_per_call):
    x = rows(1009, offset=50.0, seed=1)
    got = ss.run(ss.Covariance(), x, mesh="data:8", microbatch=microbatch, steps_per_call=steps_per_call)
    check_covariance(got, x, 1)


def test_bfloat16_rows_accumulate_in_float32():
    x = rows(515).astype(ml_dtypes.bfloat16)  # one device: the fold's accumulator dtype is the subject
    got = ss.run(ss.Covariance(), x, mesh="data:1", microbatch=16)
    assert got.cov.dtype == np.float64 and got.count.dtype == np.int64
    check_covariance(got, x, 1)
    check_moments(ss.run(ss.Moments(), x, mesh="data:1", microbatch=16), x, 0)


@functools.cache
def jitted(combiner):
    """``combiner``'s add and merge, each one program as the engine runs them, shared by the tests below (called
    op by op, each of their operations compiled a program of its own: 50 for Moments)."""
    return jax.jit(combiner.add), jax.jit(combiner.merge)


@pytest.mark.parametrize("combiner", [ss.Covariance(), ss.Moments(), ss.PCA(2)])
def test_merge_is_associative_with_init_as_identity(combiner):
    spec = jax.ShapeDtypeStruct((4,), np.float32)
    x = rows(30, offset=1e3, seed=2)
    mask = np.ones(10, bool)
    add, merge = jitted(combiner)
    a, b, c = (add(combiner.init(spec), x[i : i + 10], mask) for i in (0, 10, 20))
    empty = combiner.init(spec)
    for leaf_got, leaf_want in zip(jax.tree.leaves(merge(empty, a)), jax.tree.leaves(a), strict=True):
        np.testing.assert_array_equal(leaf_got, leaf_want)
    for leaf_got, leaf_want in zip(jax.tree.leaves(merge(a, empty)), jax.tree.leaves(a), strict=True):
        np.testing.assert_array_equal(leaf_got, leaf_want)
    left = combiner.finalize(jax.device_get(merge(merge(a, b), c)))
    right = combiner.finalize(jax.device_get(merge(a, merge(b, c))))
    assert left.columns is right.columns is None  # set by the engine, not by finalize
    for name, got, want in zip(left._fields, left, right, strict=True):
        if got is None or want is None:  # columns, and pair_count but under nan_policy="omit"
            assert got is want is None, name
        elif name in ("skewness", "kurtosis"):  # quotients of float32 moments: absolute, as promised against scipy
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
        else:
            assert rel_err(got, want) < 1e-6


def test_masked_rows_never_count():
    combiner, spec = ss.Moments(), jax.ShapeDtypeStruct((4,), np.float32)
    add = jitted(combiner)[0]
    x = rows(10)
    mask = np.arange(10) < 6
    got = combiner.finalize(jax.device_get(add(combiner.init(spec), x * 1e6, np.zeros(10, bool))))
    assert got.count == 0
    got = combiner.finalize(jax.device_get(add(combiner.init(spec), x, mask)))
    check_moments(got, x[:6], 0)


def test_pca_matches_scikit_learn():
    mesh, n = "data:8", 1009  # ragged: 126 or 127 rows a device
    sklearn = pytest.importorskip("sklearn.decomposition")
    x = rows(n, d=5, seed=4, offset=10.0)
    got = ss.run(ss.PCA(3), x, mesh=mesh, microbatch=8)
    want = sklearn.PCA(3, svd_solver="full").fit(f64(x))
    assert rel_err(got.components, want.components_) < 1e-4
    assert rel_err(got.explained_variance, want.explained_variance_) < 1e-5
    assert rel_err(got.explained_variance_ratio, want.explained_variance_ratio_) < 1e-5
    assert rel_err(got.mean, want.mean_) < 1e-6
    assert rel_err(got.singular_values, want.singular_values_) < 1e-5


def test_pca_components_are_orthonormal_rows_sorted_by_variance():
    got = ss.run(ss.PCA(5), rows(200, d=5, seed=5), mesh="data:8", microbatch=8)  # test_pca_matches_...'s step
    np.testing.assert_allclose(got.components @ got.components.T, np.eye(5), atol=1e-10)
    assert np.all(np.diff(got.explained_variance) <= 0)
    assert abs(got.explained_variance_ratio.sum() - 1) < 1e-10


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: ss.run(ss.PCA(0), rows(10)), ["k", "1 <= k <= d = 4"]),
        (lambda: ss.run(ss.PCA(5), rows(10)), ["k=5"]),
        (lambda: ss.run(ss.PCA(2.5), rows(10)), ["k=2.5"]),
        (lambda: ss.run(ss.Covariance(), rows(10).reshape(10, 4, 1)), ["(4, 1)", "(d,)"]),
        (lambda: ss.run(ss.Moments(), rows(10)[:, 0]), ["()", "(d,)"]),
        (lambda: ss.run(ss.Moments(), (rows(10), rows(10))), ["one array"]),
        (lambda: ss.Moments(fields=("mean", "std")), ["Moments fields", "'std'", "var", "norm_l2"]),
        (lambda: ss.Moments(fields=3), ["Moments fields", "3"]),
    ],
)
def test_bad_input_is_one_clear_line(call, words):
    assert_usage_error(call, words)


@pytest.mark.parametrize("combiner", [ss.Covariance(), ss.Moments()])
def test_padding_rows_never_become_the_reference_point(combiner):
    # Padding first, holding huge values and NaN: the shift must come from real rows only. Micro-batches of
    # 10 rows: test_merge_is_associative_with_init_as_identity's, whose programs these reuse.
    spec = jax.ShapeDtypeStruct((4,), np.float32)
    x = rows(15, offset=1e4, seed=6)
    batch = np.concatenate([np.full((5, 4), 3e38, np.float32), x[:5]])
    batch[1] = np.nan
    mask = np.arange(10) >= 5
    add = jitted(combiner)[0]
    acc = add(combiner.init(spec), batch, mask)
    acc = add(acc, x[5:], np.ones(10, bool))
    got = combiner.finalize(jax.device_get(acc))
    if isinstance(combiner, ss.Moments):
        check_moments(got, x, 0, tol=1e-6)
    else:
        check_covariance(got, x, 1, tol=1e-6)


@pytest.mark.parametrize("combiner", [ss.Covariance(), ss.Moments()])
def test_a_micro_batch_without_real_rows_changes_nothing(combiner):
    spec = jax.ShapeDtypeStruct((4,), np.float32)
    garbage = np.full((10, 4), np.nan, np.float32)  # the 10-row micro-batches of the tests above
    none = np.zeros(10, bool)
    fresh = combiner.init(spec)
    add = jitted(combiner)[0]
    some = add(fresh, rows(10, offset=1e3), np.ones(10, bool))
    for acc in (fresh, some):
        after = add(acc, garbage, none)
        for leaf_got, leaf_want in zip(jax.tree.leaves(after), jax.tree.leaves(acc), strict=True):
            np.testing.assert_array_equal(leaf_got, leaf_want)


def test_nan_in_a_real_row_propagates_to_its_column_like_numpy():
    x = rows(203, offset=1e4, seed=7)
    x[150, 2] = np.nan
    got = ss.run(ss.Moments(), x, mesh="data:8", **KW)  # the programs of CASES
    want = f64(x)
    for name, value in zip(("mean", "var", "min", "max"), got[1:5], strict=True):
        expected = getattr(np, name)(want, axis=0)
        assert np.isnan(value[2]) and np.isnan(expected[2])
        assert rel_err(np.delete(value, 2), np.delete(expected, 2)) < 1e-6
    cov = ss.run(ss.Covariance(), x, mesh="data:8", **KW).cov
    np.testing.assert_array_equal(np.isnan(cov), np.isnan(np.cov(want, rowvar=False)))


def test_drifting_rows_far_from_zero_stay_accurate():
    # Sorted rows: every micro-batch's mean is far from the first one's, and drifts.
    x = np.sort(rows(2003, offset=1e4, seed=8), axis=0)  # each device's rows drift too: CASES' programs
    check_moments(ss.run(ss.Moments(), x, mesh="data:8", **KW), x, 0, tol=1e-6)
    check_covariance(ss.run(ss.Covariance(), x, mesh="data:8", **KW), x, 1, tol=1e-6)


@pytest.mark.parametrize("value", [1e12, 3e19, -7.1, 0.0])
def test_a_constant_column_has_exactly_zero_variance(value):
    x = np.full((1000, 4), value, np.float32)  # 4 columns: test_covariance_and_moments_match_numpy's programs
    x[:, 1:] = np.linspace(-1, 1, 1000)[:, None]  # next to ordinary columns
    # and their mesh and micro-batch: 125 rows a device, ragged; the adds of micro-batches and the merges of 8
    # devices' constant partials alike
    moments = ss.run(ss.Moments(), x, mesh="data:8", **KW)
    cov = ss.run(ss.Covariance(), x, mesh="data:8", **KW).cov
    assert moments.var[0] == 0.0 and cov[0, 0] == 0.0 and cov[0, 1] == 0.0, (moments.var, cov)
    assert moments.mean[0] == np.float32(value)
    assert rel_err(moments.var[1], f64(x[:, 1]).var()) < 1e-6


def test_variances_are_never_negative():
    # Columns of two neighbouring float32 values far from zero: deviations of one ulp.
    base = np.float32(3e7)
    x = np.where(np.random.default_rng(9).random((4001, 4)) < 0.999, base, np.nextafter(base, np.float32(np.inf)))
    # the shapes and steps of test_covariance_and_moments_match_numpy: adds and merges of 8 devices' partials
    var = ss.run(ss.Moments(), x.astype(np.float32), mesh="data:8", **KW).var
    diag = np.diag(ss.run(ss.Covariance(), x.astype(np.float32), mesh="data:8", **KW).cov)
    assert (var >= 0).all() and (diag >= 0).all()
    assert rel_err(var, f64(x).var(0)) < 1e-3


def test_pca_keeps_small_components_of_ill_conditioned_data_like_scikit_learn():
    # Singular values over 3.5 decades, mean 1e3: eigenvalues of a float32 covariance lose
    # the small ones (0.3% off here); the R of the rows keeps them.
    sklearn = pytest.importorskip("sklearn.decomposition")
    rng = np.random.default_rng(10)
    d = 5  # test_pca_matches_scikit_learn's columns, mesh and micro-batch: its compiled step
    rotation = np.linalg.qr(rng.normal(size=(d, d)))[0]
    x = ((rng.normal(size=(4000, d)) * np.logspace(0, -3.5, d)) @ rotation.T * 100 + 1e3).astype(np.float32)
    want = sklearn.PCA(d, svd_solver="full").fit(f64(x))
    for mesh in ("data:8",):  # ragged: 500 rows a device, 8 a micro-batch; R factors merged over devices
        got = ss.run(ss.PCA(d), x, mesh=mesh, microbatch=8, steps_per_call=1)
        assert np.abs(got.singular_values / want.singular_values_ - 1).max() < 1e-4
        assert np.abs(got.explained_variance / want.explained_variance_ - 1).max() < 2e-4
        assert rel_err(got.explained_variance_ratio, want.explained_variance_ratio_) < 1e-5
        assert np.abs(np.abs(got.components) - np.abs(want.components_)).max() < 1e-4
        assert rel_err(got.mean, want.mean_) < 1e-6
    covariance = ss.run(ss.PCA(d, solver="comoments"), x, mesh="data:8", microbatch=8, steps_per_call=1)
    assert np.abs(covariance.singular_values / want.singular_values_ - 1).max() > 1e-3  # the test can fail


@pytest.mark.parametrize("policy", ["propagate", "omit"])
def test_moments_count_nans_and_zeros_per_column_also_where_omitted(policy):
    x = rows(203, offset=1e4, seed=11)
    x[::10, 1] = 0.0
    x[[5, 50, 150], 2] = np.nan
    x[7, 3] = np.inf
    # one device: per-column counts merged over 8 devices under "omit": test_nan_omit
    got = ss.run(ss.Moments(), x, mesh="data:1" if policy == "omit" else "data:8", nan_policy=policy, **KW)
    np.testing.assert_array_equal(got.nan_count, [0, 0, 3, 0])  # the NaN rows, skipped or not
    if policy == "omit":  # each NaN or inf skipped where it stands: a count a column
        finite = np.isfinite(x)
        np.testing.assert_array_equal(got.count, finite.sum(0))
        np.testing.assert_array_equal(got.zeros, ((x == 0) & finite).sum(0))
        for j in range(4):
            column = got._replace(**{f: np.atleast_1d(v[j]) for f, v in got._asdict().items() if f != "columns"})
            check_moments(column._replace(count=column.count[0], nan_count=np.zeros(1, int)), x[finite[:, j], j:j + 1],
                          0)
    else:  # numpy's: NaN and inf reach their columns' moments
        assert got.count == len(x)
        np.testing.assert_array_equal(got.zeros, (x == 0).sum(0))
        assert np.isnan(got.skewness[2:]).all() and np.isnan(got.kurtosis[2:]).all()
    table = got.to_pandas()
    assert list(table.columns) == list(got._fields[:-1])
    assert table["nan_count"].dtype == np.int64 and table.loc[2, "nan_count"] == 3


@pytest.mark.parametrize("n, d", [(16384, 8), (301, 3), (96, 7), (0, 4), (10, 300)])
def test_column_sum_adds_every_row_of_every_column(n, d):
    from sharded_scan.combiners.statistics.moments import column_sum

    x = rows(n, d, offset=3.0)
    got = np.asarray(column_sum(jax.numpy.asarray(x)))
    assert got.shape == (d,)
    np.testing.assert_allclose(got, f64(x).sum(0), rtol=1e-6, atol=1e-3 * max(n, 1) ** 0.5)


def test_moments_fields_compute_only_what_is_asked_and_stay_numpys():
    """Moments(fields=...): a mean and a variance keep no third and fourth moments, zeros or norms (a smaller
    state, so a cheaper fold), the others None; still numpy's, at an infinity too (no min or max asked);
    split over a model axis, weighted and per key alike."""
    x = rows(1009, d=5, offset=3.0)
    x[17, 4] = np.inf
    spec = jax.ShapeDtypeStruct((5,), np.float32)
    asked = ss.Moments(fields=("var", "mean"))
    small, full = asked.init(spec), ss.Moments().init(spec)
    assert (small.higher.shape, small.counts.limbs.shape[:2]) == ((1, 5), (1, 5))  # a row unused: no empty array
    assert (full.higher.shape, full.counts.limbs.shape[:2]) == ((4, 5), (2, 5))
    assert asked.fields == ("mean", "var") and ss.Moments(fields="mean,var") == asked
    every = ("count", "mean", "var", "min", "max", "skewness", "kurtosis", "nan_count", "zeros", "norm_l1", "norm_l2")
    assert ss.Moments(fields=every).fields is None  # every field: the default job
    got = ss.run(asked, x, mesh="data:4,model:2", microbatch=8, steps_per_call=2)
    want = f64(x)
    with np.errstate(invalid="ignore"):
        np.testing.assert_allclose(got.mean, want.mean(0), rtol=1e-6)
        np.testing.assert_allclose(got.var, want.var(0), rtol=1e-5)  # NaN beside the inf, as numpy's
    assert got.mean[4] == np.inf and got.count == 1009
    assert all(getattr(got, f) is None for f in got._fields[3:-1])  # min ... norm_l2
    assert list(got.to_pandas().columns) == ["count", "mean", "var"]

    w = np.random.default_rng(3).uniform(0.5, 2, 1009).astype(np.float32)
    keys = np.arange(1009) % 3
    both = ss.run(ss.GroupBy(ss.Weighted(ss.Moments(fields=("mean", "skewness", "norm_l1"))), 3),
                  (keys, (w, x[:, :4])), mesh="data:1", **KW)  # one device: cheaper programs
    assert both.var is None and both.min is None and both.kurtosis is None and both.norm_l2 is None
    for k in range(3):
        part, weight = want[keys == k, :4], w[keys == k]
        mean = np.average(part, axis=0, weights=weight)
        np.testing.assert_allclose(both.mean[k], mean, rtol=1e-6)
        m2, m3 = (np.average((part - mean) ** p, axis=0, weights=weight) for p in (2, 3))
        np.testing.assert_allclose(both.skewness[k], m3 / m2**1.5, rtol=0, atol=1e-5)
        np.testing.assert_allclose(both.norm_l1[k], (np.abs(part) * weight[:, None]).sum(0), rtol=1e-6)


def test_moments_of_other_fields_are_another_job(tmp_path):
    """The fields asked are part of the job: a checkpoint of a mean and variance does not resume as a job
    asking for the minimum too (the same state shapes), and resumes as itself; all fields is the job as
    it was before the option."""
    x = rows(600, d=5)  # test_moments_fields_compute_only_what_is_asked_and_stay_numpys' shapes: its programs
    kw = {"mesh": "data:4,model:2", **KW}
    options = ss.CheckpointOptions(str(tmp_path), every_steps=2)
    mean_var = ss.Moments(fields=("mean", "var"))
    with pytest.raises(CrashError):
        ss.run(mean_var, x, checkpoint=options, progress=crash_at(3), **kw)
    assert_usage_error(lambda: ss.run(ss.Moments(fields=("mean", "var", "min")), x, checkpoint=options, **kw),
                       ["different job"])
    got = ss.run(mean_var, x, checkpoint=str(tmp_path), **kw)  # the directory's default options: no save a step
    np.testing.assert_allclose(got.var, f64(x).var(0), rtol=1e-5)
    assert "fields" not in ss.Moments().fingerprint() and "fields" in mean_var.fingerprint()
