"""Differential, property-based tests of the sketches and fits (issue 42 item 8): Quantiles (the sketch within its
stated ``rank_error``, ``exact=True`` exactly as ``np.quantile``), DistinctCount and TopK over floats, int64/uint64
extremes and unicode/NUL strings, LinearRegression and PCA against numpy, on eight devices, with the
``to_pandas()`` and result.json/result.csv round trips.

Generated data: tests/properties.py (fixed shapes: every example of a test reuses its compiled programs).
"""

import collections
import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import sharded_scan as ss
from tests.helpers import assert_usage_error
from tests.properties import RUN, D, check_round_trips, float_frames, kept_rows, kept_values, same_values
from tests.test_properties import mesh_name, pad, runs

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
QS = (0.0, 0.1, 0.5, 0.9, 1.0)
# The sketches sized to hold every row of these frames (at most 64; the rank-error property's k=16 is its own),
# as their defaults (a KLL of k=8192, 4096 TopK slots, 2^14 DistinctCount registers) do: the same code, nothing
# compacted, evicted or estimated either way, but a step and each merge of eight partials pass over the whole
# state whatever its rows, and the defaults' made these tests 5 to 15 times dearer a run.
K = 128
DISTINCT = ss.DistinctCount(precision=8)  # 256 registers a column, exact up to 256 distinct values
TOPK = ss.TopK(k=3, capacity=64)
METHODS = ("lower", "higher", "nearest", "linear", "midpoint", "inverted_cdf")

INT64 = np.iinfo(np.int64)
EXTREME_INTS = {
    np.int64: [INT64.min, INT64.min + 1, -1, 0, 1, 2**53 + 1, 2**62 + 1, 2**62 + 3, INT64.max - 1, INT64.max],
    np.uint64: [0, 1, 2**53 + 1, 2**63 - 1, 2**63, 2**63 + 1, 2**64 - 2, 2**64 - 1],
}


@st.composite
def int_frames(draw, dtype):
    """``(n, D)`` of ``dtype``: each column drawn from the type's extremes and a few small values (ties)."""
    n = draw(st.integers(1, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    pool = EXTREME_INTS[dtype]
    cols = []
    for _ in range(D):
        chosen = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=4, unique=True))
        cols.append(np.array(chosen, dtype=dtype)[rng.integers(0, len(chosen), n)])
    return np.stack(cols, axis=1)


def rank_distance(col: np.ndarray, answer: float, q: float) -> float:
    """How far, in shares of the rows, the ranks ``answer`` holds in sorted ``col`` are from ``q (n - 1)``."""
    n = len(col)
    lo, hi = int((col < answer).sum()), int((col <= answer).sum()) - 1
    t = q * (n - 1)
    return max(0.0, lo - t, t - hi) / n


@given(x=float_frames(max_rows=300), policy=st.sampled_from(["propagate", "omit"]))
def test_quantile_sketch_within_its_rank_error(x, policy):
    kept = [kept_values(x, j, policy) for j in range(D)]  # under "omit" each column's finite values
    for i, r in enumerate(runs(ss.Quantiles(qs=list(QS), k=16, method="lower"), x, nan_policy=policy)):
        assert np.array_equal(r.count, [len(c) for c in kept] if policy == "omit" else len(x))
        for j in range(D):
            col, at = kept[j], f"{mesh_name(i)} {policy} column {j} rows {len(kept[j])}"
            if not len(col) or np.isnan(col).any():
                assert np.isnan(r.quantiles[j]).all(), (at, r.quantiles[j])
                continue
            for q, answer in zip(QS, r.quantiles[j], strict=True):
                assert (col == answer).any(), f"{at}: q={q} answer {answer!r} is not a value of the column"
                dist = rank_distance(col, answer, q)
                assert dist <= float(r.rank_error) + 1 / len(col), f"{at}: q={q} {dist} > {r.rank_error}"
            if float(r.rank_error) == 0:
                assert same_values(r.quantiles[j], np.quantile(col, QS, method="lower")), at
        check_round_trips(r)
        assert r.to_pandas().shape == (D, len(QS))


def next_to_infinity(got, numpy_answers, lower, higher) -> np.ndarray:
    """Where an interpolated answer has an infinite neighbour, numpy's ``a + (b - a) t`` is itself inconsistent
    (NaN for ``[1, inf]``'s midpoint, inf for a midpoint of ``[..., 1.8e308, inf]``, NaN for ``[1, 2, inf]``'s
    median, which is 2): there numpy's answer, the limit (the infinite end; NaN between opposite infinities),
    the exact neighbour when the rank is whole, or NaN are each accepted. True where so."""
    ok = np.zeros(len(got), bool)
    for i, (g, w, a, b) in enumerate(zip(got, numpy_answers, lower, higher, strict=True)):
        if math.isinf(a) or math.isinf(b):
            limit = a if a == b else (math.nan if math.isinf(a) and math.isinf(b) else (a if math.isinf(a) else b))
            ok[i] = math.isnan(g) or same_values(g, w) or same_values(g, limit) or g in (a, b)
    return ok


