"""Weighted and per-key sketches (Quantiles, TopK, DistinctCount) against numpy and pandas, within their bounds."""

import numpy as np
import pandas as pd
import pytest

import sharded_scan as ss

K = 5
# One layout for every case: programs shared. One device: its programs compile in about two thirds of two's; these
# sketches merged over 8 devices: test_nan_omit (GroupBy of Quantiles and of Weighted(Quantiles)), test_properties_
# sketches (Weighted(Quantiles), GroupBy(TopK)), test_strings_exact and test_columns (TopK, DistinctCount on data:2).
RUN = {"microbatch": 64, "steps_per_call": 2, "mesh": "data:1"}
QS = np.linspace(0, 1, 21)


def data(n=1500, seed=0):
    rng = np.random.default_rng(seed)
    keys = (rng.zipf(1.5, n) % K).astype(np.int32)
    x = np.column_stack([rng.standard_normal(n), rng.lognormal(0, 2, n)]).astype(np.float32)
    ids = np.column_stack([rng.zipf(1.4, n) % 300, rng.integers(0, 40, n)]).astype(np.int32)
    w = rng.exponential(1, n).astype(np.float32)
    w[::7] = 0
    w[::13] *= 40  # a few heavy rows
    return keys, x, ids, w


def weight_share_errors(x, w, got, qs):
    """Per column, how far the share of weight at or below each answer (and below it) is from ``q``."""
    out = []
    for j in range(x.shape[1]):
        order = np.argsort(x[:, j])
        xs, ws = x[order, j].astype(np.float64), w[order].astype(np.float64)
        upto = np.cumsum(ws) / ws.sum()
        below = np.concatenate([[0.0], upto])[np.searchsorted(xs, got[j], "left")]
        at = upto[np.searchsorted(xs, got[j], "right") - 1]
        out.append(np.maximum(0, np.maximum(below - qs, qs - at)).max())
    return np.array(out)


def weighted_quantiles(x, w, qs):
    keep = w > 0
    return np.stack([np.quantile(x[keep, j].astype(np.float64), qs, weights=w[keep].astype(np.float64),
                                 method="inverted_cdf") for j in range(x.shape[1])])


WEIGHTED = ss.Weighted(ss.Quantiles(qs=QS, k=256, method="inverted_cdf"))


def test_weighted_quantiles_are_numpy_inverted_cdf_exactly_uncompacted_and_within_the_bound_compacted():
    _, x, _, w = data()
    # fewer rows than k: nothing rounded; more than one step's 2 x 64 rows, so RUN's layout and its programs
    small = ss.run(WEIGHTED, (w[:200], x[:200]), **RUN)
    np.testing.assert_array_equal(small.quantiles, weighted_quantiles(x[:200], w[:200], QS))
    assert small.rank_error == 0 and small.count == np.count_nonzero(w[:200])
    sketch = ss.run(WEIGHTED, (w, x), **RUN)
    errors = weight_share_errors(x[w > 0], w[w > 0], sketch.quantiles, QS)
    assert 0 < sketch.rank_error < 0.5 and np.all(errors <= sketch.rank_error), (errors, sketch.rank_error)
    np.testing.assert_array_equal(sketch.quantiles[:, [0, -1]], weighted_quantiles(x, w, [0, 1]))


def test_weighted_exact_quantiles_are_numpy_inverted_cdf_after_compaction_with_ties():
    _, x, ids, w = data()
    x = np.column_stack([x[:, 0], ids[:, 1]]).astype(np.float32)  # and an integer column of many ties
    qs = np.array([0, 0.001, 0.1, 0.37, 0.5, 0.9, 0.999, 1])
    got = ss.run(ss.Weighted(ss.Quantiles(qs=qs, k=256, method="inverted_cdf", exact=True)), (w, x), **RUN)
    np.testing.assert_array_equal(got.quantiles, weighted_quantiles(x, w, qs))
    assert got.rank_error == 0 and 2 <= got.passes <= 4


