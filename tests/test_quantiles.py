"""Quantiles: rank errors against numpy on shaped data, bitwise over device counts and resumes, exact mode."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan import merging
from sharded_scan.combiners.base import MANY_SHARDS, folding_few_microbatches, folding_per_key, merging_many_shards
from sharded_scan.combiners.sketches import kll
from sharded_scan.program import program_for_spec
from tests import test_program
from tests.helpers import assert_usage_error
from tests.test_checkpoint import CrashError, crash_at

QS = np.linspace(0, 1, 101)
K = 64
KW = {"microbatch": 16, "steps_per_call": 2}
EXACT_QS = np.array([0, 0.001, 0.01, 0.3, 0.5, 0.75, 0.999, 1])
# Exact mode's runs on one device (24 steps a pass of 3001 rows): its programs compile in about two thirds of two
# devices'; its refining passes over several devices: test_wide_model (data:2,model:4), test_float_extremes (data:8).
EXACT_KW = {"microbatch": 64, "steps_per_call": 2, "mesh": "data:1"}
# A refining pass counts each value against 2^bits + 1 boundaries a rank: the default bits=10's 1025 made every
# refining step of these 3001 rows cost about 7 times bits=6's 65, in as many passes here (3). The default runs once
# (test_exact_mode_...: its few passes); the resumes, other data and every method refine with FEW_BITS.
FEW_BITS = 6
SKETCH = ss.Quantiles(qs=QS, k=K, method="lower")  # numpy's default is "linear" (tested below)
NAMES = ("normal", "lognormal", "poisson", "sorted", "reversed", "blocks")
compiles = test_program.compiles  # the fixture: programs compiled or loaded from here on


def shaped(n=4000, seed=0):
    """One column per shape users' data comes in: N(0,1), lognormal(2), Poisson(3) ties, sorted,
    reverse-sorted, and runs of 50 equal values."""
    r = np.random.default_rng(seed)
    normal = r.standard_normal(n)
    blocks = np.repeat(r.standard_normal(-(-n // 50)), 50)[:n]
    columns = [normal, r.lognormal(0, 2, n), r.poisson(3, n), np.sort(normal), np.sort(normal)[::-1], blocks]
    return np.stack(columns, 1).astype(np.float32)


def rank_errors(x, got, qs):
    """Per column, the largest distance from ``q (n - 1)`` to the ranks ``got`` holds in ``x``, over ``n``."""
    out = []
    for j in range(x.shape[1]):
        xs = np.sort(np.asarray(x[:, j], np.float64))
        below, upto = np.searchsorted(xs, got[j], "left"), np.searchsorted(xs, got[j], "right")
        target = qs * (len(xs) - 1)
        out.append(np.maximum(0, np.maximum(below - target, target - (upto - 1))).max() / len(xs))
    return np.array(out)


def lower(x, qs):
    return np.quantile(np.asarray(x, np.float64), qs, axis=0, method="lower").T


def crash_at_call(calls):
    """Raises at the ``calls``-th step over all passes of a run."""
    seen = []

    def progress(p):
        seen.append(p.step)
        if len(seen) == calls:
            raise CrashError

    return progress


@pytest.mark.parametrize("mesh", ["data:1", "data:8"])
def test_sketch_rank_errors_on_shaped_data_are_within_its_bound(mesh):
    x = shaped()
    got = ss.run(SKETCH, x, mesh=mesh, **KW)
    errors = rank_errors(x, got.quantiles, QS)
    assert 0 < got.rank_error < 0.1 and got.passes == 1 and got.count == len(x)
    assert np.all(errors <= got.rank_error), dict(zip(NAMES, errors, strict=True))
    assert np.all(errors <= 3 / K), dict(zip(NAMES, errors, strict=True))
    np.testing.assert_array_equal(got.quantiles[:, 0], x.min(0))  # the ends are exact
    np.testing.assert_array_equal(got.quantiles[:, -1], x.max(0))


def test_logical_shards_give_bitwise_the_same_sketch_on_1_and_4_devices():
    x = shaped(3001)
    # 4 shards: 4 folded on one device against 1 a device merged over 4, as with 8 (tested for every device
    # count in test_engine), but each program merges 4 sketches, not 8: their compile is about half. 2 shards a
    # device (a local fold, then a merge over devices): the split sketch's run in test_wide_model, bitwise data:4's.
    runs = [ss.run(SKETCH, x, mesh=mesh, logical_shards=4, **KW) for mesh in ("data:1", "data:4")]
    for got in runs[1:]:
        np.testing.assert_array_equal(got.quantiles, runs[0].quantiles)
        assert got.rank_error == runs[0].rank_error
    assert np.all(rank_errors(x, runs[0].quantiles, QS) <= runs[0].rank_error)


def test_kill_and_resume_is_bitwise_the_uninterrupted_run(tmp_path):
    x, kw = shaped(3001), dict(KW, logical_shards=4)  # the programs the test above compiled on 4 devices
    want = ss.run(SKETCH, x, mesh="data:4", **kw)
    # 47 steps of 64 rows: a save every 16 (each save a few hundredths of a second of CPU), killed after the first
    options = ss.CheckpointOptions(str(tmp_path), every_steps=16)
    with pytest.raises(CrashError):
        ss.run(SKETCH, x, mesh="data:4", checkpoint=options, progress=crash_at(17), **kw)
    got, report = ss.run_with_report(SKETCH, x, mesh="data:4", checkpoint=options, **kw)
    assert report.resumed_from_step == 16
    np.testing.assert_array_equal(got.quantiles, want.quantiles)
    assert got.rank_error == want.rank_error


@pytest.mark.parametrize("mesh, n", [("data:1", 60), ("data:8", 5)])
def test_nothing_compacted_is_numpy_lower_exactly(mesh, n):
    x = shaped(n)
    got = ss.run(SKETCH, x, mesh=mesh, **KW)
    np.testing.assert_array_equal(got.quantiles, lower(x, QS))
    assert got.rank_error == 0


def test_exact_mode_is_numpy_lower_in_few_passes_and_resumes(tmp_path):
    x, qs, kw = shaped(3001), EXACT_QS, EXACT_KW
    exact = ss.Quantiles(qs=qs, k=K, exact=True, method="lower")
    got, report = ss.run_with_report(exact, x, **kw)
    np.testing.assert_array_equal(got.quantiles, lower(x, qs))
    assert 2 <= got.passes <= 4 and got.rank_error == 0
    assert report.rows_this_run == got.passes * len(x)
    exact = dataclasses.replace(exact, bits=FEW_BITS)  # killed and resumed: FEW_BITS' refining passes
    # A save every 16 steps (each save a few hundredths of a second of CPU: every call's were most of this test)
    options = ss.CheckpointOptions(str(tmp_path), every_steps=16)
    with pytest.raises(CrashError):  # killed in the second pass (24 calls of 2 steps a pass), past its first save
        ss.run(exact, x, checkpoint=options, progress=crash_at_call(33), **kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pass1", "pass2"]
    again, report = ss.run_with_report(exact, x, checkpoint=options, **kw)
    np.testing.assert_array_equal(again.quantiles, got.quantiles)
    whole = ss.run(exact, x, **kw)  # uninterrupted
    np.testing.assert_array_equal(whole.quantiles, got.quantiles)
    assert again.passes == whole.passes == report.passes and report.rows_this_run < whole.passes * len(x)
    sketch, report = ss.run_with_report(dataclasses.replace(exact, exact=False), x, **kw)  # one pass
    assert sketch.passes == 1 and report.rows_this_run == len(x)


def test_other_data_reuses_the_refining_passes_compiled_programs(compiles):
    exact = ss.Quantiles(qs=EXACT_QS, k=K, exact=True, method="lower", bits=FEW_BITS)  # test_exact_mode_... resumes it
    ss.run(exact, shaped(3001), **EXACT_KW)
    first = len(compiles)
    x = shaped(3001, seed=1)  # other values: other boundaries in every refining pass
    got = ss.run(exact, x, **EXACT_KW)
    assert got.passes > 2  # two refining passes at least, each counting at boundaries of its own
    np.testing.assert_array_equal(got.quantiles, lower(x, EXACT_QS))
    assert len(compiles) == first, "new boundaries compiled again"


def test_nan_propagates_or_is_omitted_and_signed_zeros_and_infinities_rank_like_numpy():
    x = shaped(60).copy()  # nothing is compacted: numpy's answers exactly
    x[7, 0] = np.nan
    x[:20, 1] = -0.0
    x[20:40, 1] = 0.0
    x[3, 2], x[4, 2] = np.inf, -np.inf
    got = ss.run(SKETCH, x, mesh="data:1", **KW)
    assert np.isnan(got.quantiles[0]).all()
    np.testing.assert_array_equal(got.quantiles[1:], lower(x[:, 1:], QS)[:, :])
    kept = ss.run(SKETCH, x, mesh="data:1", nan_policy="omit", **KW)  # each value skipped where it stands
    finite = np.where(np.isfinite(x), x, np.nan)
    np.testing.assert_array_equal(kept.quantiles, np.nanquantile(finite, QS, axis=0, method="lower").T)
    np.testing.assert_array_equal(kept.count, np.isfinite(x).sum(0))


@pytest.mark.parametrize(
    "values",
    [
        np.arange(-700, 700, dtype=np.int32)[::-1] * 3_000_001,
        np.arange(1400, dtype=np.uint32) * 3_000_001,
        np.random.default_rng(3).normal(size=1400).astype(ml_dtypes.bfloat16),
        np.random.default_rng(4).integers(0, 5, 1400).astype(np.int8),
    ],
    ids=["int32", "uint32", "bfloat16", "int8"],
)
def test_integer_and_narrow_float_columns(values):
    got = ss.run(ss.Quantiles(qs=QS, method="lower"), values, mesh="data:1", microbatch=64)
    assert got.quantiles.shape == (len(QS),)  # a vector of rows gives one column, unnested
    np.testing.assert_array_equal(got.quantiles, lower(values.astype(np.float64)[:, None], QS)[0])


def test_num_buckets_are_tf_transform_boundaries():
    x = shaped()
    got = ss.run(ss.Quantiles(num_buckets=4, k=K, method="lower"), x, mesh="data:1", **KW)  # SKETCH's step
    np.testing.assert_array_equal(got.qs, [0.25, 0.5, 0.75])
    assert np.all(rank_errors(x, got.quantiles, got.qs) <= got.rank_error)
    assert ss.Quantiles(num_buckets=4).qs == (0.25, 0.5, 0.75) and ss.Quantiles(num_buckets=1).qs == ()
    assert ss.Quantiles(num_buckets=4).fingerprint() == ss.Quantiles(qs=[0.25, 0.5, 0.75]).fingerprint()
    assert ss.Quantiles(qs=[0.5]).fingerprint() != ss.Quantiles(qs=[0.25]).fingerprint()


def test_merge_has_the_empty_sketch_as_identity():
    combiner, spec = ss.Quantiles(qs=QS, k=K), jax.ShapeDtypeStruct((2,), np.float32)
    x = shaped(300)[:, :2]
    empty = combiner.init(spec)
    acc = jax.jit(combiner.add)(empty, x, np.arange(300) < 290)
    assert int(np.asarray(acc.sketch.variance)) > 0  # something was compacted
    merge = jax.jit(combiner.merge)
    for merged in (merge(empty, acc), merge(acc, empty)):
        jax.tree.map(np.testing.assert_array_equal, merged, acc)
    host = kll.to_host(jax.tree.map(np.asarray, acc.sketch))
    assert abs(host.cumulative[0, -1] - 290) < 8  # rows sampled every 8th, from a random offset


def test_a_move_in_the_middle_window_gives_the_same_sketch(monkeypatch):
    k, mb, d = 1024, 1024, 2
    assert kll.window_sizes(k, mb) == (256, 1024, 3072) and kll.window_sizes(k) == (256, 3072)
    rows = np.random.default_rng(0).integers(0, 2**32 - 1, (24, d, mb), dtype=np.uint32)
    batches = np.sort(rows, axis=2)

    def fold(batches):
        insert = lambda s, b: (kll.insert_sorted_rows(s, b, jnp.int32(mb), k), None)  # noqa: E731
        return jax.lax.scan(insert, kll.empty(d, k), batches)[0]

    three = jax.jit(fold)(batches)
    two_sizes = kll.window_sizes
    monkeypatch.setattr(kll, "window_sizes", lambda k, rows=0: two_sizes(k))
    two = jax.jit(lambda b: fold(b))(batches)
    jax.tree.map(np.testing.assert_array_equal, three, two)
    host = kll.to_host(jax.tree.map(np.asarray, three))
    assert np.all(np.abs(host.cumulative[:, -1] - 24 * mb) < 64) and int(np.sum(three.sizes)) < 4 * k  # compacted
    # A short job's step (fewer than base.FEW_MICROBATCHES micro-batches a shard) leaves the middle window out:
    # the same sketch, one move less to compile (issue 45: a small job that answers at once); one whose shards
    # fold one micro-batch each (a small job's layout) keeps only the largest.
    with folding_few_microbatches(2):
        assert two_sizes(k, mb) == (256, 3072)
    with folding_few_microbatches(1):
        assert two_sizes(k, mb) == (3072,) and two_sizes(k, k // 4) == (256, 3072)  # the small one taken: kept
        with folding_per_key():  # a keyed add (GroupBy's): an insertion a key, many small ones
            assert two_sizes(k, mb) == (256, 3072)
    options = ss.RunOptions(mesh="data:1", microbatch=mb, steps_per_call=1)
    spec = jax.ShapeDtypeStruct((d,), np.float32)
    one, short, long = (program_for_spec(ss.Quantiles(qs=(0.5,), k=k), spec, n * mb, options) for n in (1, 24, 64))
    assert (one.short, short.short, long.short) == (1, 2, 0)


def test_a_small_describe_step_traces_one_move_and_no_varying_casts():
    """A small job's step (one micro-batch a shard: issue 45's 'answers at once') sorts its rows and one window
    size, and its shard_map casts nothing (``check_vma=False``: about a quarter of its equations were ``pvary``);
    a micro-batch's add bitwise the same in the one window as in two (kll.window_sizes' docstring)."""
    describe = ss.Describe(k=256)
    program = program_for_spec(describe, jax.ShapeDtypeStruct((3,), np.float64), 3000, ss.RunOptions(mesh="data:1"))
    assert program.short == 1
    with jax.enable_x64(True):
        names = list(primitive_names(program.trace_step().jaxpr.jaxpr))
    assert names.count("sort") == 2 and "pvary" not in names
    x = (np.random.default_rng(3).standard_normal((100, 3)) * 10).astype(np.float32)
    mask = np.arange(100) < 43  # 43 items: a move in the small window (64 slots) before, in the large (768) now
    sketch = describe.sketch  # its Quantiles
    acc = sketch.init(jax.ShapeDtypeStruct((3,), np.float32))
    with folding_few_microbatches(1):
        one = jax.jit(lambda a, b, m: sketch.add(a, b, m))(acc, x, mask)
    with folding_few_microbatches(2):
        two = jax.jit(lambda a, b, m: sketch.add(a, b, m))(acc, x, mask)
    assert int(np.sum(one.sketch.sizes)) == 43
    jax.tree.map(np.testing.assert_array_equal, one, two)


def primitive_names(jaxpr):
    """Every equation's primitive name in ``jaxpr`` and the jaxprs in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield str(eqn.primitive)
        for param in eqn.params.values():
            for inner in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    yield from primitive_names(inner)


