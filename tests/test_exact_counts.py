"""Wide integers (int32 limbs): exact counts past 2^31 in the step, the merge and finalize."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import sharded_scan as ss
from sharded_scan.combiners import wide
from tests.helpers import run_x64


def test_counts_past_two_to_the_31_add_and_merge_exactly():
    big = wide.add_int32(wide.zeros(), jnp.int32(1_500_000_000))
    big = wide.add_int32(big, jnp.int32(2**31 - 1))          # 3.6e9 in one accumulator
    assert int(wide.to_int(big)) == 1_500_000_000 + 2**31 - 1
    merged = wide.Wide(big.limbs + big.limbs)                 # what a psum of two partials does
    assert int(wide.to_int(merged)) == 2 * (1_500_000_000 + 2**31 - 1)
    assert int(wide.to_int(wide.normalize(merged))) == int(wide.to_int(merged))


def test_random_signed_sums_match_python_ints():
    rng = np.random.default_rng(0)
    values = rng.integers(-(2**31), 2**31, size=(500, 3), dtype=np.int64)
    acc = wide.zeros((3,))
    add = jax.jit(wide.add_int32)  # one program for the 500 adds, not each op of each add dispatched alone
    for row in values:
        acc = add(acc, jnp.asarray(row.astype(np.int32)))
        assert int(np.max(acc.limbs[..., :-1])) < 2**16 and int(np.min(acc.limbs[..., :-1])) >= 0
    want = [sum(int(v) for v in values[:, j]) for j in range(3)]
    assert wide.to_int(acc).tolist() == want
    np.testing.assert_allclose(np.asarray(wide.to_float(acc)), want, rtol=1e-6)


def test_a_value_past_int64_comes_back_as_python_ints():
    limbs = np.array([0, 0, 0, 2**20], np.int32)              # 2^68
    assert wide.to_int(limbs).item() == 2**68


@dataclasses.dataclass(frozen=True)
class RowCount(ss.AdditiveCombiner):  # a user's own combiner: the public ss.counts
    def init(self, spec):
        return ss.counts.zeros()

    def add(self, acc, batch, mask):
        return ss.counts.count_rows(acc, mask)

    def finalize(self, acc):
        return ss.counts.to_int(acc)


def test_compensated_psum_and_ordered_merges_keep_the_count_exact():
    x = np.ones((10_007, 2), np.float32)
    for options in ({}, {"compensated": False}, {"logical_shards": 8}, {"mesh": "data:3"}):
        assert int(ss.run(RowCount(), x, microbatch=64, steps_per_call=2, **options)) == 10_007, options


def test_compensated_add_keeps_limbs_normalised():
    from sharded_scan.combiners.wrappers.policies import Compensated

    comb = Compensated(RowCount())
    spec = jax.ShapeDtypeStruct((2,), jnp.float32)
    acc = comb.init(spec)
    add = jax.jit(comb.add)
    for _ in range(70):  # 70 * 1000 rows: limb 0 would pass 2^16 without the carry
        acc = add(acc, jnp.ones((1000, 2)), jnp.ones((1000,), bool))
    assert int(acc.value.limbs[0]) < 2**16
    assert int(comb.finalize(jax.tree.map(np.asarray, acc))) == 70_000


# Accumulators built directly with counts near 2^31: merges must not wrap anywhere.
NEAR = 2**31 - 5


def _count(n):
    return wide.add_int32(wide.add_int32(wide.zeros(), jnp.int32(n // 2)), jnp.int32(n - n // 2))


def test_sum_counts_near_two_to_the_31_merge_exactly():
    from sharded_scan.combiners.wrappers.policies import Compensated

    spec = jax.ShapeDtypeStruct((2,), jnp.float32)
    for combiner in (ss.Sum(), Compensated(ss.Sum())):
        acc = combiner.init(spec)
        value = acc.value if isinstance(combiner, Compensated) else acc
        big = value._replace(count=_count(NEAR))
        acc = acc._replace(value=big) if isinstance(combiner, Compensated) else big
        merged = combiner.merge(combiner.merge(acc, acc), acc)
        assert int(combiner.finalize(jax.device_get(merged)).count) == 3 * NEAR


def test_centred_statistics_merge_counts_near_two_to_the_31():
    spec = jax.ShapeDtypeStruct((1,), jnp.float32)
    for combiner in (ss.Covariance(), ss.Moments()):
        acc = combiner.init(spec)
        centered = acc if isinstance(combiner, ss.Covariance) else acc.centered
        a = centered._replace(count=_count(NEAR), mean=centered.mean + 1.0)
        b = centered._replace(count=_count(NEAR), mean=centered.mean + 3.0)
        if isinstance(combiner, ss.Moments):
            a, b = acc._replace(centered=a), acc._replace(centered=b)
        got = combiner.finalize(jax.device_get(jax.jit(combiner.merge)(a, b)))  # one program, not op by op
        assert int(got.count) == 2 * NEAR
        np.testing.assert_allclose(got.mean, [2.0], rtol=1e-6)
        spread = got.cov[0, 0] if isinstance(combiner, ss.Covariance) else got.var[0]
        want = 2 * NEAR / (2 * NEAR - combiner.ddof)  # (delta² na nb / n) / (n - ddof), delta = 2
        np.testing.assert_allclose(spread, want, rtol=1e-5)


def test_histogram_and_gradient_counts_near_two_to_the_31_merge_exactly():
    spec = jax.ShapeDtypeStruct((2,), jnp.float32)
    hist = ss.Histogram(3, (0, 1))
    acc = wide.add_int32(hist.init(spec), jnp.int32(NEAR))
    assert (hist.finalize(jax.device_get(hist.merge(acc, acc))).counts == 2 * NEAR).all()
    grad = ss.Gradient(lambda p, x: x @ p, np.ones(2, np.float32))
    acc = grad.init(spec)._replace(count=_count(NEAR))
    assert int(grad.finalize(jax.device_get(grad.merge(acc, acc))).count) == 2 * NEAR


def test_integer_sums_are_exact_and_integer():
    rng = np.random.default_rng(1)
    big = rng.integers(-(2**31), 2**31, size=(70_001, 2), dtype=np.int64).astype(np.int32)
    flags = big > 0
    x = np.arange(2**24, 2**24 + len(big), dtype=np.int32)  # one column: float32 would round this sum
    for options in ({"microbatch": 40_000, "mesh": "data:1"}, {"microbatch": 64, "compensated": False}):  # ragged
        got = ss.run(ss.Sum(), (big, flags, big.astype(np.uint32), x), **options)  # > 2^15 rows a micro-batch too
        np.testing.assert_array_equal(got.sum[0], big.astype(np.int64).sum(0))
        np.testing.assert_array_equal(got.sum[1], flags.sum(0))
        np.testing.assert_array_equal(got.sum[2], big.astype(np.uint32).astype(np.int64).sum(0))
        assert got.sum[3].dtype == np.int64 and int(got.sum[3]) == int(x.astype(np.int64).sum())
        assert int(got.count) == len(big)


def test_int64_sums_and_float64_statistics_under_x64():
    got = run_x64("""
        import numpy as np, tempfile, sharded_scan as ss
        x = (np.int64(2**40) + np.arange(300_000, dtype=np.int64) % 1000).reshape(-1, 1)  # sum past 2^53
        s = ss.run(ss.Sum(), x, mesh="data:8", microbatch=50_000)
        y = np.random.default_rng(0).normal(1e4, 1e-3, size=(1000, 3))
        cov = ss.run(ss.Covariance(), y, mesh="data:3", microbatch=64)
        with tempfile.TemporaryDirectory() as d:
            ss.run(ss.Moments(), y, mesh="data:8", microbatch=64, checkpoint=ss.CheckpointOptions(d, every_steps=1))
            again = ss.run(ss.Moments(), y, mesh="data:2", microbatch=64, checkpoint=d)  # resumes, other devices
        # 64-bit values keyed in 64 bits under the global flag too: none merged or rounded. int64 past 2^32 here;
        # float64 values float32 would merge are test_keys64's, under the flag as start-up sets it (one compile each).
        data = x[:1000]
        sketches = [
            (int(ss.run(ss.DistinctCount(exact_up_to=2000), data).count[0]), len(np.unique(data))),
            (float(ss.run(ss.Quantiles(qs=[0.3], method="lower"), data).quantiles[0, 0]),
             float(np.quantile(data, 0.3, method="lower"))),
            (float(ss.run(ss.TopK(k=1), data).values[0, 0]), float(data.min())),  # every count 1: the smallest
        ]
        emit({"sketches": sketches, "sum": str(int(s.sum[0])), "want": str(int(x.sum())), "count": int(s.count),
              "cov_err": float(np.abs(cov.cov - np.cov(y, rowvar=False)).max()), "cov_dtype": str(cov.cov.dtype),
              "var_err": float(np.abs(again.var - y.var(0)).max() / y.var(0).max()), "count2": int(again.count)})
    """)
    assert got["sum"] == got["want"] and got["count"] == 300_000
    assert got["cov_err"] < 1e-15 and got["cov_dtype"] == "float64"  # float32 would be ~1e-7 off here
    assert got["var_err"] < 1e-9 and got["count2"] == 1000
    assert len(got["sketches"]) == 3
    for have, want in got["sketches"]:
        assert have == want, got["sketches"]


def test_regression_and_pca_factors_merge_counts_near_two_to_the_31():
    from sharded_scan.combiners.linalg.solvers import SOLVERS

    z = np.random.default_rng(2).normal(size=(16, 3)).astype(np.float32)
    mask = np.ones(16, bool)
    for name, make in SOLVERS.items():
        solver = make(1)
        acc = jax.jit(solver.add)(solver.init(3, jnp.float32), jnp.asarray(z), mask)  # one program, not op by op
        acc = acc._replace(count=_count(NEAR))
        assert solver.factor(jax.device_get(jax.jit(solver.merge)(acc, acc))).count == 2 * NEAR, name
