"""64-bit integers and floats at their extremes, as numpy treats them (issue 42, findings 5-9).

Every run takes ``microbatch=1, steps_per_call=1`` on eight devices: whatever the row count, one step's shapes
(a larger micro-batch shrinks to the rows a device holds, a new program for each small row count), so each
combiner and dtype compiles once for the whole module. Each case runs in two layouts of those programs
(:func:`layouts`): its few rows as they are (row ``i`` on device ``i % 8``: a case of a few rows leaves
devices empty, their partials merged in) and each row repeated eight times (every device folds all the rows, in
order, as one device alone would: the fold that a ``data:1`` run checked, at no second mesh's compiles).
"""

import logging
import warnings

import ml_dtypes
import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan.dtypes import holds_subnormals

SMALL = {"microbatch": 1, "steps_per_call": 1, "mesh": "data:8"}
LAYOUTS = ["sparse", "repeated"]


def layouts(*arrays):
    """``arrays`` (rows of one job) as they are and with each row repeated eight times: row ``8 s + i`` goes to
    device ``i`` at step ``s``, so every device folds rows 0, 1, 2... in order, then the merge of eight."""
    return [arrays, tuple(np.repeat(a, 8, axis=0) for a in arrays)]


# The sketches sized to hold every row of these cases whose sketch is checked (at most 48), as their defaults (a KLL
# of k=8192, 4096 TopK slots, 2^14 DistinctCount registers) do: the same code, nothing compacted, evicted or
# estimated either way, but every step (one a row) and each merge of eight partials passes over the whole state
# whatever its rows. Describe's sketch is tests/test_properties.py's (k=128): here only its moments are checked.
TOPK = ss.TopK(k=3, capacity=64)
DISTINCT = ss.DistinctCount(precision=8)  # 256 registers, exact up to 256 distinct values
DESCRIBE = ss.Describe(k=128)
# The float statistics run on D float64 columns, as tests/test_properties.py's do: one program a combiner for every
# case here (a case of fewer columns is padded with ordinary ones, :func:`padded`), and the same programs as there.
D = 3


def padded(column, fill=(1.0, 2.0, 4.0)):
    """``column`` (``(n,)`` or ``(n, c)``, c <= D) as the first columns of ``(n, D)`` float64, the rest ordinary."""
    column = np.asarray(column, np.float64).reshape(len(column), -1)
    rest = np.resize(np.asarray(fill, np.float64), (len(column), D - column.shape[1]))
    return np.concatenate([column, rest], axis=1)


def run(combiner, x):
    return ss.run(combiner, x, **SMALL)


@pytest.mark.parametrize("layout", [0, 1], ids=LAYOUTS)
def test_uint64_values_come_back_as_uint64(layout):
    # finding 5: TopK of uint64 reported 2**64-1 as -1 and 2**63 as -2**63 (values read back as int64)
    (x,) = layouts(np.array([2**64 - 1] * 2 + [0, 1, 2**63, 2**63 + 5], np.uint64))[layout]
    top = run(TOPK, x)
    assert top.values.dtype == np.uint64
    assert top.values.tolist() == [2**64 - 1, 0, 1]
    assert top.to_pandas()["values"].dtype == np.uint64
    assert top.to_pandas()["values"].tolist() == [2**64 - 1, 0, 1]
    high = run(ss.Quantiles(qs=[0.0, 0.5, 0.9, 1.0], exact=True, method="higher"), x)
    assert high.quantiles.dtype == np.uint64
    assert high.quantiles.tolist() == np.quantile(x, [0.0, 0.5, 0.9, 1.0], method="higher").tolist()
    assert run(DISTINCT, x).count == 5


QS = [0.0, 0.25, 0.5, 0.7, 1.0]
INTS = np.array([2**62 + 1, 2**62 + 3, 2**62 + 5, -(2**63), 2**63 - 1], np.int64)


