"""The symmetric (upper-triangle block rows) Gram: exact against float64, half the bytes."""

import jax
import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan import compiled, layout
from sharded_scan.combiners.statistics.sums import Triangle, default_block, triangle_full
from sharded_scan.program import program_for_spec
from tests.helpers import f64, rel_err


def rows(n, d, seed=0):
    return np.random.default_rng(seed).normal(size=(n, d)).astype(np.float32)


# Each block layout once: the layout is the step's, the mesh only the psum of its row blocks (one all-reduce of
# the pytree); the ragged layouts (a short last block) on eight devices, the whole-block ones on one.
@pytest.mark.parametrize("d, block, mesh", [(1, None, "data:1"), (7, 3, "data:8"), (16, 16, "data:1"),
                                            (33, 8, "data:8"), (40, 64, "data:1"), (130, None, "data:8"),
                                            (300, 128, "data:8")])
def test_triangle_gram_matches_float64(d, block, mesh):
    x = rows(301, d)
    got = ss.run(ss.Gram(block=block), x, mesh=mesh, microbatch=16, steps_per_call=2)
    want = f64(x).T @ f64(x)
    assert got.shape == (d, d)
    assert rel_err(got, want) < 1e-5
    np.testing.assert_array_equal(got, got.T)


def test_block_rows_cover_the_upper_triangle_once():
    acc = ss.Gram(block=3).init(jax.ShapeDtypeStruct((8,), np.float32))
    assert isinstance(acc, Triangle)
    assert [r.shape for r in acc.rows] == [(3, 8), (3, 5), (2, 2)]
    filled = Triangle(tuple(np.ones(r.shape, np.float32) for r in acc.rows))
    np.testing.assert_array_equal(triangle_full(filled), np.ones((8, 8)))


@pytest.mark.parametrize("d", [512, 1024])
def test_partials_and_merge_bytes_are_about_half(d):
    spec = jax.ShapeDtypeStruct((d,), np.float32)
    sizes = {}
    for name, g in (("triangle", ss.Gram()), ("dense", ss.Gram(block=d))):
        partials = program_for_spec(g, spec, 8, ss.RunOptions(mesh="data:8", compensated=False)).init()
        sizes[name] = sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(partials))
    assert sizes["dense"] == d * d * 4
    block = default_block(d)
    assert sizes["triangle"] * 2 == pytest.approx(d * (d + block) * 4, rel=1e-9)
    assert sizes["triangle"] < sizes["dense"]


def test_default_microbatch_is_a_byte_budget_with_a_row_cap():
    mb = [layout.default_microbatch(jax.ShapeDtypeStruct((d,), np.float32)) for d in (32, 256, 1024)]
    assert mb[1:] == [layout.DEFAULT_MICROBATCH_BYTES // (4 * d) for d in (256, 1024)]
    assert mb[0] == layout.MICROBATCH_RANGE[1] < layout.DEFAULT_MICROBATCH_BYTES // (4 * 32)
    tiny = layout.default_microbatch(jax.ShapeDtypeStruct((), np.int8))
    assert tiny == layout.MICROBATCH_RANGE[1]


def test_default_steps_give_each_shard_a_byte_floor_per_step():
    for d in (32, 256, 1024):
        spec = jax.ShapeDtypeStruct((d,), np.float32)
        mb, spc = layout.resolve_chunking(spec)
        assert spc >= layout.MIN_STEPS_PER_CALL
        assert mb * spc * 4 * d >= layout.STEP_BYTES_PER_SHARD
        assert spc == layout.MIN_STEPS_PER_CALL or mb * (spc // 2) * 4 * d < layout.STEP_BYTES_PER_SHARD
    assert layout.resolve_chunking(jax.ShapeDtypeStruct((32,), np.float32), 64, 3) == (64, 3)
    assert layout.resolve_chunking(jax.ShapeDtypeStruct((32,), np.float32))[1] == 16


def test_repeated_runs_reuse_the_compiled_step():
    x = rows(500, 16)  # test_triangle_gram_matches_float64's (16, 16, data:1) step: its compiled program, cached
    job = {"mesh": "data:1", "microbatch": 16, "steps_per_call": 2}
    compiled.compile_step.cache_clear()
    for _ in range(3):
        ss.run(ss.Gram(), x, **job)
    assert compiled.compile_step.cache_info().misses == 1
    for n in (470, 321):  # another row count, the same step shape
        ss.run(ss.Gram(), x[:n], **job)
    assert compiled.compile_step.cache_info().misses == 1


def test_bad_block_is_one_clear_line():
    with pytest.raises(ss.UsageError, match="block"):
        ss.run(ss.Gram(block=0), rows(10, 4))
