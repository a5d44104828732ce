"""Default chunking: jobs get steps enough for the prefetch to hide reads; resuming across the change works."""

import math

import jax
import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan.layout import MIN_JOB_STEPS, make_layout, resolve_chunking
from sharded_scan.mesh import make_mesh
from tests.helpers import CrashError, crash_at

ROW = jax.ShapeDtypeStruct((256,), np.float32)  # 1 KiB rows: 4096-row micro-batches


def default_layout(num_rows, shards=8):
    return make_layout(num_rows, make_mesh("data:8"), *resolve_chunking(ROW, num_rows=num_rows, shards=shards))


def test_a_job_of_a_few_hundred_mib_gets_steps_for_the_prefetch():
    assert resolve_chunking(ROW) == (4096, 8)  # no job: the measured default step, 32 MiB a shard
    half_gib = default_layout(512 << 10)  # 512 MiB on 8 shards: 2 steps of the measured default
    assert half_gib.num_steps() == MIN_JOB_STEPS and half_gib.microbatch == 4096
    two_gib = default_layout(2 << 20)
    assert (two_gib.num_steps(), two_gib.steps_per_call) == (MIN_JOB_STEPS, 4)
    assert default_layout(8 << 20).steps_per_call == 8  # large jobs keep the measured step
    assert default_layout(10_000).num_steps() == 1  # one micro-batch a shard is the smallest step


@pytest.mark.parametrize("num_rows", [(512 << 10) + 4097, (3 << 20) - 5, 123_457])
def test_the_default_steps_depend_on_the_job_alone_and_divide_the_measured_ones(num_rows):
    capped, measured = default_layout(num_rows), resolve_chunking(ROW)
    assert capped == default_layout(num_rows)
    assert capped.num_steps() >= MIN_JOB_STEPS or capped.steps_per_call == 1
    assert measured[1] % capped.steps_per_call == 0  # the old step boundaries are boundaries of the new steps
    # a fixed logical_shards: the same steps on every mesh
    four = make_layout(num_rows, make_mesh("data:4"), *resolve_chunking(ROW, num_rows=num_rows, shards=8), 8)
    eight = make_layout(num_rows, make_mesh("data:8"), *resolve_chunking(ROW, num_rows=num_rows, shards=8), 8)
    assert (four.rows_per_step, four.num_steps()) == (eight.rows_per_step, eight.num_steps())


def test_a_small_job_runs_one_micro_batch_a_shard_of_its_rows_rounded_up():
    """Below codegen.SMALL_JOB_VALUES values (rows x values a row) the default micro-batch is all of a shard's rows,
    rounded up to an eighth of a power of two: one step of one micro-batch, not 13 of 16,384 rows (a 200,000 x 8
    Describe); a micro-batch asked for is kept, and a job at the bound keeps the measured default."""
    from sharded_scan.codegen import SMALL_JOB_VALUES
    from sharded_scan.layout import eighth_octave
    assert [eighth_octave(n) for n in (1, 8, 9, 17, 16_384, 16_385, 200_000)] == [1, 8, 10, 20, 16_384, 20_480, 229_376]
    eight = jax.ShapeDtypeStruct((8,), np.float64)
    assert resolve_chunking(eight, num_rows=200_000) == (229_376, 1)  # 1/8 more rows at most
    assert resolve_chunking(eight, num_rows=200_000, shards=8) == (28_672, 1)  # 25,000 rows a shard
    layout = make_layout(200_000, make_mesh("data:1"), *resolve_chunking(eight, num_rows=200_000))
    assert (layout.num_steps(), layout.microbatch, layout.steps_per_call) == (1, 229_376, 1)
    small = make_layout(20_000, make_mesh("data:8"), *resolve_chunking(eight, num_rows=20_000, shards=8))
    assert small.microbatch == 4096  # 2,500 rows a shard, below the default micro-batch: a power of two, as before
    assert resolve_chunking(eight, 4096, num_rows=200_000) == (4096, 2)  # asked for: kept
    assert resolve_chunking(eight, num_rows=SMALL_JOB_VALUES // 8) == (16_384, 1)  # at the bound: the default


def test_explicit_steps_per_call_is_kept():
    assert resolve_chunking(ROW, steps_per_call=8, num_rows=512 << 10, shards=8) == (4096, 8)


def test_a_checkpoint_of_the_larger_steps_resumes_at_the_default_steps(tmp_path):
    x = np.random.default_rng(0).integers(-50, 50, size=(2000, 3)).astype(np.float32)  # sums exact in float32
    with pytest.raises(CrashError):  # the default before the cap: 8 micro-batches of 8 rows a shard a step
        ss.run(ss.Sum(), x, mesh="data:8", microbatch=8, steps_per_call=8, progress=crash_at(2),
               checkpoint=ss.CheckpointOptions(str(tmp_path), every_steps=1))
    got, report = ss.run_with_report(ss.Sum(), x, mesh="data:8", microbatch=8,
                                     checkpoint=ss.CheckpointOptions(str(tmp_path), every_steps=100))
    assert report.resumed_from_cursor == 512 and report.steps == math.ceil((2000 - 512) / 64)  # 64-row steps now
    np.testing.assert_array_equal(got.sum, x.sum(0))
    assert int(got.count) == 2000
