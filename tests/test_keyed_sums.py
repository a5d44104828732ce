"""keyed_sum: a TPU's one-hot route against the scatter-add and float64 sums, and which route a program lowers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan.combiners import keyed_sums
from sharded_scan.combiners.keyed_sums import keyed_sum

EDGES = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 1.5], np.float32)
BIG = np.finfo(np.float32).max


def float64_sums(values, keys, num_keys):
    """Each key's sum in float64 (rows of a key out of range dropped), rounded to float32: IEEE's NaN and infinities."""
    flat = values.reshape(len(values), -1).astype(np.float64)
    out = np.zeros((num_keys, flat.shape[1]))
    with np.errstate(invalid="ignore", over="ignore"):
        for k in range(num_keys):
            out[k] = flat[keys == k].sum(0)
        return out.astype(np.float32).reshape((num_keys,) + values.shape[1:])


@pytest.mark.parametrize("shape", [(), (3,), (2, 3)])
@pytest.mark.parametrize("seed", range(3))
def test_the_one_hot_route_sums_each_key_as_float64_does_with_nan_infinities_zeros_and_keys_out_of_range(shape, seed):
    r = np.random.default_rng(seed)
    rows, num_keys = 700, 13
    values = r.normal(size=(rows, *shape)).astype(np.float32) * np.float32(10.0) ** r.integers(-3, 4, (rows, *shape))
    edge = r.random(values.shape) < (0.02 if seed else 0.0)  # seed 0: finite values only (no scatter-add at all)
    values = np.where(edge, r.choice(EDGES, values.shape), values).astype(np.float32)
    keys = r.integers(-2, num_keys + 2, rows).astype(np.int32)  # some out of range: dropped
    got = np.asarray(jax.jit(keyed_sums._by_one_hot, static_argnums=2)(values, keys, num_keys))
    scattered = np.asarray(jax.ops.segment_sum(values, keys, num_keys))
    want = float64_sums(values, keys, num_keys)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(scattered))
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[~finite], want[~finite])  # +-inf where IEEE's sum is, NaN where it is
    # float32's bound for a sum of n terms in any order: n eps sum|x| (each key's finite terms)
    bound = np.zeros_like(want, dtype=np.float64)
    for k in range(num_keys):
        mine = values[keys == k]
        bound[k] = len(mine) * np.finfo(np.float32).eps * np.abs(np.where(np.isfinite(mine), mine, 0)).astype(
            np.float64).sum(0)
    assert np.all(np.abs(got[finite] - want[finite]) <= bound[finite] + 1e-30)


def test_the_one_hot_route_counts_rows_exactly_overflows_as_ieee_and_a_zero_key_sums_to_plus_zero():
    r = np.random.default_rng(7)
    keys = r.integers(-1, 6, 5000).astype(np.int32)
    ones = (r.random(5000) < 0.7).astype(np.int32)
    got = np.asarray(keyed_sums._by_one_hot(jnp.asarray(ones), jnp.asarray(keys), 5))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, [ones[keys == k].sum() for k in range(5)])
    zeros = keyed_sums._by_one_hot(jnp.array([-0.0, -0.0, 2.0], jnp.float32), jnp.array([0, 0, 1], jnp.int32), 3)
    assert np.array_equal(np.signbit(np.asarray(zeros)), [False, False, False])  # as the scatter-add's +0.0
    # float32's largest value: the matmul's operands split in parts (Precision.HIGHEST) keep it, and two overflow
    extremes = jnp.array([BIG, BIG, BIG, -BIG, 1.5, -BIG], jnp.float32), jnp.array([0, 1, 1, 2, 2, 3], jnp.int32)
    np.testing.assert_array_equal(keyed_sums._by_one_hot(*extremes, 4), [BIG, np.inf, -BIG, -BIG])


def lowered_ops(fn, *args, platform):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("inner", [ss.Sum(), ss.Moments(fields=("mean", "var", "min", "max")), ss.Covariance()],
                         ids=["Sum", "Moments", "Covariance"])
def test_a_group_by_sums_by_matmul_only_in_a_program_lowered_for_a_tpu(inner):
    # XLA:TPU's scatter-add is slower than the one-hot matmul (a micro-batch of 16384 rows x 4 columns, 1,000 keys, on
    # a TPU v5e: GroupBy(Sum())'s add 0.53 -> 0.19 ms, GroupBy(Covariance())'s 1.36 -> 0.48); a CPU's program keeps
    # its scatter-adds and no matmul.
    g = ss.GroupBy(inner, 1000)
    spec = (jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.float32))
    args = (g.init(spec), (jnp.zeros(4096, jnp.int32), jnp.zeros((4096, 4), jnp.float32)), jnp.ones(4096, bool))
    cpu, tpu = (lowered_ops(g.add, *args, platform=p) for p in ("cpu", "tpu"))
    assert "dot_general" not in cpu and "dot_general" in tpu
    assert tpu.count("stablehlo.scatter") < cpu.count("stablehlo.scatter")


def test_wide_keys_float64_and_int64_values_keep_the_scatter_add_everywhere():
    big = jnp.zeros((4096, 2), jnp.float32), jnp.zeros(4096, jnp.int32)
    assert "dot_general" not in lowered_ops(lambda v, k: keyed_sum(v, k, keyed_sums.ONE_HOT_MAX // 4096 + 1), *big,
                                            platform="tpu")
    with jax.enable_x64(True):
        for dtype in (jnp.float64, jnp.int64):
            v, k = jnp.zeros((64, 2), dtype), jnp.zeros(64, jnp.int32)
            assert "dot_general" not in lowered_ops(lambda v, k: keyed_sum(v, k, 8), v, k, platform="tpu")
    small = jnp.zeros((4096, 2), jnp.float32), jnp.zeros(4096, jnp.int32)
    assert "dot_general" in lowered_ops(lambda v, k: keyed_sum(v, k, 8), *small, platform="tpu")
