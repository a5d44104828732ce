"""Wide accumulators over ``model``: a sketch, and the co-moments of ``Covariance`` and
``Correlation``, split by columns (issue 29, item 2).

The split runs the whole sketch's per-column arithmetic and random bits, and the whole
co-moments' arithmetic on each block of columns, so on the same shards (``logical_shards``) an
exact state (a sketch, counts) and a sum (a weighted histogram's) are bitwise those of a mesh
without ``model``; the co-moments and moments agree to rounding: their split programs are of other
shapes, fused otherwise, so XLA:CPU contracts other multiply-adds into FMAs (Moments' skewness
1 ulp apart in one column with FMA, AVX-512 or AVX2, bitwise without, AVX or SSE4.2), and
bitwise only their exact leaves (counts, minima, maxima).
"""

import jax
import numpy as np
import pytest
import scipy.stats

import sharded_scan as ss
from sharded_scan import admission
from sharded_scan.combiners.sketches.quantiles_exact import RefinePass
from sharded_scan.combiners.statistics.describe import Each
from sharded_scan.options import RunOptions
from sharded_scan.program import build_program
from sharded_scan.sources import as_source
from tests.helpers import CrashError, assert_to_rounding, crash_at, f64, rel_err
from tests.test_quantiles import EXACT_QS, KW, SKETCH, shaped

# test_quantiles' sketch, rows (3001: ragged) and programs: its data:1 run is the reference here.
X = shaped(3001)  # 6 columns: over model:4 padded to 8, 2 a device, the last device's both padding
RUN = dict(KW, logical_shards=4)
# The whole runs (references) on one device: 4 logical shards are bitwise those on 2 and 4 devices (test_engine,
# test_quantiles), and one device's programs compile in about two thirds of four's.
WHOLE = "data:1"


