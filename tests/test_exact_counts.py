"""Wide integers (int32 limbs): exact counts past 2^31 in the step, the merge and finalize."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import sharded_scan as ss
from sharded_scan.combiners import wide


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
    for row in values:
        acc = wide.add_int32(acc, jnp.asarray(row.astype(np.int32)))
        assert int(np.max(acc.limbs[..., :-1])) < 2**16 and int(np.min(acc.limbs[..., :-1])) >= 0
    want = [sum(int(v) for v in values[:, j]) for j in range(3)]
    assert wide.to_int(acc).tolist() == want
    np.testing.assert_allclose(np.asarray(wide.to_float(acc)), want, rtol=1e-6)


def test_a_value_past_int64_comes_back_as_python_ints():
    limbs = np.array([0, 0, 0, 2**20], np.int32)              # 2^68
    assert wide.to_int(limbs).item() == 2**68


@dataclasses.dataclass(frozen=True)
class RowCount(ss.AdditiveCombiner):
    def init(self, spec):
        return wide.zeros()

    def add(self, acc, batch, mask):
        return wide.count_rows(acc, mask)

    def finalize(self, acc):
        return wide.to_int(acc)


def test_compensated_psum_and_ordered_merges_keep_the_count_exact():
    x = np.ones((10_007, 2), np.float32)
    for options in ({}, {"compensated": False}, {"logical_shards": 8}, {"mesh": "data:3"}):
        assert int(ss.run(RowCount(), x, microbatch=64, steps_per_call=2, **options)) == 10_007, options


def test_compensated_add_keeps_limbs_normalised():
    from sharded_scan.combiners.wrappers import Compensated

    comb = Compensated(RowCount())
    spec = jax.ShapeDtypeStruct((2,), jnp.float32)
    acc = comb.init(spec)
    add = jax.jit(comb.add)
    for _ in range(70):  # 70 * 1000 rows: limb 0 would pass 2^16 without the carry
        acc = add(acc, jnp.ones((1000, 2)), jnp.ones((1000,), bool))
    assert int(acc.value.limbs[0]) < 2**16
    assert int(comb.finalize(jax.tree.map(np.asarray, acc))) == 70_000
