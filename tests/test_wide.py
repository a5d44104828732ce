"""Wide accumulators: on a mesh with a ``model`` axis Gram splits its (d, d) by columns."""

import jax
import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan import engine
from sharded_scan.combiners.wrappers import apply_policies
from sharded_scan.layout import make_layout
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
    mesh = ss.make_mesh(mesh_spec)
    combiner = apply_policies(ss.Gram(), compensated=False)
    spec = jax.ShapeDtypeStruct((d,), np.float32)
    partials = engine.init_partials(combiner, spec, mesh)
    shapes = {s.data.shape for s in partials.addressable_shards}
    assert shapes == {(1, d, d // model)}  # (d, d/M): d²/M of the matrix on each device
    merged = engine.build_merge(combiner, mesh)(partials)
    assert {s.data.shape for s in merged.addressable_shards} == {(d, d // model)}


def test_wide_step_has_no_collective_and_merge_never_gathers():
    d = 32
    mesh = ss.make_mesh("data:4,model:2")
    combiner = apply_policies(ss.Gram())
    spec = jax.ShapeDtypeStruct((d,), np.float32)
    layout = make_layout(10_000, mesh, 16, 4)
    partials = engine.init_partials(combiner, spec, mesh)
    batch = jax.ShapeDtypeStruct((layout.rows_per_step, d), np.float32)
    step = engine.build_step(combiner, mesh, layout).lower(partials, batch, np.int32(0)).compile().as_text()
    merge = engine.build_merge(combiner, mesh).lower(partials).compile().as_text()
    assert collectives(step) == []
    assert collectives(merge) and set(collectives(merge)) == {"all-reduce"}


def test_replicated_combiners_are_unchanged_on_a_model_mesh():
    x = rows(77, 6)
    got = ss.run(ss.Sum(), x, mesh="data:4,model:2", microbatch=4)
    assert rel_err(got.sum, f64(x).sum(0)) < 1e-5
    assert ss.Sum().partition(ss.make_mesh("data:4,model:2")) is None
    assert ss.Gram().for_mesh(ss.make_mesh("data:8")).partition(ss.make_mesh("data:8")) is None
