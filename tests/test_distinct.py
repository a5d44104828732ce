"""DistinctCount: exact below exact_up_to, within the HLL standard error above, against numpy/pandas."""

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest

import sharded_scan as ss
from sharded_scan.combiners.sketches.distinct import estimate, more_than
from tests.helpers import assert_usage_error, control_flow
from tests.test_checkpoint import CrashError, crash_at

KW = {"microbatch": 64, "steps_per_call": 2}
SMALL = ss.DistinctCount(precision=10, exact_up_to=300)


def columns(n=3001, seed=0):
    """int32 ids, float32 values with repeats, and a column of few distinct values with NaN and signed zeros."""
    r = np.random.default_rng(seed)
    ids = r.integers(0, 2000, n).astype(np.float32)
    values = np.round(r.normal(size=n), 2).astype(np.float32)
    few = r.choice(np.array([np.nan, -0.0, 0.0, 1.5, -7.25], np.float32), n)
    return np.stack([ids, values, few], 1)


def nunique(x):
    return np.array([pd.Series(x[:, j]).nunique(dropna=False) for j in range(x.shape[1])])


MESHES = ("data:1", "data:2", "data:8")


@pytest.fixture(scope="module")
def runs():
    """``columns()`` counted on 1, 2 and 8 devices, once for the module's tests."""
    return {mesh: ss.run(SMALL, columns(), mesh=mesh, **KW) for mesh in MESHES}


@pytest.mark.parametrize("mesh", ["data:1", "data:8"])
def test_exact_below_the_set_size_estimate_above(runs, mesh):
    x = columns()
    got = runs[mesh]
    want = nunique(x)
    np.testing.assert_array_equal(got.exact, want <= 300)
    assert got.count[2] == want[2] == 4  # NaN is one value, and -0.0 is 0.0 (np.unique's view)
    assert len(np.unique(x[:, 2])) == 4
    sigma = 1.04 / np.sqrt(1 << 10)
    np.testing.assert_allclose(got.relative_error, np.where(want <= 300, 0, sigma))
    assert np.all(np.abs(got.count - want) <= 3 * sigma * want), (got.count, want)


def test_every_device_count_gives_the_same_registers_and_resume_is_bitwise(runs, tmp_path):
    x = columns()
    runs = [runs[mesh] for mesh in MESHES]
    for got in runs[1:]:
        for a, b in zip(got, runs[0], strict=True):
            np.testing.assert_array_equal(a, b)
    options = ss.CheckpointOptions(str(tmp_path), every_steps=2)
    with pytest.raises(CrashError):
        ss.run(SMALL, x, mesh="data:8", checkpoint=options, progress=crash_at(3), **KW)
    again = ss.run(SMALL, x, mesh="data:8", checkpoint=options, **KW)
    for a, b in zip(again, runs[0], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("distinct", [20, 700, 20_000])
def test_estimate_is_within_the_standard_error_on_ints_and_floats(distinct):
    r = np.random.default_rng(distinct)
    ints = r.permutation(np.arange(distinct, dtype=np.int32) * 7919)
    floats = r.normal(size=distinct).astype(np.float32)
    copies = max(2, -(-256 // distinct))  # every value twice at least, and a step's 256 rows at least: one layout
    x = np.concatenate([np.stack([ints, floats.view(np.int32)], 1)] * copies)
    # the estimate alone (default: exact first); KW's layout whatever the row count: one program for the three
    got = ss.run(ss.DistinctCount(exact_up_to=0), x, mesh="data:2", **KW)
    sigma = 1.04 / np.sqrt(1 << 14)
    assert not got.exact.any() and got.relative_error[0] == sigma
    assert np.all(np.abs(got.count - distinct) <= 2.5 * sigma * distinct + 1), got.count  # +1: a rare collision


# nan_policy="omit" (pandas' nunique(): NaN dropped, and an inf here) folds each column's count with a mask per column.
# Main ran EachColumn(DistinctCount): one-column states under jax.vmap, whose lax.conds (the exact slots' sort or
# not, the bound) became selects running both branches (2.8-4.9x propagate's CPU, bench/README.md).
def test_omit_skips_each_value_where_it_stands_like_nunique_with_the_control_flow_of_propagate():
    from sharded_scan.combiners.wrappers.policies import apply_policies

    f = jax.ShapeDtypeStruct
    for combiner, spec in ((SMALL, f((4,), np.float64)), (ss.DistinctCount(exact_up_to=0), f((), np.float32)),
                           (ss.GroupBy(SMALL, 3), (f((), np.int32), f((4,), np.float64)))):
        batch = jax.tree.map(lambda s: f((1024, *s.shape), s.dtype), spec)  # traced only
        flows = [control_flow(jax.make_jaxpr(c.add)(jax.eval_shape(c.init, spec), batch, f((1024,), bool)).jaxpr)
                 for c in (apply_policies(combiner, nan_policy=p) for p in ("propagate", "omit"))]
        assert flows[1] == flows[0], (combiner, flows)
    # NaN and +-inf spread differently per column (+-0 one value); micro-batches where column 1 holds none; a column
    # of NaN and inf alone; a column of more than exact_up_to values. 2 devices fold, then the counts merge.
    r = np.random.default_rng(3)
    n = 1000
    values = np.array([np.nan, -0.0, 0.0, 2.5, -1.0, 7.0, np.inf, -np.inf])
    x = np.stack([r.choice(values, n, p=[0.1, 0.2, 0.2, 0.25, 0.15, 0.05, 0.03, 0.02]), r.integers(-90, 90, n) * 0.5,
                  np.where(r.random(n) < 0.5, np.nan, np.inf), np.round(r.normal(size=n) * 1e3)], 1)
    x[r.random(n) < 0.2, 1] = np.inf
    x[256:768, 1] = np.nan
    x[r.random(n) < 0.1, 3] = np.nan
    got = ss.run(SMALL, x, nan_policy="omit", mesh="data:2", **KW)
    want = pd.DataFrame(np.where(np.isfinite(x), x, np.nan)).nunique(dropna=True).to_numpy()
    assert want[0] == 4 and want[2] == 0 and want[3] > 300
    np.testing.assert_array_equal(got.exact, [True, True, True, False])
    np.testing.assert_array_equal(got.count[:3], want[:3])
    assert abs(got.count[3] - want[3]) <= 3 * 1.04 / np.sqrt(1 << 10) * want[3], (got.count, want)
    vector = ss.run(SMALL, columns(500)[:, 2], mesh="data:2", **KW)  # rows of one value: scalars
    assert vector.count.shape == () and vector.count == 4 and vector.exact


def test_estimator_matches_known_register_states():
    m = 1 << 12
    assert estimate(np.zeros(m, np.uint8)) == 0
    rng = np.random.default_rng(0)
    for n in (10, 1000, 100_000, 10_000_000):  # registers of n random 46-bit hashes, drawn directly
        index = rng.integers(0, m, n)
        rank = np.minimum(rng.geometric(0.5, n), 33).astype(np.uint8)
        registers = np.zeros(m, np.uint8)
        np.maximum.at(registers, index, rank)
        assert abs(estimate(registers) / n - 1) < 3 * 1.04 / np.sqrt(m), n


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: ss.DistinctCount(precision=3), ["precision", "[4, 18]"]),
        (lambda: ss.DistinctCount(precision=14.0), ["precision"]),
        (lambda: ss.DistinctCount(exact_up_to=-1), ["exact_up_to", ">= 0"]),
        (lambda: ss.run(ss.DistinctCount(), np.array([["a"]] * 4)), ["numeric"]),
        (lambda: ss.run(ss.DistinctCount(), (np.zeros(4), np.zeros(4))), ["one array"]),
    ],
)
def test_bad_arguments_are_one_clear_line(make, words):
    assert_usage_error(make, words)


