"""Differential, property-based tests of the float statistics (issue 42 item 8): Moments, Sum, Gram,
Covariance, Correlation, Histogram, Describe, GroupBy and Weighted against exact rationals, numpy, scipy and
pandas in float64, on eight devices, with the ``to_pandas()`` and result.json/result.csv round trips.

Generated data: tests/properties.py (a few fixed shapes, so every example reuses the same compiled programs).
The default run is a fixed seed and 12 examples a test; ``HYPOTHESIS_PROFILE=long`` searches deeper (DESIGN.md).
"""

import math
import warnings
from fractions import Fraction

import numpy as np
import pandas as pd
import pytest
import scipy.stats
from hypothesis import given
from hypothesis import strategies as st

import sharded_scan as ss
from tests.properties import (
    EPS,
    KNOWN,
    MESHES,
    RUN,
    D,
    assert_close,
    check_round_trips,
    exact_comoment,
    float_frames,
    kept_rows,
    kept_values,
    known_mean_findings,
    mean_bound,
    ref_mean,
    ref_var,
    to_float,
    var_bound,
    written_outputs,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's and ours, for NaN and empty columns
# Column names: any code point but lone surrogates (those are string-column tests'), NUL included; made
# distinct by their position.
NAMES = st.lists(st.text(st.characters(blacklist_categories=("Cs",)), max_size=3), min_size=D, max_size=D).map(
    lambda names: [f"{name}{i}" for i, name in enumerate(names)])


def runs(combiner, data, **kw):
    """``combiner`` over ``data`` on each mesh of MESHES (the fixed step shape of RUN)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [ss.run(combiner, data, mesh=mesh, **RUN, **kw) for mesh in MESHES]


def mesh_name(i):
    return MESHES[i] or "data:8"


def check_moments(r, x: np.ndarray, policy: str, where: str) -> None:
    """A MomentsResult against numpy/scipy/exact rationals, column by column (known findings exempt)."""
    counts = [len(kept_values(x, j, policy)) for j in range(x.shape[1])]
    np.testing.assert_array_equal(r.count, counts if policy == "omit" else counts[0], err_msg=where)
    np.testing.assert_array_equal(r.nan_count, np.isnan(x).sum(axis=0), err_msg=where)
    for j in range(x.shape[1]):
        col, at = kept_values(x, j, policy), f"{where} column {j} {x[:, j].tolist()!r}"
        known = known_mean_findings(col)
        if 7 not in known:  # selected values, never computed: exact
            np.testing.assert_array_equal(r.zeros[j], (col == 0).sum(), err_msg=at)
            assert_close(r.min[j], np.min(col) if len(col) else math.nan, 0, f"min {at}")
            assert_close(r.max[j], np.max(col) if len(col) else math.nan, 0, f"max {at}")
            if np.isfinite(col).all():  # also past the largest float64 (partial sums, squares that overflow)
                check_norms(r.norm_l1[j], r.norm_l2[j], col, at)
        if 7 in known:
            continue
        assert_close(r.mean[j], ref_mean(col), mean_bound(col), f"mean {at}")
        var = ref_var(col, 0)
        assert_close(r.var[j], var, var_bound(col, var), f"var {at}")
        if len(col) and np.isfinite(col).all() and var > 0 and np.abs(col).max() < 1e100:
            # scipy's skewness/kurtosis are themselves float64: to a relative 1e-6 of the well-spread columns
            spread = math.sqrt(var) / max(np.abs(col).max(), 1e-300)
            if spread > 1e-4:
                assert_close(r.skewness[j], scipy.stats.skew(col), 1e-6 * (1 + abs(scipy.stats.skew(col))),
                             f"skewness {at}")
                assert_close(r.kurtosis[j], scipy.stats.kurtosis(col), 1e-6 * (1 + abs(scipy.stats.kurtosis(col))),
                             f"kurtosis {at}")
        elif len(col) and np.isfinite(col).all() and var == 0:
            assert math.isnan(r.skewness[j]) and math.isnan(r.kurtosis[j]), f"skewness of a constant {at}"


def exact_norm_l2(col: np.ndarray) -> float:
    """``√Σx²`` of finite ``col`` rounded from exact rationals (scaled by a power of four: no overflow or
    underflow on the way; inf only where the norm itself is past the largest float64)."""
    squares = sum((v * v for v in map(Fraction, col.tolist())), Fraction(0))
    if not squares:
        return 0.0
    k = (squares.numerator.bit_length() - squares.denominator.bit_length()) // 2
    try:
        return math.ldexp(math.sqrt(float(squares / Fraction(4) ** k)), k)
    except OverflowError:
        return math.inf


def check_norms(l1, l2, col: np.ndarray, at: str) -> None:
    """Moments' ``norm_l1`` and ``norm_l2`` of a finite column against exact rationals, inf where the norm is
    past the largest float64 (or within the rounding bound of it), never NaN."""
    for got, want, bound, name in ((l1, to_float(sum(map(Fraction, np.abs(col).tolist()), Fraction(0))),
                                    mean_bound(col) * len(col), "norm_l1"),
                                   (l2, exact_norm_l2(col), 1e-12 * exact_norm_l2(col) + 1e-300, "norm_l2")):
        if not (math.isfinite(want) and want + bound > np.finfo(np.float64).max and got == math.inf):
            assert_close(got, want, bound, f"{name} {at}")


@given(x=float_frames(), policy=st.sampled_from(["propagate", "omit"]), names=NAMES,
       form=st.sampled_from(["array", "frame", "vector"]))
def test_moments_match_numpy_and_scipy(x, policy, names, form):
    if form == "array":
        data, columns = x, list(range(D))
    elif form == "frame":
        data, columns = pd.DataFrame(x, columns=names), names
    else:  # a vector column: its values named vec[0], vec[1]...
        data = pd.DataFrame({names[0]: x[:, 0], names[1]: list(x[:, 1:])})
        columns = [names[0]] + [f"{names[1]}[{k}]" for k in range(D - 1)]
    results = runs(ss.Moments(), data, nan_policy=policy)
    for i, r in enumerate(results):
        check_moments(r, x, policy, f"{mesh_name(i)} {policy} {form}")
    r = results[-1]
    assert list(r.columns) == columns
    table = r.to_pandas()
    assert table.shape[0] == D
    for field in ("count", "mean", "var", "min", "max", "nan_count", "zeros"):
        np.testing.assert_array_equal(table[field].to_numpy(), np.broadcast_to(getattr(r, field), (D,)))
    check_round_trips(r)


@given(x=float_frames(), policy=st.sampled_from(["propagate", "omit"]))
def test_sum_and_gram_match_exact_sums(x, policy):
    kept = kept_rows(x, policy)
    sums, grams = runs(ss.Sum(), x, nan_policy=policy), runs(ss.Gram(), x, nan_policy=policy)
    for i, (s, g) in enumerate(zip(sums, grams, strict=True)):
        where = f"{mesh_name(i)} {policy}"
        assert int(s.count) == (len(x) if policy == "omit" else len(kept)), where
        for j in range(D):
            col = kept_values(x, j, policy)  # Sum under "omit": each NaN or inf adds nothing; Gram: whole rows
            known = known_mean_findings(col)
            if 7 in known:
                continue
            want = np.sum(col) if not np.isfinite(col).all() else to_float(sum(map(Fraction,
                                                                                   col.tolist()), 0))
            if s.sum[j] in (np.inf, -np.inf) and np.isfinite(col).all() and not np.isfinite(np.abs(col).sum()):
                continue  # partial sums past the largest float overflow in some orders (as the Gram's below)
            assert_close(s.sum[j], want, mean_bound(col) * max(len(col), 1), f"sum {where} column {j} {col!r}")
        for a in range(D):
            for b in range(D):
                ca, cb = kept[:, a], kept[:, b]
                if any(f in known_mean_findings(c) for c in (ca, cb) for f in (7,)):
                    continue
                if not (np.isfinite(ca).all() and np.isfinite(cb).all()):
                    want = float(ca @ cb)  # NaN/inf as numpy's product sums them
                    if math.isnan(want):
                        assert math.isnan(g[a, b]), (where, a, b, g[a, b])
                    continue
                prods = np.abs(ca) * np.abs(cb)
                if not np.isfinite(prods).all() or prods.sum() > 1e300:
                    continue
                exact = sum((Fraction(u) * Fraction(v)
                             for u, v in zip(ca.tolist(), cb.tolist(), strict=True)), Fraction(0))
                assert_close(g[a, b], to_float(exact), 4 * (len(ca) + 2) * EPS * float(prods.sum()) + 1e-300,
                             f"gram {where} [{a},{b}]")
    check_round_trips(sums[-1])


@given(x=float_frames(min_rows=1), policy=st.sampled_from(["propagate", "omit"]))
def test_covariance_and_correlation_match_numpy(x, policy):
    kept = kept_rows(x, policy)
    covs, corrs = runs(ss.Covariance(), x, nan_policy=policy), runs(ss.Correlation(), x, nan_policy=policy)
    for i, (c, r) in enumerate(zip(covs, corrs, strict=True)):
        where = f"{mesh_name(i)} {policy} rows {len(kept)}"
        if policy == "omit":  # pairwise complete, as pandas' df.cov(): each pair over the rows where both are finite
            finite = np.isfinite(x)
            assert c.count.tolist() == r.count.tolist() == finite.sum(0).tolist(), where
            np.testing.assert_array_equal(c.pair_count, finite.T.astype(int) @ finite, err_msg=where)
        else:
            assert int(c.count) == int(r.count) == len(kept), where
        for a in range(D):
            ca = kept_values(x, a, policy)
            known_a = known_mean_findings(ca)
            if 7 in known_a:
                continue
            if np.isinf(ca).any() and not np.isnan(ca).any():  # DESIGN, Edge values: Covariance's mean is NaN
                assert math.isnan(c.mean[a]) or c.mean[a] == ref_mean(ca), f"cov mean {where} column {a}"
            else:
                assert_close(c.mean[a], ref_mean(ca), mean_bound(ca), f"cov mean {where} column {a}")
            for b in range(D):
                both = np.isfinite(x[:, a]) & np.isfinite(x[:, b]) if policy == "omit" else slice(None)
                ca, cb = (x[both, a], x[both, b]) if policy == "omit" else (kept[:, a], kept[:, b])
                known_b = known_mean_findings(cb) + known_mean_findings(ca)
                if 7 in known_b:
                    continue
                at = f"{where} [{a},{b}] {ca.tolist()!r} {cb.tolist()!r}"
                if len(ca) < 2 or not (np.isfinite(ca).all() and np.isfinite(cb).all()):
                    assert math.isnan(c.cov[a, b]), f"cov of NaN/inf/one row {at}: {c.cov[a, b]!r}"
                    assert math.isnan(r.corr[a, b]), f"corr of NaN/inf/one row {at}: {r.corr[a, b]!r}"
                    continue
                va, vb = ref_var(ca, 1), ref_var(cb, 1)
                if not (math.isfinite(va) and math.isfinite(vb)):
                    continue  # overflowing variances: numpy's own answer is not defined well
                want = to_float(exact_comoment(ca, cb) / (len(ca) - 1))
                bound = math.sqrt(var_bound(ca, va)) * math.sqrt(var_bound(cb, vb)) + var_bound(ca, va) + var_bound(
                    cb, vb) if a != b else var_bound(ca, va)
                assert_close(c.cov[a, b], want, bound if want != 0 or a == b else bound + 1e-300, f"cov {at}")
                if va == 0 or vb == 0:
                    assert math.isnan(r.corr[a, b]), f"corr of a constant column {at}: {r.corr[a, b]!r}"
                    continue
                spread = min(math.sqrt(va) / np.abs(ca).max(), math.sqrt(vb) / np.abs(cb).max())
                if spread > 1e-4 and np.abs(np.r_[ca, cb]).max() < 1e150:
                    assert_close(r.corr[a, b], np.corrcoef(ca, cb)[0, 1], 1e-9, f"corr {at}")
    check_round_trips(covs[-1])
    check_round_trips(corrs[-1])
    np.testing.assert_array_equal(covs[-1].to_pandas().to_numpy(), covs[-1].cov)


EDGES = (-2.0, 2.0)


@given(x=float_frames(), policy=st.sampled_from(["propagate", "omit"]))
def test_histogram_matches_numpy(x, policy):
    # Data around the edges: scale the ordinary columns into [-3, 3] so that bins fill.
    scaled = np.where(np.abs(x) > 3, x, x)
    for i, h in enumerate(runs(ss.Histogram(4, EDGES), scaled, nan_policy=policy)):
        np.testing.assert_array_equal(h.edges, np.histogram_bin_edges([], 4, EDGES))
        for j in range(D):
            col = kept_values(x, j, policy)
            want = np.histogram(col[~np.isnan(col)], 4, EDGES)[0]
            if (np.abs(col[np.isfinite(col)]) < 1e-300).any() and not np.array_equal(h.counts[j], want):
                continue  # finding 7: subnormals flushed to 0 fall in another bin (pinned below)
            np.testing.assert_array_equal(h.counts[j], want, err_msg=f"{mesh_name(i)} column {j} {col.tolist()!r}")
        check_round_trips(h)


# Percentiles from a sketch of k=128, which holds every row of these frames (at most 64) as the default 8192
# does: nothing compacted either way, but each step and each merge of eight partials passes over all its levels.
DESCRIBE = ss.Describe(k=128)


@given(x=float_frames(), names=NAMES)
def test_describe_matches_pandas(x, names):
    df = pd.DataFrame(x, columns=names)
    want = df.describe()
    for i, r in enumerate(runs(DESCRIBE, df)):
        where = mesh_name(i)
        assert list(r.columns) == names
        for j, name in enumerate(names):
            col = x[:, j][~np.isnan(x[:, j])]  # Describe skips NaN column by column, as pandas
            at = f"{where} column {name!r} {x[:, j].tolist()!r}"
            assert int(r.count[j]) == len(col) == int(want[name]["count"]), at
            assert r.rank_error[j] == 0, at  # a few rows: the sketch holds every one
            known = known_mean_findings(col)
            if 7 not in known and len(col):
                assert_close(r.min[j], col.min(), 0, f"min {at}")
                assert_close(r.max[j], col.max(), 0, f"max {at}")
                lo, mid, hi = np.quantile(col, [0.25, 0.5, 0.75])
                for got, q, w in zip(r.percentiles[j], (0.25, 0.5, 0.75), (lo, mid, hi), strict=True):
                    if np.isfinite(col).all() and np.abs(col).max() < 1e300:
                        assert_close(got, w, 4 * EPS * np.abs(col).max() + 1e-300, f"{q} {at}")
            if 7 in known:
                continue
            assert_close(r.mean[j], ref_mean(col), mean_bound(col), f"mean {at}")
            var = ref_var(col, 1)
            std = math.sqrt(var) if math.isfinite(var) else var
            assert_close(r.std[j], std, math.sqrt(var_bound(col, var)) + 1e-300 if var else 0, f"std {at}")
        check_round_trips(r, exempt=("qs",))
        table = r.to_pandas()
        assert list(table.index) == list(want.index)
        assert list(table.columns) == names


@given(x=float_frames(min_rows=3), keys=st.integers(0, 2**32 - 1), policy=st.sampled_from(["propagate", "omit"]))
def test_group_by_moments_is_moments_of_each_key(x, keys, policy):
    k = np.random.default_rng(keys).integers(0, 4, len(x)).astype(np.int32)  # 4 keys; some may meet no rows
    for i, g in enumerate(runs(ss.GroupBy(ss.Moments(), 4), (k, x), nan_policy=policy)):
        for key in range(4):
            rows = x[k == key]
            inner = type(g.result)(*(f[key] if name != "columns" else f for name, f in g.result._asdict().items()))
            if len(rows) == 0:
                assert (inner.count == 0).all() and np.isnan(inner.mean).all(), (key, inner)
                continue
            check_moments(inner, rows, policy, f"{mesh_name(i)} key {key}")
        assert g.to_pandas().shape[0] == 4 * D
        check_round_trips(g)


@given(x=float_frames(min_rows=2), w=st.integers(0, 2**32 - 1))
def test_weighted_moments_match_np_average(x, w):
    weights = np.random.default_rng(w).choice([0.0, 0.5, 1.0, 3.0, 1e-3], len(x))
    weights[0] = 1.0  # at least one row of positive weight
    for i, r in enumerate(runs(ss.Weighted(ss.Moments()), (weights, x))):
        pos = weights > 0
        assert int(r.count) == pos.sum()
        for j in range(D):
            col, wj = x[pos, j], weights[pos]
            if not np.isfinite(col).all() or known_mean_findings(col):
                continue
            at = f"{mesh_name(i)} column {j} {col.tolist()!r} weights {wj.tolist()!r}"
            exact = sum(Fraction(float(a)) * Fraction(float(b)) for a, b in zip(col, wj, strict=True)) / sum(
                map(Fraction, wj.tolist()))
            mean = to_float(exact)  # np.average's own sum may overflow where the mean does not
            scale = np.abs(col).max()
            assert_close(r.mean[j], mean, 16 * len(col) * EPS * scale + 1e-300, f"weighted mean {at}")
            with np.errstate(over="ignore", invalid="ignore"):
                var = np.average((col - mean) ** 2, weights=wj)
            if not math.isfinite(var):
                continue  # squares past the largest float: var_overflow's territory
            assert_close(r.var[j], var, 64 * len(col) * EPS * (var + scale * math.sqrt(var)) + 1e-300,
                         f"weighted var {at}")
            assert r.min[j] == col.min() and r.max[j] == col.max(), at
        check_round_trips(r)


# --- the findings these properties met, pinned (a strict xfail where one is still open) ---------


def pad(column, other=(1.0, 2.0, 4.0)):
    """``column`` as the first of D columns (the others ordinary), so the pinned examples reuse the
    properties' compiled programs."""
    column = np.asarray(column, np.float64)
    rest = np.resize(np.asarray(other, np.float64), len(column))
    return np.stack([column] + [rest] * (D - 1), axis=1)


@pytest.mark.xfail(strict=True, reason=KNOWN[7])
def test_subnormals_kept_where_the_backend_keeps_them():
    x = pad([1e-310, 2e-310, 3e-310])
    for r in runs(ss.Moments(), x):
        assert r.min[0] == 1e-310 and r.max[0] == 3e-310 and r.mean[0] == 2e-310
    for h in runs(ss.Histogram(4, (0, 4e-310)), x):
        np.testing.assert_array_equal(h.counts[0], [0, 1, 1, 1])


@pytest.mark.parametrize("value", [1e308, -1e308])
def test_finding8_constant_column_variance_is_zero(value):
    for n in (2, 3, 9, 17):
        for r in runs(ss.Moments(), pad([value] * n)):
            assert r.var[0] == 0, (n, r.var[0])


def test_finding9_infinities_in_means():
    for r in runs(ss.Moments(), pad([math.inf, 1, 2])):
        assert r.mean[0] == math.inf
    want = to_float(Fraction(1e308) / 3)
    for r in runs(ss.Moments(), pad([1e308, 1e308, -1e308])):
        assert abs(r.mean[0] - want) <= 2 * np.spacing(want), (r.mean[0], want)  # finite, to rounding


def test_new_variance_of_finite_values_whose_squares_overflow_is_inf():
    # found by these properties (var_overflow), fixed:
    # var inf as numpy's; norm_l2 (< the largest float) from the scaled sum of squares
    col = [1.25730221e306, -1.32104863e306]
    for r in runs(ss.Moments(), pad(col)):
        assert r.var[0] == math.inf and r.norm_l2[0] == pytest.approx(math.hypot(*col), rel=1e-15), r
    for r in runs(DESCRIBE, pad(col)):
        assert r.std[0] == math.inf, r.std


def test_new_group_by_moments_keeps_nan_count_under_omit():
    x = pad([math.nan, math.nan, 1.0])  # key 3: its one row skipped; key 2: one of two
    for g in runs(ss.GroupBy(ss.Moments(), 4), (np.array([3, 2, 2], np.int32), x), nan_policy="omit"):
        np.testing.assert_array_equal(g.result.nan_count[:, 0], [0, 0, 1, 1])
        np.testing.assert_array_equal(g.result.nan_count[:, 1:], 0)
        np.testing.assert_array_equal(g.result.count, [[0] * D, [0] * D, [1] + [2] * (D - 1), [0] + [1] * (D - 1)])
        assert np.isnan(g.result.mean[[0, 1]]).all() and g.result.mean[2].tolist() == [1.0, 3.0, 3.0]
        assert math.isnan(g.result.mean[3, 0]) and g.result.mean[3, 1:].tolist() == [1.0] * (D - 1)


def test_new_column_names_keep_trailing_nuls():
    import io

    from sharded_scan.workdir import named_arrays, with_objects, without_objects

    names = ["x\x00", "x", "y"]
    for r in runs(ss.Moments(), pd.DataFrame(pad([1.0, 2.0]), columns=names)):
        assert list(r.columns) == names and list(r.to_pandas().index) == names
        got, table = written_outputs(r)  # result.json, result.csv
        assert got["columns"] == names and table["column"].tolist() == names
        npz = io.BytesIO()
        np.savez(npz, **without_objects(named_arrays(r)))  # result.npz, as run_in_workdir writes it
        npz.seek(0)
        with np.load(npz) as back:
            assert with_objects({k: back[k] for k in back.files})["columns"].tolist() == names


def test_new_norm_l1_that_overflows_is_inf():
    # found by these properties (norm_l1_overflow), fixed:
    # the Kahan compensation of a sum that reached inf (inf - inf) is left out
    col = [1e308, 1e308, 1.0]
    for r in runs(ss.Moments(), pad(col)):
        assert r.norm_l1[0] == math.inf and r.norm_l2[0] == pytest.approx(math.hypot(*col), rel=1e-15), r
    for r in runs(ss.Moments(), pad(col, other=(-1e308, -1e308, -1.0)), nan_policy="omit"):  # the omitting fold
        assert r.norm_l1.tolist() == [math.inf] * D, r.norm_l1


def test_sum_that_overflows_stays_inf():
    # The Compensated wrapper's leaves: a compensation of inf - inf after the sum overflowed never makes it NaN.
    for r in runs(ss.Sum(), pad([1e308, 1e308, 1.0], other=(-1e308, -1e308, 1.0))):
        assert r.sum.tolist() == [math.inf] + [-math.inf] * (D - 1), r.sum


def test_result_csv_reads_back_with_a_cr_in_a_name():
    r = runs(ss.Moments(), pd.DataFrame(pad([1.0, 2.0]), columns=["a\rb", "c", "d"]))[-1]
    table = written_outputs(r)[1]
    assert table["column"].tolist() == ["a\rb", "c", "d"]