def assert_bitwise(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def whole():
    result = ss.run(SKETCH, X, mesh=WHOLE, **RUN)  # bitwise data:4's (test_quantiles)
    np.testing.assert_array_equal(result.quantiles[:, [0, -1]], np.stack([X.min(0), X.max(0)], 1))
    return result


def test_a_sketch_split_over_model_is_bitwise_the_whole_ones(whole):
    # 2 shards a device folded locally, then gathered over data; columns padded, a device's block all padding.
    # (data:4,model:2 and data:2,model:2 agree too; one run keeps the compiles within the suite's budget.)
    program = build_program(SKETCH, as_source(X), RunOptions(mesh="data:2,model:4", **RUN))
    items = program.like.value.sketch.items  # (shards, padded columns, slots)
    assert items.shape[1] == 8 and items.sharding.shard_shape(items.shape)[1] == 2
    assert_bitwise(ss.run(SKETCH, X, mesh="data:2,model:4", **RUN), whole)


def test_the_memory_estimate_sees_the_split_and_names_the_axis_to_grow(monkeypatch):
    wide = np.zeros((100, 512), np.float32)

    def per_device(mesh):
        return admission.memory_estimate(build_program(SKETCH, as_source(wide), RunOptions(mesh=mesh, microbatch=16)))

    whole, split = per_device("data:8"), per_device("data:4,model:2")  # one shard a device each
    assert split["accumulator"] <= 0.51 * whole["accumulator"]
    assert split["merge"] <= 0.51 * whole["merge"] and split["temporary"] < whole["temporary"]
    monkeypatch.setattr(admission, "device_available", lambda device: (whole["accumulator"], "the test's memory"))
    with pytest.raises(ss.UsageError, match="grow the mesh's 'model' axis") as err:
        build_program(SKETCH, as_source(wide), RunOptions(mesh="data:8", microbatch=16))
    assert "\n" not in str(err.value)
    with pytest.raises(ss.UsageError, match="grow the mesh's 'model' axis.*make the accumulator smaller"):
        build_program(ss.TopK(capacity=4096), as_source(wide), RunOptions(mesh="data:8"))  # its summaries split too
    with pytest.raises(ss.UsageError, match="make the accumulator smaller") as err:  # a state that does not split
        build_program(ss.PCA(2), as_source(wide), RunOptions(mesh="data:8"))
    assert "'model'" not in str(err.value)


def test_topk_splits_its_summaries_by_columns_and_the_memory_estimate_sees_it():
    wide = np.zeros((100, 511), np.int32)  # 511 columns: padded to 512 over model:2
    program = build_program(ss.TopK(capacity=64), as_source(wide), RunOptions(mesh="data:4,model:2", microbatch=16))
    keys = program.like.value.keys  # (shards, padded columns, capacity)
    assert keys.shape[1] == 512 and keys.sharding.shard_shape(keys.shape)[1] == 256
    whole = build_program(ss.TopK(capacity=64), as_source(wide), RunOptions(mesh="data:8", microbatch=16))
    split, whole = (admission.memory_estimate(p, temporaries=False) for p in (program, whole))
    assert split["accumulator"] <= 0.51 * whole["accumulator"] and split["merge"] <= 0.51 * whole["merge"]


def test_a_histogram_splits_its_counts_and_edges_by_columns():  # test_histogram checks them on data:4,model:2
    ranges = np.stack([-np.arange(1, 7), np.arange(1, 7)], 1)  # each column its own edges
    program = build_program(ss.Histogram(7, ranges), as_source(X), RunOptions(mesh="data:2,model:4"))
    counts = program.like.value.counts
    assert counts.limbs.shape[1] == 8 and counts.limbs.sharding.shard_shape(counts.limbs.shape)[1] == 2
    # Its edges (operands: inner (d, 6), lo, hi) split the same way: each device holds its 2 columns' (the
    # last device's padding: lo 1 above hi 0, no value counts), not the 6 whole; the estimate counts that block.
    whole = ss.Histogram(7, ranges).operands(jax.ShapeDtypeStruct((6,), np.float32))
    for leaf, want, pad in zip(program.operands, whole, (0, 1, 0), strict=True):
        padded = np.concatenate([want, np.full((2, *want.shape[1:]), pad, want.dtype)])
        for shard in leaf.addressable_shards:
            assert shard.data.shape[0] == 2
            np.testing.assert_array_equal(shard.data, padded[shard.index])
    parts = admission.memory_estimate(program)
    assert parts["operands"] == 2 * (7 + 1) * 4 == admission.operand_bytes(program, whole=True) // 4


FIVE = (np.random.default_rng(0).normal(size=(301, 5)) * np.arange(1, 6) + 1e3).astype(np.float32)
FIVE_RUN = dict(microbatch=8, steps_per_call=2, logical_shards=4)


def test_a_weighted_histogram_splits_its_sums_and_edges_and_is_bitwise_the_whole_ones():
    # The covariance test's rows, shards and micro-batch, weighted (every 7th weight 0: an omitted row), each
    # column its own range (values beyond it on both sides); over model:2 each device sums its 3 of 6 padded columns.
    # Bitwise: additions only (a bin's weights scattered in row order, Kahan terms, the tree's adds), no product
    # an FMA could take, in any program shape.
    x, run = FIVE, FIVE_RUN
    w = np.where(np.arange(len(x)) % 7, np.random.default_rng(1).uniform(0, 2, len(x)), 0).astype(np.float32)
    ranges = np.stack([1e3 - 2 * np.arange(1, 6), 1e3 + 2 * np.arange(1, 6)], 1)
    job = ss.Weighted(ss.Histogram(7, ranges))
    whole = ss.run(job, (w, x), mesh=WHOLE, **run)
    for j in range(5):
        want, edges = np.histogram(f64(x[:, j]), 7, tuple(ranges[j]), weights=f64(w))
        assert rel_err(whole.counts[j], want) < 1e-6 and np.array_equal(whole.edges[j], edges)
    program = build_program(job, as_source((w, x)), RunOptions(mesh="data:4,model:2", **run))
    sums = program.like.value.value.sums  # (shards, padded columns, bins): the float sums, compensated
    assert sums.shape == (4, 6, 7) and sums.sharding.shard_shape(sums.shape) == (1, 3, 7)
    assert [leaf.sharding.shard_shape(leaf.shape)[0] for leaf in program.operands] == [3, 3, 3]  # edges
    assert_bitwise(ss.run(job, (w, x), mesh="data:4,model:2", **run), whole)


def test_covariance_split_over_model_is_the_whole_ones_and_resumes_across(tmp_path):
    # 5 columns: over model:2 padded to 6, 3 a device (test_statistics runs them against numpy without
    # logical_shards); 4 logical shards (data:4's run is bitwise data:1's and data:2's: test_engine),
    # test_statistics' micro-batch; 5 steps, ragged.
    x, run = FIVE, FIVE_RUN
    whole = ss.run(ss.Covariance(), x, mesh=WHOLE, **run)
    assert whole.count == 301 and rel_err(whole.cov, np.cov(f64(x), rowvar=False)) < 1e-5
    program = build_program(ss.Covariance(), as_source(x), RunOptions(mesh="data:4,model:2", **run))
    m2 = program.like.m2  # (shards, d, padded columns): split by columns, the means whole
    assert m2.shape == (4, 5, 6) and m2.sharding.shard_shape(m2.shape) == (1, 5, 3)
    assert program.like.mean.sharding.shard_shape(program.like.mean.shape) == (1, 5)
    assert_to_rounding(ss.run(ss.Covariance(), x, mesh="data:4,model:2", **run), whole)  # the count exact
    for got in resumed_across(ss.Covariance(), x, run, tmp_path):
        assert_to_rounding(got, whole)


def resumed_across(job, x, run, tmp_path):
    """``job``'s results resumed on one device from a split checkpoint (data:4,model:2), and the other way."""
    for first, then in (("data:4,model:2", WHOLE), (WHOLE, "data:4,model:2")):  # split -> whole, and back
        directory = str(tmp_path / first)
        with pytest.raises(CrashError):
            ss.run(job, x, mesh=first, checkpoint=ss.CheckpointOptions(directory, every_steps=1),
                   progress=crash_at(2), **run)
        got, report = ss.run_with_report(job, x, mesh=then, checkpoint=directory, **run)
        assert report.resumed_from_cursor > 0  # a save before the crash
        yield got


def test_moments_split_over_model_is_the_whole_ones():
    # The covariance test's rows, shards and micro-batch: each model device folds its 3 of the 6 padded columns.
    # A resume across the split (a checkpoint of one layout restored on the other): the covariance test's, through
    # the same checkpoint conversion; Moments' own convert both ways, bitwise: test_a_state_converts_between_....
    x, run = FIVE.copy(), FIVE_RUN
    x[::7, 1] = 0
    whole = ss.run(ss.Moments(), x, mesh=WHOLE, **run)
    assert whole.count == 301 and (whole.zeros == [0, 43, 0, 0, 0]).all()
    np.testing.assert_array_equal(np.stack([whole.min, whole.max]), np.stack([x.min(0), x.max(0)]))
    for got, want in ((whole.mean, f64(x).mean(0)), (whole.var, f64(x).var(0)),
                      (whole.skewness, scipy.stats.skew(f64(x))), (whole.kurtosis, scipy.stats.kurtosis(f64(x)))):
        assert rel_err(got, want) < 1e-4
    higher = build_program(ss.Moments(), as_source(x), RunOptions(mesh="data:4,model:2", **run)).like.value.higher
    assert higher.shape == (4, 4, 6) and higher.sharding.shard_shape(higher.shape) == (1, 4, 3)

    def assert_whole(got):  # counts, minima and maxima bitwise; the moments to rounding (skewness: 1 ulp, with FMA)
        assert_to_rounding(got, whole, exact=("min", "max"))

    assert_whole(ss.run(ss.Moments(), x, mesh="data:4,model:2", **run))


def test_describe_split_over_model_is_pandas_describe():
    # The covariance test's rows, shards and micro-batch, with NaNs: each model device folds the moments
    # and sketch of its 3 of the 6 padded columns (its data:4 run: test_describe's, on other shards; a
    # pytree's split state: test_a_state_converts_between_whole_and_split). Nothing compacted: exact.
    x, run = FIVE.copy(), FIVE_RUN
    x[::5, 2] = np.nan
    like = build_program(ss.Describe(), as_source(x), RunOptions(mesh="data:4,model:2", **run)).like
    m2 = like.moments.centered.m2  # (shards, padded columns, 1, 1)
    assert m2.shape[:2] == (4, 6) and m2.sharding.shard_shape(m2.shape)[:2] == (1, 3)
    got = ss.run(ss.Describe(), x, mesh="data:4,model:2", **run)
    assert (got.nan_count == [0, 0, 61, 0, 0]).all() and (got.count == 301 - got.nan_count).all()
    np.testing.assert_array_equal(np.stack([got.min, got.max]), np.stack([np.nanmin(x, 0), np.nanmax(x, 0)]))
    np.testing.assert_array_equal(got.percentiles, np.nanquantile(x, [0.25, 0.5, 0.75], axis=0).T)
    assert rel_err(got.mean, np.nanmean(f64(x), 0)) < 1e-6 and rel_err(got.std, np.nanstd(f64(x), 0, ddof=1)) < 1e-6


def test_exact_quantiles_split_over_model_are_numpy_s_and_the_whole_ones():
    # test_quantiles' rows, sketch and shards, over the sketch test's mesh (its split sketch's programs are
    # the sketch pass's; data:4,model:2 would compile its own, ~2.5 s more): 6 columns padded to 8, 2 a
    # device, the last device's all padding, 2 shards a device. Compacted, so refining passes follow.
    # The whole run's answer is numpy's (test_quantiles, test_exact_counts): the split run's, numpy's exactly, is
    # bitwise it (one answer), with no run on data:4 compiling the refining passes once more.
    # numpy's default method, linear; bits=6 (65 boundaries a rank, not the default's 1025, whose operands' split
    # the estimate below checks): each refining step counts a sixteenth as much, in as many passes
    job = ss.Quantiles(qs=EXACT_QS, k=SKETCH.k, exact=True, bits=6)
    ranks = 2 * len(EXACT_QS)
    program = build_program(RefinePass(np.zeros((6, ranks, 1025), np.int64)), as_source(X),
                            RunOptions(mesh="data:2,model:4", **RUN))
    below = program.like.below.limbs  # (shards, padded columns, ranks, boundaries, limbs)
    assert below.shape[1] == 8 and below.sharding.shard_shape(below.shape)[1] == 2
    # Its boundaries (operands: uint32 keys, whether past every key) split the same way: each device
    # holds its 2 columns' (8 / 4), not the 6 whole, and the estimate counts that block (whole: 6 / 2 = 3x).
    for leaf in program.operands:
        assert leaf.shape[0] == 8 and {s.data.shape for s in leaf.addressable_shards} == {(2, ranks, 1025)}
    parts = admission.memory_estimate(program)
    assert parts["operands"] == 2 * ranks * 1025 * (4 + 1) == admission.operand_bytes(program, whole=True) // 4
    for alone in (True, False):  # they do not fit by themselves; they are the most of the peak
        advice = admission.axis_to_grow(program, {**parts, "operands": 8 << 30}, operands_alone=alone)
        assert "grow the mesh's 'model' axis" in advice and "no mesh axis" not in advice and "whole" not in advice
    split = ss.run(job, X, mesh="data:2,model:4", **RUN)
    np.testing.assert_array_equal(split.quantiles, np.quantile(f64(X), EXACT_QS, axis=0).T)
    assert split.passes >= 2 and split.rank_error == 0  # compacted, then refined
    part = X[:1001]  # 7.8 steps a pass: the same programs (a split state's resume: the conversions, below)
    np.testing.assert_array_equal(ss.run(job, part, mesh="data:2,model:4", **RUN).quantiles,
                                  np.quantile(f64(part), EXACT_QS, axis=0).T)


def test_split_co_moments_merge_whole_and_finalize_without_their_padding():
    # A split checkpoint of another shard count is folded whole on one device (relayout), outside
    # shard_map: the outer products then span the padded width. The results read the real columns.
    x, job = np.random.default_rng(1).normal(50, 1, size=(30, 6)).astype(np.float32), ss.Covariance()
    split = job.for_mesh(ss.make_mesh("data:2,model:4"))  # 6 columns padded to 8
    add = jax.jit(job.add)
    a, b = (add(job.init(ROW), x[i : i + 15], np.ones(15, bool)) for i in (0, 15))
    want = jax.device_get(jax.jit(job.merge)(a, b))
    to_split = jax.jit(lambda acc: split.convert(acc, job))
    got = jax.device_get(jax.jit(split.merge)(to_split(a), to_split(b)))
    assert got.m2.shape == (6, 8) and not got.m2[:, 6:].any()
    for result in (ss.Covariance, ss.Correlation):  # merged in programs of other widths: to rounding
        assert_to_rounding(result(model_shards=4).finalize(got), result().finalize(want))
    np.testing.assert_allclose(ss.Correlation(model_shards=4).finalize(got).corr, np.corrcoef(f64(x), rowvar=False),
                               rtol=0, atol=1e-6)


def test_the_covariance_memory_estimate_halves_over_model():
    wide = np.zeros((100, 255), np.float32)  # 255 columns: padded to 256 over model:2

    def per_device(mesh):
        return admission.memory_estimate(build_program(ss.Covariance(), as_source(wide),
                                                       RunOptions(mesh=mesh, microbatch=16)))

    whole, split = per_device("data:8"), per_device("data:4,model:2")  # one shard a device each
    assert split["accumulator"] <= 0.51 * whole["accumulator"] and split["merge"] <= 0.51 * whole["merge"]
    assert split["temporary"] < whole["temporary"]


def test_linear_regression_on_co_moments_splits_them_over_model_and_the_memory_estimate_sees_it():
    # The covariance test's rows, shards and micro-batch as (X, y): [X | y]'s 5 co-moment columns padded
    # to 6 over model:2, 3 a device; solver="comoments" only (the other solvers stay whole).
    x = FIVE[:, :4]
    y = (x @ np.float32([1, -2, 0.5, 3]) + (FIVE[:, 4] - 1e3) / 64 + 100).astype(np.float32)
    job = ss.LinearRegression(solver="comoments")
    whole = ss.run(job, (x, y), mesh=WHOLE, **FIVE_RUN)
    want = np.linalg.lstsq(np.hstack([f64(x), np.ones((301, 1))]), f64(y), rcond=None)[0]
    assert rel_err(whole.coef, want[:4]) < 1e-4 and rel_err(whole.intercept, want[4]) < 1e-4
    program, there = (build_program(job, as_source((x, y)), RunOptions(mesh=mesh, **FIVE_RUN))
                      for mesh in ("data:4,model:2", "data:4"))
    m2 = program.like.rows.value.m2  # beside the count of rows holding NaN (solvers.SolverAcc)
    assert m2.shape == (4, 5, 6) and m2.sharding.shard_shape(m2.shape) == (1, 5, 3)
    assert program.combiner.model_shards == 2 and ss.LinearRegression().for_mesh(program.mesh).model_shards == 1
    split, whole_state = (admission.memory_estimate(p, temporaries=False) for p in (program, there))
    assert split["accumulator"] < 0.75 * whole_state["accumulator"]  # 15 of 25 co-moments, the means, counts whole
    assert_to_rounding(ss.run(job, (x, y), mesh="data:4,model:2", **FIVE_RUN), whole)


TOPK = ss.TopK(k=2, capacity=4)
ROW, ONE, WEIGHTS = (jax.ShapeDtypeStruct(shape, np.float32) for shape in ((6,), (), ()))
REFINE = RefinePass(np.zeros((6, 2, 5), np.int64))  # an exact pass's bin counts: 6 columns, 2 ranks, 4 bins


@pytest.mark.parametrize(("job", "spec"), [(SKETCH, ROW), (SKETCH, ONE), (ss.Histogram(7, (0, 1)), ROW),
                                         (ss.Weighted(ss.Histogram(7, (0, 1))), (WEIGHTS, ROW)),
                                         (ss.DistinctCount(precision=8, exact_up_to=64), ROW),
                                         (ss.DistinctCount(precision=8, exact_up_to=64), ONE),
                                         (TOPK, ROW), (ss.Weighted(TOPK), (WEIGHTS, ROW)),
                                         (ss.GroupBy(TOPK, 3), (jax.ShapeDtypeStruct((), np.int32), ROW)),
                                         (ss.Weighted(ss.Correlation()), (WEIGHTS, ROW)), (ss.Moments(), ROW),
                                         (ss.GroupBy(ss.Weighted(ss.Moments()), 3),
                                          (jax.ShapeDtypeStruct((), np.int32), (WEIGHTS, ROW))),
                                         (ss.Describe(), (ROW, ONE)), (REFINE, ROW),
                                         (ss.LinearRegression(solver="comoments"), (ROW, ONE)),
                                         (ss.PCA(2, solver="comoments"), ROW),
                                         (Each((REFINE, RefinePass(np.zeros((1, 2, 5), np.int64))),
                                               jax.tree.structure((0, 0))), (ROW, ONE))])
def test_a_state_converts_between_whole_and_split(job, spec):  # a resume on a mesh with other axes
    rng = np.random.default_rng(0)
    split = job.for_mesh(ss.make_mesh("data:2,model:4"))
    acc = jax.tree.map(lambda x: rng.integers(0, 100, x.shape).astype(x.dtype), jax.eval_shape(job.init, spec))
    there = jax.jit(lambda acc: split.convert(acc, job))(acc)  # one program, as a resume runs it
    assert jax.tree.map(np.shape, there) == jax.tree.map(np.shape, jax.eval_shape(split.init, spec))
    assert_bitwise(jax.jit(lambda acc: job.convert(acc, split))(there), acc)