def test_few_values_are_exact_by_default_and_many_are_estimated():
    r = np.random.default_rng(7)
    few = r.choice(np.arange(163, dtype=np.float32) / 10, 442)  # the diabetes data's bmi: 163 values in 442 rows
    many = r.permutation(np.arange(5000, dtype=np.int32))
    got = ss.run(ss.DistinctCount(precision=12), np.stack([few.view(np.int32), many[:442]], 1), mesh="data:2", **KW)
    np.testing.assert_array_equal(got.count, [len(np.unique(few)), 442])
    assert got.exact.all() and ss.DistinctCount().exact_up_to == 1 << 14
    # 5000 > 2^12 kept keys; two columns, as above: the same program (one column's scalars: test_nan_values_...)
    over = ss.run(ss.DistinctCount(precision=12), np.stack([many, many[::-1]], 1), mesh="data:2", **KW)
    assert not over.exact.any() and np.all(np.abs(over.count - 5000) <= 2.5 * over.relative_error * 5000)


def test_exact_at_the_set_size_and_one_past_it():
    """``exact_up_to`` values are still exact and one more is not, whatever micro-batch brings the last one; a
    column of many values (past the bound after its first micro-batches, :func:`more_than`, no sort) is the
    estimate. The shapes of ``columns()``: the module's programs."""
    r = np.random.default_rng(5)
    late = np.concatenate([np.zeros(2000), r.permutation(np.arange(1001) % 300)])  # 299 values in the last third
    x = np.stack([late, r.permutation(np.arange(3001) % 301), r.integers(0, 2000, 3001)], 1).astype(np.float32)
    got = ss.run(SMALL, x, mesh="data:2", **KW)
    np.testing.assert_array_equal(got.exact, [True, False, False])
    assert got.count[0] == 300 and abs(got.count[1] - 301) <= 3 * 1.04 / 32 * 301
    keys = jnp.asarray(np.arange(600, dtype=np.uint32).reshape(2, 300))
    batch = jnp.asarray(np.stack([np.arange(64), np.arange(1000, 1064)]).astype(np.uint32))
    held, rows = jnp.array([300, 300]), jnp.ones(64, bool)
    # A lower bound: never more than E for E values (the batch's among the kept ones), often for more.
    np.testing.assert_array_equal(more_than(keys, held, batch, rows, 300), [False, True])
