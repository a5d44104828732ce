"""Wide accumulators over ``model``: a sketch split by columns (issue 29, item 2).

The split runs the whole sketch's per-column arithmetic and random bits, so on the same
shards (``logical_shards``) its result is bitwise that of a mesh without ``model``.
"""

import jax
import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan import admission
from sharded_scan.options import RunOptions
from sharded_scan.program import build_program
from sharded_scan.sources import as_source
from tests.test_quantiles import KW, SKETCH, shaped

# test_quantiles' sketch, rows (3001: ragged) and programs: its data:4 run is the reference here.
X = shaped(3001)  # 6 columns: over model:4 padded to 8, 2 a device, the last device's both padding
RUN = dict(KW, logical_shards=4)


def assert_bitwise(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def whole():
    result = ss.run(SKETCH, X, mesh="data:4", **RUN)  # bitwise data:1's, data:2's (test_quantiles)
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


def test_a_histogram_splits_its_counts_by_columns():  # test_histogram checks them on data:4,model:2
    counts = build_program(ss.Histogram(7, (0, 1)), as_source(X), RunOptions(mesh="data:2,model:4")).like.value.counts
    assert counts.limbs.shape[1] == 8 and counts.limbs.sharding.shard_shape(counts.limbs.shape)[1] == 2


TOPK = ss.TopK(k=2, capacity=4)
ROW, ONE, WEIGHTS = (jax.ShapeDtypeStruct(shape, np.float32) for shape in ((6,), (), ()))


@pytest.mark.parametrize(("job", "spec"), [(SKETCH, ROW), (SKETCH, ONE), (ss.Histogram(7, (0, 1)), ROW),
                                         (ss.DistinctCount(precision=8, exact_up_to=64), ROW),
                                         (ss.DistinctCount(precision=8, exact_up_to=64), ONE),
                                         (TOPK, ROW), (ss.Weighted(TOPK), (WEIGHTS, ROW)),
                                         (ss.GroupBy(TOPK, 3), (jax.ShapeDtypeStruct((), np.int32), ROW))])
def test_a_state_converts_between_whole_and_split(job, spec):  # a resume on a mesh with other axes
    rng = np.random.default_rng(0)
    split = job.for_mesh(ss.make_mesh("data:2,model:4"))
    acc = jax.tree.map(lambda x: rng.integers(0, 100, x.shape).astype(x.dtype), jax.eval_shape(job.init, spec))
    there = jax.jit(lambda acc: split.convert(acc, job))(acc)  # one program, as a resume runs it
    assert jax.tree.map(np.shape, there) == jax.tree.map(np.shape, jax.eval_shape(split.init, spec))
    assert_bitwise(jax.jit(lambda acc: job.convert(acc, split))(there), acc)