# Whole ranks beside an infinity, where numpy's ``a + (b - a) t`` is NaN though the rank holds a value (found by
# HYPOTHESIS_PROFILE=long): [inf, -0.132]'s minimum, columns all +inf or all -inf.
INFINITE_NEIGHBOURS = np.array([[math.inf, math.inf, -math.inf], [-0.132, math.inf, -math.inf]])


@given(x=float_frames(), policy=st.sampled_from(["propagate", "omit"]), method=st.sampled_from(METHODS))
@example(x=INFINITE_NEIGHBOURS, policy="propagate", method="linear")
@example(x=INFINITE_NEIGHBOURS, policy="propagate", method="midpoint")
def test_exact_quantiles_are_numpys(x, policy, method):
    for i, r in enumerate(runs(ss.Quantiles(qs=list(QS), k=K, exact=True, method=method), x, nan_policy=policy)):
        for j in range(D):
            col = kept_values(x, j, policy)  # under "omit" the column's finite values
            at = f"{mesh_name(i)} {policy} {method} column {j} {col.tolist()!r}"
            if not len(col):
                assert np.isnan(r.quantiles[j]).all(), at
                continue
            want = np.quantile(col, QS, method=method)
            got = np.array(r.quantiles[j], np.float64)
            if method in ("linear", "midpoint") and not np.isnan(col).any():
                lower, higher = np.quantile(col, QS, method="lower"), np.quantile(col, QS, method="higher")
                # Finite neighbours further apart than the largest float: numpy's b - a overflows; ours is the
                # value between them, numpy's at a quarter of the scale (exact in binary) to rounding.
                apart = np.isfinite(lower) & np.isfinite(higher) & (lower != higher) & ~np.isfinite(want)
                if apart.any():
                    scale = np.abs(col[np.isfinite(col)]).max()
                    np.testing.assert_allclose(got[apart], 4 * np.quantile(col / 4, QS, method=method)[apart],
                                               rtol=0, atol=4 * np.finfo(float).eps * scale, err_msg=at)
                # A whole rank (both neighbours one value) is that value; numpy's NaN there is its formula's.
                whole = (lower == higher) & (got == lower)
                ok = next_to_infinity(got, want, lower, higher) | apart | whole
                got, want = got[~ok], want[~ok]
            if method in ("linear", "midpoint") and np.isfinite(want).all():
                scale = np.abs(col).max()
                np.testing.assert_allclose(got, want, rtol=0, atol=4 * np.finfo(float).eps * scale, err_msg=at)
            else:
                assert same_values(got, want), f"{at}: got {got!r}, numpy {want!r}"


@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
@given(data=st.data())
def test_exact_quantiles_of_64_bit_integers_are_the_datas_own(dtype, data):
    x = data.draw(int_frames(dtype))
    method = data.draw(st.sampled_from(METHODS))
    for i, r in enumerate(runs(ss.Quantiles(qs=list(QS), k=K, exact=True, method=method), x)):
        want = np.stack([np.quantile(x[:, j], QS, method=method) for j in range(D)])
        at = f"{mesh_name(i)} {method} {x.tolist()!r}"
        if method in ("linear", "midpoint"):
            assert r.quantiles.dtype == np.float64, at
            # numpy's b - a of int64 neighbours further apart than its largest wraps; Python's ints do not
            exact = np.stack([np.quantile(x[:, j].astype(object), QS, method=method) for j in range(D)])
            apart = np.stack([[dtype == np.int64 and int(b) - int(a) > INT64.max for a, b in zip(
                np.quantile(x[:, j], QS, method="lower"), np.quantile(x[:, j], QS, method="higher"), strict=True)]
                for j in range(D)])
            np.testing.assert_allclose(r.quantiles[apart], exact[apart].astype(np.float64), rtol=0,
                                       atol=16 * np.finfo(float).eps * 2.0**63, err_msg=at)
            np.testing.assert_allclose(r.quantiles[~apart], want[~apart], rtol=4e-16, err_msg=at)
            continue
        assert r.quantiles.dtype == dtype and r.quantiles.tolist() == want.tolist(), (at, r.quantiles)
        check_round_trips(r)


