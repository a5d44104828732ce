"""Reads each step's rows on the host and places them on the devices ahead of use."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

from sharded_scan.layout import Layout, data_sharding
from sharded_scan.sources import Source

PyTree = Any


class DeviceBatch(NamedTuple):
    """One step's rows on the devices."""

    cursor: int        # first row of the step
    batch: PyTree      # global jax.Arrays of rows_per_step rows, sharded over 'data'
    num_valid: int     # rows of the step that are real (the rest is zero padding)


def read_local(source: Source, layout: Layout, cursor: int) -> PyTree:
    """Reads this process's rows of the step at ``cursor``, zero-padded past the end."""
    start, stop = layout.local_range(cursor)
    rows = source.read(min(start, source.num_rows), min(stop, source.num_rows))
    short = stop - start - (min(stop, source.num_rows) - min(start, source.num_rows))
    if short:
        rows = jax.tree.map(
            lambda x: np.concatenate([x, np.zeros((short,) + x.shape[1:], x.dtype)]), rows
        )
    return rows


def place(rows: PyTree, layout: Layout, mesh: Mesh) -> PyTree:
    """Builds the global step arrays from this process's host rows."""
    sharding = data_sharding(mesh)
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(
            sharding, x, (layout.rows_per_step,) + x.shape[1:]
        ),
        rows,
    )


def device_batches(
    source: Source, layout: Layout, mesh: Mesh, cursor: int = 0, prefetch: int = 2
) -> Iterator[DeviceBatch]:
    """Yields every step from ``cursor`` on, placed on the devices."""
    del prefetch  # TODO(streaming): reader thread and placement ahead of use.
    while cursor < layout.num_rows:
        rows = read_local(source, layout, cursor)
        num_valid = min(layout.rows_per_step, layout.num_rows - cursor)
        yield DeviceBatch(cursor, place(rows, layout, mesh), num_valid)
        cursor += layout.rows_per_step
