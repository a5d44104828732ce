"""64-bit values keyed exactly: Quantiles, DistinctCount and TopK of float64, int64 and uint64 data
with no flag, against numpy; values float32 cannot tell apart and ids equal in their low 32 bits."""

import jax
import numpy as np
import pytest

import sharded_scan as ss

QS = [0.0, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0]
# One device: the 64-bit keys' encodings, sorts, compactions and hashes are the subject here, and one device's
# programs compile in about two thirds of eight's (no merges over devices). The same sketches of 64-bit values
# merged over 8 devices: test_float_extremes (uint64 and int64 limits on data:1 and data:8).
ONE = "data:1"


def lower(x, qs=QS):
    """numpy's answer: ``(d, len(qs))`` float64."""
    return np.quantile(x, qs, axis=0, method="lower").T.astype(np.float64)


def floats_past_float32(n, rng):
    """Columns whose values differ only past float32's precision, and across the whole float64 range."""
    close = 1.0 + rng.permutation(n) * 2.0**-40  # float32 rounds every one of them to 1.0
    wide = rng.choice([-1e300, -3.5, -5e-324, -0.0, 0.0, 5e-324, 1e-310, 2.5, 1e300], n) * (1 + rng.random(n) * 1e-12)
    return np.stack([close, wide], axis=1)


def test_quantiles_of_float64_values_that_float32_would_merge():
    x = floats_past_float32(3000, np.random.default_rng(0))
    got = ss.run(ss.Quantiles(qs=QS, method="lower"), x, mesh=ONE, microbatch=256)
    assert float(got.rank_error) == 0.0  # nothing compacted: the sketch holds every row
    np.testing.assert_array_equal(got.quantiles, lower(x))


def test_exact_quantiles_of_float64_int64_and_uint64_after_compaction():
    rng = np.random.default_rng(1)
    n = 4000
    cases = {
        "float64": 1.0 + rng.normal(size=(n, 1)) * 2.0**-30,
        "int64": (rng.integers(0, 1000, (n, 1)) << 33) - (1 << 40) + rng.integers(0, 3, (n, 1)),  # equal low halves
        "uint64": np.uint64(1 << 63) + rng.integers(0, 1 << 20, (n, 1)).astype(np.uint64) * np.uint64(3 << 40),
    }
    passes = []
    for name, x in cases.items():  # bits=8: a run's refining passes share one compiled program (their boundaries
        # are operands), so 8 bits' extra passes (10 over the three dtypes, 7 at 12 bits) cost only their reads
        got = ss.run(ss.Quantiles(qs=QS, k=16, exact=True, bits=8, method="lower"), x, mesh=ONE, microbatch=512)
        assert int(got.passes) > 1, name  # the sketch compacted: refining passes ran
        np.testing.assert_array_equal(got.quantiles, lower(x), err_msg=name)
        passes.append(int(got.passes))
    assert max(passes) > 2, passes  # a bracket of 64-bit keys narrowed by one pass and closed by the next


def test_exact_linear_quantiles_of_float64_values_that_float32_would_merge():
    x = floats_past_float32(3002, np.random.default_rng(6))
    qs = [0.0, 0.001, 0.1, 0.3, 0.5, 0.77, 0.999, 1.0]  # h = q (n - 1) mostly between two ranks
    got = ss.run(ss.Quantiles(qs=qs, k=16, exact=True, bits=8, method="linear"), x, mesh=ONE, microbatch=256)
    assert int(got.passes) > 1  # the sketch compacted: refining passes ran
    want = np.quantile(x, qs, axis=0, method="linear").T
    assert not np.array_equal(want, lower(x, qs))  # the weights matter: not the lower ranks' values
    np.testing.assert_array_equal(got.quantiles, want)


def test_distinct_count_of_int64_ids_past_two_to_the_32():
    ids = (np.arange(5000, dtype=np.int64) << 33) | 12345  # one value in their low 32 bits
    for x, count in ((ids, 5000), (ids % 7, 7)):  # the default (exact up to 2^14) and the micro-batch of the int64
        got = ss.run(ss.DistinctCount(), x, mesh=ONE, microbatch=4096)  # estimates' below: their program
        assert int(got.count) == count and bool(got.exact)