def test_a_merge_of_many_shards_sorts_in_three_window_sizes_and_gives_the_same_sketch():
    k, mb, d = 1024, 1024, 3
    rows = np.sort(np.random.default_rng(1).integers(0, 2**32 - 1, (2, 11, d, mb), dtype=np.uint32), axis=3)
    fold = jax.jit(lambda batches: jax.lax.scan(
        lambda s, b: (kll.insert_sorted_rows(s, b, jnp.int32(mb), k), None), kll.empty(d, k), batches)[0])
    a, b = fold(rows[0]), fold(rows[1][:7])  # sketches of several levels, one taller than the other

    def merged(shards):
        def merge(a, b):
            with merging_many_shards(shards >= MANY_SHARDS):
                return kll.merge(a, b, k)
        sorts = str(jax.make_jaxpr(merge)(a, b)).count(" sort[")
        return sorts, jax.jit(merge)(a, b), jax.jit(merge)(b, a)

    (one, *few), (three, *many) = merged(MANY_SHARDS - 1), merged(MANY_SHARDS)
    assert (one, three) == (1, 3)  # one move compiled a window size: 3 sizes only where the merge runs often
    # one program a side of MANY_SHARDS, whatever the job's shard count: no merge compiled again a count
    q = ss.Quantiles(qs=(0.5,), k=k)
    assert merging.compile_pair_merge(q, "highest", shards=8) is merging.compile_pair_merge(q, "highest", shards=16)
    assert merging.compile_pair_merge(q, "highest", shards=2) is merging.compile_pair_merge(q, "highest", shards=7)
    for x, y in zip(few, many, strict=True):
        jax.tree.map(np.testing.assert_array_equal, x, y)
    host = kll.to_host(jax.tree.map(np.asarray, many[0]))
    assert np.all(np.abs(host.cumulative[:, -1] - 18 * mb) < 128)  # every row of both, to sampling


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: ss.Quantiles(qs=[0.5, 1.5]), ["qs", "[0, 1]"]),
        (lambda: ss.Quantiles(qs=[np.nan]), ["qs", "[0, 1]"]),
        (lambda: ss.Quantiles(qs="median"), ["qs"]),
        (lambda: ss.Quantiles(num_buckets=0), ["num_buckets", ">= 1"]),
        (lambda: ss.Quantiles(num_buckets=2.5), ["num_buckets"]),
        (lambda: ss.Quantiles(), ["exactly one of qs"]),
        (lambda: ss.Quantiles(qs=[0.5], num_buckets=4), ["exactly one of qs"]),
        (lambda: ss.Quantiles(qs=[0.5], k=4), ["k", ">= 16"]),
        (lambda: ss.Quantiles(qs=[0.5], exact=True, bits=1), ["bits"]),
        (lambda: ss.run(ss.Quantiles(qs=[0.5]), np.array([["a"]] * 4)), ["numeric"]),
        (lambda: ss.run(ss.Quantiles(qs=[0.5]), np.zeros((4, 2, 2), np.float32)), ["(d,)"]),
        (lambda: ss.run(ss.Quantiles(qs=[0.5]), np.zeros(4), nan_policy="skip"), ["nan_policy"]),
    ],
)
def test_bad_arguments_are_one_clear_line(make, words):
    assert_usage_error(make, words)