def test_weighted_topk_is_pandas_groupby_sum_within_its_errors():
    _, _, ids, w = data()
    got = ss.run(ss.Weighted(ss.TopK(k=4, capacity=64)), (w, ids), **RUN)
    for j in range(2):
        sums = pd.Series(w.astype(np.float64)).groupby(ids[:, j]).sum()
        truth = sums.reindex(got.values[j]).to_numpy()
        high = got.counts[j] + got.errors[j]
        assert np.all(got.counts[j] <= truth * (1 + 1e-6)) and np.all(truth <= high * (1 + 1e-6))
        if got.certain[j]:
            np.testing.assert_array_equal(got.values[j], sums.sort_values(ascending=False).index[:4])
        assert sums.drop(got.values[j]).max() <= got.bound[j] * (1 + 1e-6)
    assert got.certain[0]


ONE_PASS = r"GroupBy runs its inner combiner in one pass, and (Quantiles|Weighted) .*reads the data several times"


def test_weighted_forms_refuse_what_they_cannot_answer():
    with pytest.raises(ss.UsageError, match="method='inverted_cdf'") as err:
        ss.Weighted(ss.Quantiles(qs=[0.5]))
    assert "\n" not in str(err.value)
    with pytest.raises(ss.UsageError, match="DistinctCount takes no weights"):
        ss.Weighted(ss.DistinctCount())
    keys, x, _, w = data(100)
    for per_key, rows in [(ss.Quantiles(qs=[0.5], exact=True), x),
                          (ss.Weighted(ss.Quantiles(qs=[0.5], exact=True, method="inverted_cdf")), (w, x))]:
        with pytest.raises(ss.UsageError, match=ONE_PASS) as err:
            ss.run(ss.GroupBy(per_key, K), (keys, rows), **RUN)
        assert "\n" not in str(err.value)


def test_per_key_sketches_are_pandas_groupby_within_their_bounds():
    keys, x, ids, w = data()
    q = ss.run(ss.GroupBy(ss.Quantiles(qs=QS, k=32, method="lower"), K), (keys, x), **RUN)
    t = ss.run(ss.GroupBy(ss.TopK(k=3, capacity=32), K), (keys, ids), **RUN)
    # One run for both answers: a key's column of at most 64 values is counted exactly, one of more estimated.
    d = ss.run(ss.GroupBy(ss.DistinctCount(precision=8, exact_up_to=64), K), (keys, ids), **RUN)
    frame = pd.DataFrame({"key": keys, "a": ids[:, 0], "b": ids[:, 1]})
    nunique = frame.groupby("key")[["a", "b"]].nunique().to_numpy()
    np.testing.assert_array_equal(d.result.exact, nunique <= 64)
    assert d.result.exact.any() and not d.result.exact.all()  # both: the exact counts and the estimates
    np.testing.assert_array_equal(d.count[d.result.exact], nunique[d.result.exact])
    for k in range(K):
        mine = keys == k
        assert np.all(rank_errors(x[mine], q.quantiles[k]) <= q.rank_error[k]), k
        if q.rank_error[k] == 0:
            np.testing.assert_array_equal(q.quantiles[k], np.quantile(x[mine], QS, axis=0, method="lower").T)
        assert q.count[k] == mine.sum()
        for j in range(2):
            counts = pd.Series(ids[mine, j]).value_counts()
            truth = counts.reindex(t.values[k, j]).fillna(0).to_numpy()
            assert np.all(t.counts[k, j] <= truth) and np.all(truth <= t.counts[k, j] + t.errors[k, j])
            if not d.result.exact[k, j]:
                assert abs(d.result.count[k, j] - counts.size) <= 4 * d.relative_error[k, j] * counts.size + 2
    weighted = ss.run(ss.GroupBy(WEIGHTED, K), (keys, (w, x)), **RUN)
    for k in range(K):
        mine = (keys == k) & (w > 0)
        errors = weight_share_errors(x[mine], w[mine], weighted.quantiles[k], QS)
        assert np.all(errors <= weighted.rank_error[k]), k
        if weighted.rank_error[k] == 0:
            np.testing.assert_array_equal(weighted.quantiles[k], weighted_quantiles(x[mine], w[mine], QS))


def rank_errors(x, got):
    """The largest distance from ``q (n - 1)`` to the ranks of each answer, over ``n``, per column."""
    out = []
    for j in range(x.shape[1]):
        xs = np.sort(x[:, j].astype(np.float64))
        below, upto = np.searchsorted(xs, got[j], "left"), np.searchsorted(xs, got[j], "right")
        target = QS * (len(xs) - 1)
        out.append(np.maximum(0, np.maximum(below - target, target - (upto - 1))).max() / len(xs))
    return np.array(out)
