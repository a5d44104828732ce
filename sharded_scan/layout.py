"""Which rows each step, device and process handles.

A step covers ``rows_per_step = data_size * steps_per_call * microbatch`` consecutive
rows starting at the cursor. Device ``i`` of the ``data`` axis takes the ``i``-th block of
``rows_per_device = steps_per_call * microbatch`` rows of it, and scans them as
``steps_per_call`` micro-batches. A process reads only the blocks of its own devices.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sharded_scan.errors import UsageError
from sharded_scan.mesh import DATA_AXIS


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a dataset of ``num_rows`` rows is cut into steps on a mesh."""

    num_rows: int
    data_size: int
    microbatch: int
    steps_per_call: int
    local_blocks: tuple[int, int]  # [first, last) data-axis index held by this process

    @property
    def rows_per_device(self) -> int:
        return self.microbatch * self.steps_per_call

    @property
    def rows_per_step(self) -> int:
        return self.data_size * self.rows_per_device

    def num_steps(self, cursor: int = 0) -> int:
        """Steps left from row ``cursor`` to the end."""
        return math.ceil(max(self.num_rows - cursor, 0) / self.rows_per_step)

    def local_range(self, cursor: int) -> tuple[int, int]:
        """Rows ``[start, stop)`` this process feeds in the step starting at ``cursor``.

        ``stop`` may pass ``num_rows``: those rows are padding.
        """
        first, last = self.local_blocks
        return cursor + first * self.rows_per_device, cursor + last * self.rows_per_device


def make_layout(num_rows: int, mesh: Mesh, microbatch: int, steps_per_call: int) -> Layout:
    """Builds the layout, shrinking micro-batch and steps for datasets smaller than one step.

    Raises:
      UsageError: ``microbatch`` or ``steps_per_call`` is not a positive integer, or
        this process's devices are not contiguous on the ``data`` axis.
    """
    for name, value in (("microbatch", microbatch), ("steps_per_call", steps_per_call)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise UsageError(f"{name} must be a positive integer, got {value!r}.")
    data_size = mesh.shape[DATA_AXIS]
    # Never pad a small dataset out to a huge step: the result does not depend on these.
    microbatch = int(min(microbatch, max(1, math.ceil(num_rows / data_size))))
    steps_per_call = int(min(steps_per_call, max(1, math.ceil(num_rows / (data_size * microbatch)))))
    return Layout(num_rows, data_size, microbatch, steps_per_call, local_data_blocks(mesh))


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


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole value."""
    return NamedSharding(mesh, P())