@pytest.mark.parametrize("layout", [0, 1], ids=LAYOUTS)
def test_exact_quantiles_of_integers_are_the_datas_own_integers(layout):
    # finding 6: method="lower" of int64 [2**62+1, 2**62+3, 2**62+5] gave 4.611686018427388e+18, not in the data
    x, keys = layouts(INTS, np.array([0, 0, 0, 2, 2]))[layout]
    for method in ("lower", "higher", "nearest", "inverted_cdf"):
        got = run(ss.Quantiles(qs=QS, exact=True, method=method), x).quantiles
        want = np.quantile(x, QS, method=method)
        assert got.dtype == np.int64 and want.dtype == np.int64, method
        assert got.tolist() == want.tolist(), method
    (first,) = layouts(INTS[:3])[layout]  # QS[2] is the median: the loop's program
    assert run(ss.Quantiles(qs=QS, exact=True, method="lower"), first).quantiles[2] == 2**62 + 3
    # per key too: a key that met no rows holds 0 (count 0), never turning the others to floats
    grouped = run(ss.GroupBy(ss.Quantiles(qs=[0.5], k=64, method="lower"), 3), (keys, x))
    assert grouped.quantiles.dtype == np.int64 and grouped.count.tolist() == [(keys == k).sum() for k in range(3)]
    assert grouped.quantiles[:, 0].tolist() == [2**62 + 3, 0, -(2**63)]
    for method in ("linear", "midpoint"):  # these mix two values: float64, as numpy's
        got = run(ss.Quantiles(qs=QS, exact=True, method=method), first).quantiles
        assert got.dtype == np.float64
        np.testing.assert_array_equal(got, np.quantile(first, QS, method=method))


@pytest.mark.parametrize("layout", [0, 1], ids=LAYOUTS)
def test_interpolated_quantile_of_int64_neighbours_further_apart_than_int64_is_between_them(layout):
    # numpy's b - a of int64 wraps: its median of [-2**63, 2**63 - 1] is 9.2e18, ours -0.5 to rounding
    (x,) = layouts(INTS[3:])[layout]
    for method in ("linear", "midpoint"):
        got = run(ss.Quantiles(qs=QS, exact=True, method=method), x).quantiles
        want = np.quantile(x.astype(object), QS, method=method).astype(np.float64)  # Python's ints do not wrap
        np.testing.assert_allclose(got, want, rtol=0, atol=2.0**12, err_msg=method)
        assert abs(got[2]) <= 2.0**11, (method, got)


def test_subnormal_rows_are_named_in_one_warning_never_a_silent_zero(caplog):
    # finding 7: XLA:CPU flushes subnormals to 0 (Moments' min, max and mean 0, a Sum of 0, every row in the
    # last bin of Histogram(4, (0, 4e-310))) and said nothing. It cannot keep them: one warning line says so.
    x = np.array([[1e-310], [2e-310], [3e-310]])
    with caplog.at_level(logging.WARNING, logger="sharded_scan.prefetch"):
        run(ss.Moments(), padded(x))
    lines = [r.getMessage() for r in caplog.records if r.name == "sharded_scan.prefetch"]
    assert len(lines) == 1 and "subnormal" in lines[0] and "flushes to 0" in lines[0], lines
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sharded_scan.prefetch"):
        # the sketches compare keys (bits), not floats: they keep them, exactly
        got = run(ss.Quantiles(qs=[0.0, 0.5, 1.0], exact=True, method="lower"), x)
        np.testing.assert_array_equal(got.quantiles, [[1e-310, 2e-310, 3e-310]])
        run(ss.Moments(), padded([1e-300, 2.2250738585072014e-308, 0.0, -0.0]))
    assert sum("subnormal" in r.getMessage() for r in caplog.records) == 1  # the Quantiles run's; none for normals
    assert holds_subnormals(np.array([1e-45], np.float32)) and holds_subnormals((np.zeros(2), np.array([-5e-324])))
    assert holds_subnormals(np.array([1e-39], ml_dtypes.bfloat16))
    tiny32 = np.finfo(np.float32).tiny
    normals = np.array([0.0, -0.0, tiny32, -tiny32, np.inf, -np.inf, np.nan, 3e38], np.float32)
    assert not holds_subnormals(normals) and not holds_subnormals(np.arange(5))


