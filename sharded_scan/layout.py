"""Which rows each step, device and process handles.

The rows are folded by ``logical_shards`` independent accumulators (by default one per
device of the ``data`` axis). A step covers ``rows_per_step = logical_shards *
steps_per_call * microbatch`` consecutive rows starting at the cursor; logical shard ``l``
takes the ``l``-th block of ``rows_per_shard = steps_per_call * microbatch`` rows of it and
folds them as ``steps_per_call`` micro-batches, in order. Device ``i`` holds the
consecutive shards ``[i * k, (i + 1) * k)`` with ``k = logical_shards / data_size``, so
which rows a shard folds, and in what order, does not depend on the device count. A
process reads only the blocks of its own devices.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sharded_scan.codegen import SMALL_JOB_VALUES
from sharded_scan.errors import UsageError
from sharded_scan.mesh import DATA_AXIS

# From the sweep in bench/results/bench.json (Gram on 8 simulated CPU devices): the best
# micro-batch holds about the same bytes whatever the row width (4096 rows at d=256, 1024
# at d=1024), except that narrow rows want at most 16384 rows a micro-batch (2 MiB at
# d=32: 1.6x faster than 32768); so the default is a byte budget with a row cap.
DEFAULT_MICROBATCH_BYTES = 4 << 20
MICROBATCH_RANGE = (256, 1 << 14)
# A compiled step has a fixed cost (dispatch, waiting for the slowest device), so small
# micro-batches get more of them per step: at least STEP_BYTES_PER_SHARD of rows per
# logical shard (8 steps of 4 MiB; 16 of 2 MiB at d=32, 1.4x faster there than 8).
MIN_STEPS_PER_CALL = 8
STEP_BYTES_PER_SHARD = 32 << 20
# ...but a job of a few steps leaves the prefetch nothing to hide reads behind (the first step's
# read is never hidden: a 512 MiB .npy of 2 steps on 8 devices overlapped 0.78, bench/streaming.py),
# so by default a step is at most about 1/MIN_JOB_STEPS of the job, down to one micro-batch per shard
# (a power of two: the step boundaries of the larger default steps stay step boundaries). Ramping the first
# steps up instead would not help where reads are as slow as the compute (a run takes every read plus its
# largest step's compute); the cost is XLA's per execution (on 8 simulated CPU devices over 2 cores about
# 0.4 ms a step: Gram d=32 of 256 MiB at 0.84x its uncapped rate; bench/README.md, DESIGN.md "Decisions, measured").
MIN_JOB_STEPS = 16
# With logical_shards fixed a shard folds micro-batches of at most this many rows (and
# whitened.py merges in blocks of as many). The cap kept XLA:CPU's matmul library from
# splitting a sum between threads (longer dots differed between processes of 1 and 8
# devices); that guarantee now comes from fixed_order.py, which fixes every rounding of the products of such
# a job on CPU, and the cap stays so that those jobs' layout, and so
# their checkpoints' fingerprint, stays what it was.
REPRODUCIBLE_MICROBATCH = 256
# A job smaller than one step runs a micro-batch of the power of two at or above its rows per shard, at least
# this many rows (never more than asked): on 8 devices every job of up to 64 rows runs one step program, and
# one of up to 8 x 16384 rows one of 12, where each rows-per-shard count compiled its own (2.5-4 CPU-s each).
# The rows past the data are masked (they fold nothing): fewer than 8 a shard, or than the rows it needs, more.
SMALL_MICROBATCH = 8
# A job of fewer values than codegen.SMALL_JOB_VALUES (rows x values a row, 16 MiB of float64 at most) runs by
# default one micro-batch a shard, its rows a shard rounded up to an eighth of a power of two (eighth_octave): a
# micro-batch's fixed costs (a sketch's compaction) are paid once, not every 16,384 rows. A 200,000 x 8 Describe's
# 13 micro-batches ran 0.46 CPU-s with its cheaply compiled step, one of 262,144 rows 0.27 (0.23 -> 0.16
# optimized), with nothing else to overlap: the whole job is one read of at most 16 MiB (bench/README.md).


def small_step_size(needed: int, asked: int, floor: int = 1) -> int:
    """``asked`` (micro-batch rows or micro-batches a step), shrunk for a job that needs only ``needed``: the
    power of two at or above ``needed`` and ``floor``, never above ``asked``. Row counts that round alike share
    one compiled step (rows past the data are masked: they fold nothing)."""
    return int(min(asked, max(floor, 1 << max(int(needed) - 1, 0).bit_length())))


def row_bytes(spec: Any) -> int:
    """Bytes of one row of ``spec`` (all leaves)."""
    return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(spec))


def eighth_octave(rows: int) -> int:
    """``rows`` rounded up to a multiple of an eighth of the power of two at or above it (at most 1/8 more rows):
    jobs of nearby row counts share one size, and so one compiled step."""
    unit = 1 << max(max(int(rows) - 1, 0).bit_length() - 3, 0)
    return -(-int(rows) // unit) * unit


def row_values(spec: Any) -> int:
    """Values in one row of ``spec`` (all leaves)."""
    return sum(int(np.prod(s.shape)) for s in jax.tree.leaves(spec))


def default_microbatch(spec: Any, values: int = 0) -> int:
    """The power-of-two row count nearest ``DEFAULT_MICROBATCH_BYTES`` of rows of ``spec``,
    within ``MICROBATCH_RANGE``; or, if more, the one nearest ``values`` values (rows x values a row:
    a combiner's ``microbatch_values``, whose fixed costs a micro-batch amortize over more rows)."""
    rows = 2 ** round(np.log2(max(DEFAULT_MICROBATCH_BYTES / max(row_bytes(spec), 1), 1)))
    rows = int(np.clip(rows, *MICROBATCH_RANGE))
    if values:
        rows = max(rows, 2 ** round(np.log2(max(values / max(row_values(spec), 1), 1))))
    return int(rows)


def default_steps_per_call(spec: Any, microbatch: int) -> int:
    """Micro-batches per compiled step: ``MIN_STEPS_PER_CALL``, or the power of two that
    makes a step hold ``STEP_BYTES_PER_SHARD`` of rows per logical shard if that is more."""
    micro_bytes = max(int(microbatch) * row_bytes(spec), 1)
    return int(max(MIN_STEPS_PER_CALL, 2 ** int(np.ceil(np.log2(max(STEP_BYTES_PER_SHARD / micro_bytes, 1))))))


def job_steps_cap(num_rows: int, shards: int, microbatch: int) -> int:
    """The most micro-batches a step may fold per shard for a job of ``num_rows`` rows over ``shards``
    logical shards to have at least ``MIN_JOB_STEPS`` steps: a power of two, at least 1."""
    per_step = num_rows / (max(int(shards), 1) * max(int(microbatch), 1) * MIN_JOB_STEPS)
    return 2 ** int(np.floor(np.log2(per_step))) if per_step >= 1 else 1


def resolve_chunking(
    spec: Any, microbatch: int | None = None, steps_per_call: int | None = None, num_rows: int | None = None,
    shards: int = 1, values: int = 0,
) -> tuple[int, int]:
    """``(microbatch, steps_per_call)`` with each None replaced by its default for rows of ``spec``
    (the values as :class:`~sharded_scan.options.RunOptions` checked them).

    Given the job's ``num_rows`` and its logical ``shards``, a default ``steps_per_call`` is also
    capped by :func:`job_steps_cap`, so the prefetch has steps to hide the reads behind, and a small job (fewer
    than :data:`~sharded_scan.codegen.SMALL_JOB_VALUES` values) gets a default micro-batch of all its rows a shard
    (rounded up: :func:`eighth_octave`); a larger job, at least the combiner's ``values``
    (``Combiner.microbatch_values``: :func:`default_microbatch`). The result depends on the job alone (rows, spec,
    shards, combiner), never on timing.
    """
    if microbatch is None:
        if num_rows is not None and num_rows * max(row_values(spec), 1) < SMALL_JOB_VALUES:
            microbatch = max(default_microbatch(spec), eighth_octave(math.ceil(num_rows / max(int(shards), 1))))
        else:  # a small job folds one micro-batch a shard already: a larger one would only mask more rows
            microbatch = default_microbatch(spec, values)
    if steps_per_call is None:
        steps_per_call = default_steps_per_call(spec, microbatch)
        if num_rows is not None:
            steps_per_call = min(steps_per_call, job_steps_cap(num_rows, shards, microbatch))
    return microbatch, steps_per_call


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a dataset of ``num_rows`` rows is cut into steps on a mesh."""

    num_rows: int
    data_size: int
    microbatch: int
    steps_per_call: int
    local_blocks: tuple[int, int]  # [first, last) data-axis index held by this process
    logical_shards: int = 0  # 0: one per device

    @property
    def num_shards(self) -> int:
        """Logical shards: independent accumulators, ``shards_per_device`` on each device."""
        return self.logical_shards or self.data_size

    @property
    def shards_per_device(self) -> int:
        return self.num_shards // self.data_size

    @property
    def rows_per_shard(self) -> int:
        return self.microbatch * self.steps_per_call

    @property
    def rows_per_device(self) -> int:
        return self.shards_per_device * self.rows_per_shard

    @property
    def rows_per_step(self) -> int:
        return self.data_size * self.rows_per_device

    @property
    def step_shape(self) -> Layout:
        """This layout with only what a compiled step depends on (not the row count or the process)."""
        return dataclasses.replace(self, num_rows=0, local_blocks=(0, 0))

    def num_steps(self, cursor: int = 0) -> int:
        """Steps left from row ``cursor`` to the end."""
        return math.ceil(max(self.num_rows - cursor, 0) / self.rows_per_step)

    def local_range(self, cursor: int) -> tuple[int, int]:
        """Rows ``[start, stop)`` this process feeds in the step starting at ``cursor``.

        ``stop`` may pass ``num_rows``: those rows are padding.
        """
        first, last = self.local_blocks
        return cursor + first * self.rows_per_device, cursor + last * self.rows_per_device


def make_layout(
    num_rows: int, mesh: Mesh, microbatch: int, steps_per_call: int, logical_shards: int | None = None
) -> Layout:
    """Builds the layout, shrinking micro-batch and steps for datasets smaller than one step.

    The layout's ``microbatch`` is the one the compiled programs run and the job's
    fingerprint names. The arguments are positive integers, as
    :class:`~sharded_scan.options.RunOptions` checked them.

    Args:
      num_rows: rows in the dataset.
      mesh: the mesh; rows are split over its ``data`` axis.
      microbatch: rows per scan iteration of one logical shard.
      steps_per_call: micro-batches each logical shard folds per compiled step.
      logical_shards: fixed number of independent accumulators, a multiple of the
        ``data`` axis size; None for one per device.

    Raises:
      UsageError: ``logical_shards`` is not a multiple of the ``data`` axis size, or this
        process's devices are not contiguous on the ``data`` axis.
    """
    data_size = mesh.shape[DATA_AXIS]
    if logical_shards is not None and logical_shards % data_size:
        raise UsageError(
            f"logical_shards={logical_shards} is not a multiple of the mesh's {data_size} 'data' "
            "devices; pick a multiple, e.g. the largest device count you will use."
        )
    shards = int(logical_shards or data_size)
    # Never pad a small dataset out to a huge step, but round what it needs up to a canonical size
    # (small_step_size), so that jobs of nearby row counts run the same compiled step. This depends on the
    # shard count only, so a fixed logical_shards gives the same layout on every mesh.
    microbatch = small_step_size(math.ceil(num_rows / shards), microbatch, SMALL_MICROBATCH)
    steps_per_call = small_step_size(math.ceil(num_rows / (shards * microbatch)), steps_per_call)
    if logical_shards is not None and microbatch > REPRODUCIBLE_MICROBATCH:
        # The same rows a step, folded in micro-batches whose dots XLA never splits by thread.
        steps_per_call *= math.ceil(microbatch / REPRODUCIBLE_MICROBATCH)
        microbatch = REPRODUCIBLE_MICROBATCH
    return Layout(
        num_rows, data_size, microbatch, steps_per_call, local_data_blocks(mesh), int(logical_shards or 0)
    )


def local_data_blocks(mesh: Mesh) -> tuple[int, int]:
    """The ``[first, last)`` data-axis indices that have a device of this process."""
    axis = mesh.axis_names.index(DATA_AXIS)
    devices = np.moveaxis(mesh.devices, axis, 0).reshape(mesh.shape[DATA_AXIS], -1)
    me = jax.process_index()
    mine = [i for i in range(devices.shape[0]) if any(d.process_index == me for d in devices[i])]
    if not mine or mine != list(range(mine[0], mine[-1] + 1)):
        raise UsageError(
            f"process {me}'s devices are not contiguous on the mesh's 'data' axis; "
            "put the 'data' axis first in the mesh spec."
        )
    return mine[0], mine[-1] + 1


def data_sharding(mesh: Mesh) -> NamedSharding:
    """Rows split over the ``data`` axis, replicated over any other axis."""
    return NamedSharding(mesh, P(DATA_AXIS))

