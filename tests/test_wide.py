"""Wide accumulators: on a mesh with a ``model`` axis Gram splits its (d, d) by columns."""

import jax
import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan.program import program_for_spec
from tests.helpers import collectives, f64, rel_err


def rows(n, d, seed=0):
    return np.random.default_rng(seed).normal(size=(n, d)).astype(np.float32)


@pytest.mark.parametrize("d", [1, 5, 8, 64])
@pytest.mark.parametrize("n", [3, 97, 1000])
def test_wide_gram_matches_float64(d, n):
    x = rows(n, d)
    got = ss.run(ss.Gram(), x, mesh="data:4,model:2", microbatch=16, steps_per_call=2)
    assert got.shape == (d, d)
    assert rel_err(got, f64(x).T @ f64(x)) < 1e-5


@pytest.mark.parametrize("mesh_spec, model", [("data:4,model:2", 2), ("data:2,model:4", 4)])
def test_each_device_holds_its_column_block(mesh_spec, model):
    d = 64
    spec = jax.ShapeDtypeStruct((d,), np.float32)
    prog = program_for_spec(ss.Gram(), spec, 4, ss.RunOptions(mesh=mesh_spec, compensated=False))
    partials = prog.init()
    shapes = {s.data.shape for s in partials.addressable_shards}
    assert shapes == {(1, d, d // model)}  # (d, d/M): d²/M of the matrix on each device
    merged = prog.merge(partials)
    assert {s.data.shape for s in merged.addressable_shards} == {(d, d // model)}


def test_wide_step_has_no_collective_and_merge_never_gathers():
    d = 32
    spec = jax.ShapeDtypeStruct((d,), np.float32)
    options = ss.RunOptions(mesh="data:4,model:2", microbatch=16, steps_per_call=4)
    prog = program_for_spec(ss.Gram(), spec, 10_000, options)
    step = prog.lower_step().compile().as_text()
    merge = prog.lower_merge().compile().as_text()
    assert collectives(step) == []
    assert collectives(merge) and set(collectives(merge)) == {"all-reduce"}


def test_replicated_combiners_are_unchanged_on_a_model_mesh():
    x = rows(77, 6)
    got = ss.run(ss.Sum(), x, mesh="data:4,model:2", microbatch=4)
    assert rel_err(got.sum, f64(x).sum(0)) < 1e-5
    assert ss.Sum().partition(ss.make_mesh("data:4,model:2")) is None
    assert ss.Gram().for_mesh(ss.make_mesh("data:8")).partition(ss.make_mesh("data:8")) is None