@pytest.mark.parametrize("layout", [0, 1], ids=LAYOUTS)
def test_a_constant_columns_variance_is_exactly_zero_at_any_magnitude(layout):
    # finding 8: NaN on data:8 with a few rows (an empty device's partial merged in: its far shift made delta inf)
    for n in (2, 3, 9, 17):
        column = np.full((n, D), 1e308)
        column[:, 1], column[:, 2] = -1e308, 3.5
        x, narrow = layouts(column, np.full((n, 1), 3e38, np.float32))[layout]
        moments = run(ss.Moments(), x)  # (ddof=0: the variance of a constant is 0 for every ddof, or NaN)
        np.testing.assert_array_equal(moments.var, [0.0] * D)
        np.testing.assert_array_equal(moments.mean, x[0])
        np.testing.assert_array_equal(run(ss.Covariance(), x).cov, np.zeros((D, D)))
        np.testing.assert_array_equal(run(ss.Moments(), narrow).var, [0.0])
        if n in (2, 17):  # Describe's std (ddof=1): its one-column Moments, merged alike
            described = run(DESCRIBE, x)
            np.testing.assert_array_equal(described.std, [0.0] * D)
            np.testing.assert_array_equal(described.mean, x[0])


@pytest.mark.parametrize("layout", [0, 1], ids=LAYOUTS)
def test_infinities_propagate_and_finite_means_stay_finite(layout):
    # finding 9: the mean of [inf, 1, 2] was NaN (numpy: inf), that of [1e308, 1e308, -1e308] -inf (3.3e307)
    # D columns a run: the infinities' three, then the huge and the ordinary columns beside the first
    x, keys = layouts(np.array([[np.inf, -np.inf, np.inf, 1e308, 3.0],
                                [1.0, 1.0, -np.inf, 1e308, 4.0],
                                [2.0, 2.0, 2.0, -1e308, 5.0]]), np.array([0, 1, 0]))[layout]
    infinite, finite = x[:, :D], x[:, [3, 4, 0]]
    got = run(ss.Moments(), infinite)
    with np.errstate(invalid="ignore", over="ignore"):
        np.testing.assert_array_equal(got.mean, infinite.mean(0))  # inf, -inf, NaN (numpy and pandas)
        np.testing.assert_array_equal(got.var, infinite.var(0))  # NaN
    np.testing.assert_array_equal(got.min, infinite.min(0))
    np.testing.assert_array_equal(got.max, infinite.max(0))
    got = run(ss.Moments(), finite)
    np.testing.assert_array_equal(got.min, finite.min(0))
    np.testing.assert_array_equal(got.max, finite.max(0))
    assert got.mean[0] == pytest.approx(1e308 / 3, rel=1e-15)  # numpy's own mean overflows here: inf
    assert got.var[0] == np.inf  # the true variance, 8.9e615, overflows: inf, not NaN
    assert got.mean[1] == 4.0 and got.var[1] == pytest.approx(2 / 3, rel=1e-15)
    described = run(DESCRIBE, infinite)
    np.testing.assert_array_equal(described.mean, [np.inf, -np.inf, np.nan])  # pandas' describe()
    assert run(DESCRIBE, finite).mean[0] == pytest.approx(1e308 / 3, rel=1e-15)
    finite = x[:, [3, 4, 4]]
    assert run(ss.Covariance(), finite).mean[0] == pytest.approx(1e308 / 3, rel=1e-15)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no numpy warning of inf - inf in the compensated sums
        keyed = run(ss.GroupBy(ss.Moments(), 4), (keys, finite))  # the per-key folds too (keys 2 and 3: no rows)
    assert keyed.mean[0, 0] == 0.0 and keyed.mean[1, 0] == 1e308 and keyed.mean[0, 1] == 4.0
    # rows far apart over many micro-batches and devices, float32 and float64: every merge and fold
    for big, dtype in ((1e308, np.float64), (3e38, np.float32)):
        column = np.array([big] * 40 + [-big] * 20, dtype)[:, None]
        (far,) = layouts(padded(column) if dtype == np.float64 else column)[layout]
        mean = run(ss.Moments(), far).mean[0]
        assert mean == pytest.approx(np.float64(far[0, 0]) / 3, rel=1e-6 if dtype == np.float32 else 1e-14)