METHODS = ("linear", "lower", "higher", "nearest", "midpoint", "inverted_cdf")


@pytest.mark.parametrize("method", METHODS)
def test_every_numpy_method_one_pass_and_exact(method):
    x = shaped(60)  # one pass: nothing is compacted, so numpy's answers
    want = np.quantile(x.astype(np.float64), QS, axis=0, method=method).T
    got = ss.run(ss.Quantiles(qs=QS, k=K, method=method), x, mesh="data:1", **KW)  # the sketch tests' programs
    np.testing.assert_allclose(got.quantiles, want, rtol=1e-12, atol=1e-300)
    x = shaped(3001)  # exact: compacted, then refined (the programs test_exact_mode_... compiled)
    want = np.quantile(x.astype(np.float64), EXACT_QS, axis=0, method=method).T
    got = ss.run(ss.Quantiles(qs=EXACT_QS, k=K, exact=True, method=method, bits=FEW_BITS), x, **EXACT_KW)
    np.testing.assert_allclose(got.quantiles, want, rtol=1e-12, atol=1e-300)
    assert got.passes > 1 and got.rank_error == 0


def test_linear_is_the_default_and_a_bad_method_is_one_line():
    assert ss.Quantiles(qs=[0.5]).method == "linear"
    assert_usage_error(lambda: ss.Quantiles(qs=[0.5], method="hazen"), ["method", "'linear'"])