def distinct(col) -> int:
    """Distinct values as np.unique counts them: NaN one value, -0.0 equal to 0.0."""
    col = np.asarray(col)
    if col.dtype.kind == "f":
        return len(np.unique(col[~np.isnan(col)])) + int(np.isnan(col).any())
    return len(set(col.tolist()))


def check_topk(r, x: np.ndarray, k: int, at: str) -> None:
    """A TopKResult against the true counts of every column (``x`` numbers or Python strings; or a list of
    columns, each its values counted)."""
    for j in range(len(x) if isinstance(x, list) else x.shape[1]):
        col = (x[j] if isinstance(x, list) else x[:, j]).tolist()
        if not col:  # nothing counted
            assert (np.asarray(r.counts[j]) == 0).all(), at
            continue
        floats = isinstance(col[0], float)
        truth = collections.Counter("nan" if floats and math.isnan(v) else (v + 0.0 if floats else v) for v in col)
        listed = [(v, c) for v, c in zip(r.values[j].tolist(), r.counts[j].tolist(), strict=True) if c > 0]
        where = f"{at} column {j} listed {listed!r} truth {truth.most_common(k + 1)!r}"
        assert len(listed) == min(k, len(truth)), where
        assert [c for _, c in listed] == sorted((c for _, c in listed), reverse=True), where
        assert bool(r.certain[j]), where  # a few rows: the sketch holds every value
        for v, c in listed:
            key = "nan" if floats and math.isnan(v) else v
            assert truth[key] == c, f"{where}: {v!r} listed {c} times"
        if len(listed) == k:
            rest = max((c for v, c in truth.items() if v not in {("nan" if floats and math.isnan(u) else u)
                                                                  for u, _ in listed}), default=0)
            assert rest <= listed[-1][1], where
        assert (np.asarray(r.counts[j])[len(listed):] == 0).all(), where


@given(x=float_frames(), policy=st.sampled_from(["propagate", "omit"]))
def test_distinct_count_and_top_k_of_floats(x, policy):
    x = np.round(x, 1)  # ties; NaN, infinities, -0.0 and the extremes stay (subnormals become +-0)
    kept = kept_rows(x, policy)
    if policy == "omit":  # each NaN or inf skipped where it stands, the column's other values counted
        kept = [x[np.isfinite(x[:, j]), j] for j in range(D)]
    for i, (dc, tk) in enumerate(zip(runs(DISTINCT, x, nan_policy=policy),
                                     runs(TOPK, x, nan_policy=policy), strict=True)):
        at = f"{mesh_name(i)} {policy}"
        assert dc.count.tolist() == [distinct(np.asarray(kept[j] if policy == "omit" else kept[:, j]))
                                     for j in range(D)], (at, dc.count)
        assert dc.exact.all(), at
        assert tk.values.dtype == np.float64, at
        if len(kept):
            check_topk(tk, kept, 3, at)
        check_round_trips(dc)
        check_round_trips(tk)


@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
@given(data=st.data())
def test_distinct_count_and_top_k_of_64_bit_integers(dtype, data):
    x = data.draw(int_frames(dtype))
    for i, (dc, tk) in enumerate(zip(runs(DISTINCT, x), runs(TOPK, x), strict=True)):
        at = f"{mesh_name(i)} {x.tolist()!r}"
        assert dc.count.tolist() == [distinct(x[:, j]) for j in range(D)], at
        assert tk.values.dtype == dtype, at
        check_round_trips(tk)
        check_topk(tk, x, 3, at)


# Strings: a small vocabulary a column draws from (repeats), of any code point but lone surrogates (one line:
# test_finding14_...), words that differ only by trailing NULs too.
WORDS = st.lists(st.text(st.characters(blacklist_categories=("Cs",)), max_size=4), min_size=1, max_size=5,
                 unique=True)


@given(words=WORDS, seed=st.integers(0, 2**32 - 1), n=st.integers(1, 40))
def test_distinct_count_and_top_k_of_strings(words, seed, n):
    rng = np.random.default_rng(seed)
    cols = {name: [words[i] for i in rng.integers(0, len(words), n)] for name in ("s", "t")}
    df = pd.DataFrame(cols)
    for i, (dc, tk) in enumerate(zip(runs(DISTINCT, df), runs(TOPK, df), strict=True)):
        at = f"{mesh_name(i)} {cols!r}"
        assert dc.count.tolist() == [len(set(c)) for c in cols.values()], at
        assert list(tk.columns) == ["s", "t"]
        check_topk(tk, np.array(list(cols.values()), dtype=object).T, 3, at)
        check_round_trips(tk)
        table = tk.to_pandas()
        assert [v for v, c in zip(table["values"], table["counts"], strict=True) if c > 0] == [
            v for row, cs in zip(tk.values.tolist(), tk.counts.tolist(), strict=True)
            for v, c in zip(row, cs, strict=True) if c > 0]