def test_distinct_count_estimates_64_bit_values_within_its_error():
    rng = np.random.default_rng(2)
    ids = rng.integers(1 << 40, 1 << 62, 60_000)  # past the default's exact 2^14 values: the estimate
    floats = 1e9 + np.arange(60_000) * 1e-3  # keyed in 32 bits these were counted as 2
    for x in (ids, floats, ids.astype(np.uint64) << np.uint64(1)):
        want = len(np.unique(x))
        got = ss.run(ss.DistinctCount(), x, mesh=ONE, microbatch=4096)
        assert not got.exact
        assert abs(int(got.count) / want - 1) < 5 * float(got.relative_error), (x.dtype, int(got.count), want)


def test_distinct_count_compares_float64_as_np_unique():
    x = np.array([0.0, -0.0, np.nan, np.nan, 1.0, 1.0 + 2.0**-52, 1.0, -np.inf, np.inf])
    # two columns of 270 rows at micro-batch 256: the program of test_under_the_global_flag_...'s DistinctCount
    got = ss.run(ss.DistinctCount(exact_up_to=64), np.stack([np.tile(x, 30), np.tile(x[::-1], 30)], 1), mesh=ONE,
                 microbatch=256)
    assert got.count.tolist() == [len(np.unique(x))] * 2 == [6, 6] and got.exact.all()


def test_topk_of_int64_ids_equal_in_their_low_32_bits():
    rng = np.random.default_rng(3)
    ids = (rng.zipf(1.5, 30_000).astype(np.int64) << 35) + 7
    x = np.stack([ids, -ids], axis=1)
    got = ss.run(ss.TopK(k=5, capacity=4096), x, mesh=ONE, microbatch=1024)
    for j in range(2):
        values, counts = np.unique(x[:, j], return_counts=True)
        order = np.lexsort((values, -counts))[:5]  # most frequent first, ties: smaller value first
        np.testing.assert_array_equal(got.values[j], values[order].astype(np.float64))
        np.testing.assert_array_equal(got.counts[j], counts[order])
    assert got.certain.all()


def test_topk_of_float64_values_float32_would_merge():
    x = np.repeat(1.0 + np.arange(6) * 2.0**-40, [3, 150, 6, 120, 9, 90])  # 378 rows
    x = np.random.default_rng(4).permutation(x)
    # two columns at micro-batch 256, 64 slots for every value, as the default's 4096: the program of
    # test_under_the_global_flag_...'s TopK
    got = ss.run(ss.TopK(k=4, capacity=64), np.stack([x, x[::-1]], 1), mesh=ONE, microbatch=256)
    for j in range(2):
        np.testing.assert_array_equal(got.values[j], 1.0 + np.array([1, 3, 5, 4]) * 2.0**-40)
        np.testing.assert_array_equal(got.counts[j], [150, 120, 90, 9])


def test_under_the_global_flag_the_sketches_give_the_same_answers():
    rng = np.random.default_rng(5)
    x = floats_past_float32(5000, rng)
    # k=16 at micro-batch 256: the sketch pass the exact linear case above compiled (its first pass)
    combiners = [ss.Quantiles(qs=QS, k=16), ss.DistinctCount(exact_up_to=64), ss.TopK(k=4, capacity=64)]
    scoped = [ss.run(c, x, mesh=ONE, microbatch=256) for c in combiners]
    with jax.enable_x64(True):  # what jax_enable_x64 set at start-up gives, in this thread
        flagged = [ss.run(c, x, mesh=ONE, microbatch=256) for c in combiners]
    for a, b in zip(scoped, flagged, strict=True):
        for field in a._fields:
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)


@pytest.mark.parametrize("dtype, keys", [(np.float32, np.uint32), (np.int32, np.uint32), (np.bool_, np.uint32),
                                         (np.float64, np.uint64), (np.int64, np.uint64), (np.uint64, np.uint64)])
def test_only_64_bit_values_take_64_bit_keys(dtype, keys):
    spec = jax.ShapeDtypeStruct((3,), dtype)
    with jax.enable_x64(np.dtype(dtype).itemsize == 8):  # as a run scopes it
        quantiles = jax.eval_shape(ss.Quantiles(qs=[0.5]).init, spec)
        distinct = jax.eval_shape(ss.DistinctCount(exact_up_to=4).init, spec)
        topk = jax.eval_shape(ss.TopK().init, spec)
    for held in (quantiles.sketch.items, quantiles.low, quantiles.high, distinct.keys, topk.keys):
        assert held.dtype == keys
