"""GroupBy and Weighted: per-key and weighted reductions against numpy per group."""

import numpy as np
import pytest

import sharded_scan as ss

K = 7
RUN = {"microbatch": 64, "steps_per_call": 2}  # one layout for every case: programs shared


def data(n=1000, seed=0):
    rng = np.random.default_rng(seed)
    keys = rng.zipf(1.5, n).astype(np.int32) % K
    x = rng.normal(size=(n, 3)).astype(np.float32)
    w = rng.random(n).astype(np.float32)
    w[::5] = 0
    return keys, x, w


def test_groupby_sum_is_numpy_per_key():
    keys, x, _ = data(997)
    r = ss.run(ss.GroupBy(ss.Sum(), K), (keys, x), **RUN)
    np.testing.assert_allclose(r.sum, np.stack([x[keys == k].sum(0) for k in range(K)]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(r.count, np.bincount(keys, minlength=K))
    np.testing.assert_array_equal(r.keys, np.arange(K))


def test_weighted_sum_is_np_average_parts_and_zero_weight_omits():
    keys, x, w = data()
    r = ss.run(ss.Weighted(ss.Sum()), (w, x), **RUN)
    np.testing.assert_allclose(r.sum / r.weight, np.average(x, axis=0, weights=w), rtol=1e-5)
    assert r.count == np.count_nonzero(w)
    g = ss.run(ss.GroupBy(ss.Weighted(ss.Sum()), K), (keys, (w, x)), **RUN)
    for k in range(K):
        np.testing.assert_allclose(g.sum[k], (w[keys == k, None] * x[keys == k]).sum(0), rtol=1e-5, atol=1e-5)
        assert g.result.count[k] == np.count_nonzero(w[keys == k])


def test_keys_out_of_range_are_one_line_or_an_other_row():
    keys, x, _ = data()
    bad = keys.copy()
    bad[[3, 10]] = [K, -2]
    with pytest.raises(ss.UsageError, match="2 rows have keys outside 0..6") as err:
        ss.run(ss.GroupBy(ss.Sum(), K), (bad, x), **RUN)
    assert "\n" not in str(err.value)
    r = ss.run(ss.GroupBy(ss.Sum(), K, out_of_range="other"), (bad, x), **RUN)
    assert r.keys[-1] == -1 and r.count[-1] == 2
    np.testing.assert_allclose(r.sum[-1], x[[3, 10]].sum(0), rtol=1e-6)
    inside = (bad >= 0) & (bad < K)
    np.testing.assert_array_equal(r.count[:K], np.bincount(bad[inside], minlength=K))


@pytest.mark.parametrize("combiner, rows, message", [
    (lambda: ss.GroupBy(ss.Sum(), 0), None, "num_keys must be a positive integer"),
    (lambda: ss.GroupBy(ss.Sum(), 3, out_of_range="drop"), None, "out_of_range must be one of"),
    (lambda: ss.Weighted(ss.Gradient(lambda p, x: x @ p, np.ones(3))),
     None, "takes no weights"),
    (lambda: ss.GroupBy(ss.Sum(), K), lambda k, x, w: (k.astype(np.float32), x), "keys must be integers"),
    (lambda: ss.GroupBy(ss.Sum(), K), lambda k, x, w: (np.stack([k, k], 1), x), "one integer a row"),
    (lambda: ss.GroupBy(ss.Sum(), K), lambda k, x, w: x, "runs on data \\(keys, data\\)"),
    (lambda: ss.Weighted(ss.Sum()), lambda k, x, w: (np.stack([w, w], 1), x), "one number a row"),
    (lambda: ss.Weighted(ss.Sum()), lambda k, x, w: (w[:-1], x), "different row counts"),
    (lambda: ss.Weighted(ss.Sum()), lambda k, x, w: (np.where(np.arange(w.size) == 4, -1, w), x),
     "1 rows have negative or non-finite weights \\(row 4"),
    (lambda: ss.Weighted(ss.Sum()), lambda k, x, w: (np.where(np.arange(w.size) == 4, np.inf, w), x),
     "negative or non-finite weights"),
])
def test_bad_inputs_are_one_line(combiner, rows, message):
    keys, x, w = data(50)
    with pytest.raises(ss.UsageError, match=message) as err:
        ss.run(combiner(), rows(keys, x, w), **RUN)
    assert "\n" not in str(err.value)