@st.composite
def regression_data(draw):
    """``(x, y)``: three well-conditioned columns of distinct scales, y linear in them plus noise, then up to
    three cells of x set to NaN or an infinity."""
    n = draw(st.integers(8, 64))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = rng.normal(size=(n, D)) * [3.0, 1.0, 0.3] + rng.normal(size=D) * 10
    y = x @ [1.5, -2.0, 4.0] + 7.0 + 0.1 * rng.normal(size=n)
    for _ in range(draw(st.integers(0, 3))):
        x[draw(st.integers(0, n - 1)), draw(st.integers(0, D - 1))] = draw(st.sampled_from([math.nan, math.inf]))
    return x, y


@given(data=regression_data(), policy=st.sampled_from(["propagate", "omit"]))
def test_linear_regression_and_pca_match_numpy(data, policy):
    x, y = data
    finite = np.isfinite(x).all(axis=1)
    keep = finite if policy == "omit" else np.ones(len(x), bool)
    xk, yk = x[keep], y[keep]
    if not np.isfinite(xk).all():  # propagate over rows holding NaN or inf: NaN, never a finite wrong number
        for fit, pca in zip(runs(ss.LinearRegression(), (x, y)), runs(ss.PCA(k=2), x), strict=True):
            assert np.isnan(fit.coef).all() and np.isnan(pca.components).all(), (fit.coef, pca.components)
        return
    if len(xk) == 0:
        assert_usage_error(lambda: ss.run(ss.LinearRegression(), (x, y), nan_policy=policy, **RUN), ["rows"])
        return
    fits, pcas = runs(ss.LinearRegression(), (x, y), nan_policy=policy), runs(ss.PCA(k=2), x, nan_policy=policy)
    for i, (fit, pca) in enumerate(zip(fits, pcas, strict=True)):
        at = f"{mesh_name(i)} {policy} rows {len(xk)}"
        if len(xk) < 8:
            continue
        a = np.c_[xk, np.ones(len(xk))]
        want = np.linalg.lstsq(a, yk, rcond=None)[0]
        np.testing.assert_allclose(fit.coef, want[:D], rtol=1e-8, atol=1e-8, err_msg=at)
        np.testing.assert_allclose(fit.intercept, want[D], rtol=1e-8, atol=1e-7, err_msg=at)
        assert int(fit.rank) == D, at
        resid = yk - a @ want
        r2 = 1 - resid @ resid / ((yk - yk.mean()) @ (yk - yk.mean()))
        np.testing.assert_allclose(fit.r2, r2, rtol=1e-9, err_msg=at)
        values, vectors = np.linalg.eigh(np.cov(xk, rowvar=False))
        order = np.argsort(values)[::-1][:2]
        np.testing.assert_allclose(pca.explained_variance, values[order], rtol=1e-8, err_msg=at)
        np.testing.assert_allclose(np.abs(np.sum(pca.components * vectors[:, order].T, axis=1)), 1, rtol=1e-8,
                                   err_msg=at)
        np.testing.assert_allclose(pca.mean, xk.mean(axis=0), rtol=1e-10, err_msg=at)
    check_round_trips(fits[-1])
    check_round_trips(pcas[-1])


@given(x=float_frames(min_rows=2), seed=st.integers(0, 2**32 - 1), policy=st.sampled_from(["propagate", "omit"]))
def test_weighted_quantiles_and_grouped_top_k(x, seed, policy):
    """``Weighted(Quantiles(method="inverted_cdf"))`` is ``np.quantile(weights=)`` (a few rows: nothing rounded);
    ``GroupBy(TopK(k=3), 4)`` is TopK of each key's rows."""
    rng = np.random.default_rng(seed)
    w = rng.choice([0.0, 0.25, 1.0, 3.0], len(x))
    w[0] = 1.0
    keys = rng.integers(0, 4, len(x)).astype(np.int32)
    x = np.round(x, 1)
    weighted = [ss.run(ss.Weighted(ss.Quantiles(qs=list(QS), k=K, method="inverted_cdf")), (w, x), nan_policy=policy,
                       **RUN)]
    grouped = [ss.run(ss.GroupBy(TOPK, 4), (keys, x), nan_policy=policy, **RUN)]
    finite = kept_rows(np.c_[w, x], policy)
    for r, g in zip(weighted, grouped, strict=True):
        at = f"data:8 {policy}"
        wk, xk = finite[:, 0], finite[:, 1:]
        for j in range(D):
            col, wj = xk[wk > 0, j], wk[wk > 0]
            if policy == "omit":  # per column: a row's weight counts where the column's value is finite
                m = np.isfinite(x[:, j]) & (w > 0)
                col, wj = x[m, j], w[m]
            where = f"{at} column {j} {col.tolist()!r} weights {wj.tolist()!r}"
            if not len(col) or np.isnan(col).any():
                assert np.isnan(r.quantiles[j]).all(), (where, r.quantiles[j])
                continue
            assert float(r.rank_error) == 0, where
            want = np.quantile(col, QS, weights=wj, method="inverted_cdf")
            assert same_values(r.quantiles[j], want), f"{where}: got {r.quantiles[j]!r}, numpy {want!r}"
        for key in range(4):
            rows = x[keys == key]
            inner = type(g.result)(*(f[key] if name not in ("columns", "sketch") else f
                                     for name, f in g.result._asdict().items()))
            if len(rows):  # under "omit" each NaN or inf skipped where it stands
                check_topk(inner, [rows[np.isfinite(rows[:, j]), j] for j in range(D)] if policy == "omit" else rows,
                           3, f"{at} key {key}")
            else:
                assert (inner.counts == 0).all(), (at, key, inner.counts)
        check_round_trips(r)
        check_round_trips(g)


# --- the findings these properties met, pinned (a strict xfail where one is still open) ---------


def test_finding6_exact_quantiles_of_int64_are_int64():
    x = np.array([[2**62 + 1] * D, [2**62 + 3] * D, [2**62 + 5] * D], np.int64)
    for r in runs(ss.Quantiles(qs=list(QS), k=K, exact=True, method="lower"), x):
        assert r.quantiles.dtype == np.int64 and r.quantiles[0, 2] == 2**62 + 3


def test_finding5_top_k_of_uint64_is_uint64():
    x = np.array([[2**64 - 1] * D, [2**64 - 1] * D, [0] * D, [1] * D, [2**63] * D], np.uint64)
    for r in runs(TOPK, x):
        assert r.values.dtype == np.uint64 and r.values[0, 0] == 2**64 - 1


def test_finding10_trailing_nuls_survive_in_top_k():
    df = pd.DataFrame({"s": ["a", "a", "a\x00", "b"], "t": ["x"] * 4})
    for r in runs(TOPK, df):
        assert sorted(r.values[0].tolist()) == ["a", "a\x00", "b"]


def test_finding14_lone_surrogate_is_one_line():
    # object columns: pandas' own string dtype refuses a lone surrogate before the run sees it
    df = pd.DataFrame({"s": pd.Series(["a\ud800", "b"], dtype=object), "t": pd.Series(["x", "y"], dtype=object)})
    try:
        r = ss.run(TOPK, df, **RUN)
    except ss.UsageError as e:
        assert "\n" not in str(e)
    else:
        assert "a\ud800" in r.values[0].tolist()


def test_finding4_regression_and_pca_under_propagate_are_nan():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, D))
    y = x @ [1.0, 2.0, 3.0]
    x[3, 0] = math.nan
    for fit, pca in zip(runs(ss.LinearRegression(), (x, y)), runs(ss.PCA(k=2), x), strict=True):
        assert np.isnan(fit.coef).all() and np.isnan(pca.components).all(), (fit.coef, pca.components)


def test_finding12_grouped_and_weighted_top_k_of_strings():
    df = pd.DataFrame({"s": ["a", "b", "a", "c"], "t": ["x"] * 4})
    keys, w = np.array([0, 0, 1, 1], np.int32), np.array([1.0, 2.0, 1.0, 0.5])
    for g, r in zip(runs(ss.GroupBy(TOPK, 2), (keys, df)), runs(ss.Weighted(TOPK), (w, df)),
                    strict=True):
        assert g.result.values[0, 0].tolist()[:2] == ["a", "b"] or sorted(g.result.values[0, 0][:2]) == ["a", "b"]
        assert r.values[0, 0] == "b" and r.counts[0, 0] == 2.0


def test_new_interpolated_quantile_whose_neighbours_differ_past_the_largest_float_is_finite():
    # found by these properties (quantile_interp_overflow), fixed:
    # where b - a overflows, a (1 - t) + b t (numpy answers -inf here)
    col = [1.7976931348623157e308, -5.359575662188025e306]
    for r in runs(ss.Quantiles(qs=list(QS), k=K, exact=True, method="midpoint"), pad(col)):
        assert r.quantiles[0, 1:4].tolist() == [col[0] / 2 + col[1] / 2] * 3, r.quantiles[0]
