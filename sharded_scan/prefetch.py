"""Reads each step's rows on the host and places them on the devices ahead of use.

With ``prefetch=p > 0`` one daemon reader thread walks the steps in order: it reads
this process's rows of a step from the source (``Layout.local_range``), builds the
global step arrays with ``jax.make_array_from_process_local_data`` and puts them in a
queue of at most ``p`` steps. While the devices fold step ``i``, steps ``i+1 .. i+p``
are read and placed; the reader then waits, so host and device memory stay bounded by
``p + 2`` steps whatever the dataset size. ``prefetch=0`` reads and places each step
only when it is asked for, in the caller's thread.

A reader error is raised in the caller: a :class:`UsageError` as it is, anything else
as :class:`ReadError` chained to its cause. Closing the generator (end of loop, an
exception or Ctrl-C in the caller) stops the reader and joins it. The reader places
under the caller's 64-bit setting (``jax.enable_x64`` is thread-local): a run scoped
under :func:`sharded_scan.dtypes.x64_scope` places float64 rows as float64.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
from jax.sharding import Mesh

from sharded_scan.dtypes import FLUSHES_SUBNORMALS, check_placeable, holds_subnormals
from sharded_scan.errors import UsageError
from sharded_scan.layout import Layout, data_sharding
from sharded_scan.sources import Source

PyTree = Any

__all__ = ["DeviceBatch", "ReadError", "check_placeable", "device_batches", "place", "read_local"]

_log = logging.getLogger(__name__)

_POLL_S = 0.05       # how often blocked queue calls look at the stop flag
_JOIN_S = 10.0       # the longest a close waits for a reader stuck in source.read


class DeviceBatch(NamedTuple):
    """One step's rows on the devices."""

    cursor: int        # first row of the step
    batch: PyTree      # global jax.Arrays of rows_per_step rows, sharded over 'data'
    num_valid: int     # rows of the step that are real (the rest is zero padding)


class ReadError(RuntimeError):
    """Reading or placing a step failed in the reader thread; ``__cause__`` is the error."""


class _Failed(NamedTuple):
    cursor: int
    error: BaseException


def read_local(source: Source, layout: Layout, cursor: int) -> PyTree:
    """Reads this process's rows of the step at ``cursor``, zero-padded past the end."""
    start, stop = layout.local_range(cursor)
    lo, hi = min(start, source.num_rows), min(stop, source.num_rows)
    return source.read(lo, hi, pad_to=None if hi - lo == stop - start else stop - start)


def place(rows: PyTree, layout: Layout, mesh: Mesh) -> PyTree:
    """Builds the global step arrays from this process's host rows (64-bit rows only with 64-bit
    values on: outside a run's :func:`~sharded_scan.dtypes.x64_scope` they are refused, never narrowed)."""
    check_placeable(rows)
    sharding = data_sharding(mesh)
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(
            sharding, x, (layout.rows_per_step,) + x.shape[1:]
        ),
        rows,
    )


class SubnormalWatch:
    """Warns once, in one line, when rows read for devices that flush subnormal floats to zero
    (:data:`~sharded_scan.dtypes.FLUSHES_SUBNORMALS`) hold one: their arithmetic and comparisons
    read it as 0 (a checked limit, never a silent 0). One pass over the host rows' bits a step."""

    def __init__(self, mesh: Mesh):
        self.on = mesh.devices.flat[0].platform in FLUSHES_SUBNORMALS
        self.platform = mesh.devices.flat[0].platform

    def check(self, rows: PyTree, cursor: int) -> None:
        if self.on and holds_subnormals(rows):
            self.on = False
            _log.warning(
                "the rows from row %d on hold subnormal floats (nonzero, below float32's 1.2e-38 or float64's "
                "2.2e-308 in magnitude), which XLA on %s flushes to 0: sums, means, moments, minima, maxima, "
                "histograms and weights count them as 0; Quantiles, TopK and DistinctCount keep them (DESIGN.md, "
                "edge values).",
                cursor, self.platform)


def _step(source: Source, layout: Layout, mesh: Mesh, cursor: int, watch: SubnormalWatch | None = None) -> DeviceBatch:
    num_valid = min(layout.rows_per_step, layout.num_rows - cursor)
    rows = read_local(source, layout, cursor)
    if watch is not None:
        watch.check(rows, cursor)
    return DeviceBatch(cursor, place(rows, layout, mesh), num_valid)


def _cursors(layout: Layout, cursor: int) -> range:
    return range(cursor, layout.num_rows, layout.rows_per_step)


def device_batches(
    source: Source,
    layout: Layout,
    mesh: Mesh,
    cursor: int = 0,
    prefetch: int = 2,
    state: dict[str, Any] | None = None,
) -> Iterator[DeviceBatch]:
    """Yields every step from ``cursor`` on, placed on the devices, ``prefetch`` steps ahead.

    Args:
      source: the rows.
      layout: how rows map to steps, devices and processes.
      mesh: the devices.
      cursor: the first row (a step boundary); ``source.seek(cursor, state)`` runs first.
      prefetch: steps read and placed ahead of the one the caller folds (0: none).
      state: what ``source.state_at(cursor)`` gave when the checkpoint was taken.

    Raises:
      UsageError: the source cannot resume at ``cursor``, or it found bad data.
      ReadError: reading failed otherwise; the cause is chained.
    """
    source.seek(cursor, state)
    watch = SubnormalWatch(mesh)
    if prefetch == 0:
        for c in _cursors(layout, cursor):
            yield _step(source, layout, mesh, c, watch)
        return

    ready: queue.Queue = queue.Queue(maxsize=prefetch)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                pass
        return False

    x64 = jax.config.jax_enable_x64  # the caller's, maybe scoped: the reader thread starts without it

    def reader() -> None:
        c = cursor
        try:
            with jax.enable_x64(x64):
                for c in _cursors(layout, cursor):
                    if stop.is_set() or not put(_step(source, layout, mesh, c, watch)):
                        return
            put(None)
        except BaseException as e:  # noqa: BLE001 - handed to the caller, who raises it
            put(_Failed(c, e))

    thread = threading.Thread(target=reader, name="sharded_scan-reader", daemon=True)
    thread.start()
    try:
        while True:
            try:
                item = ready.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            if isinstance(item, _Failed):
                if isinstance(item.error, UsageError):
                    raise item.error
                start, stop_row = layout.local_range(item.cursor)
                raise ReadError(
                    f"reading rows [{start}, {min(stop_row, layout.num_rows)}) from {type(source).__name__} "
                    f"failed: {type(item.error).__name__}: {item.error}"
                ) from item.error
            yield item
    finally:
        stop.set()
        thread.join(_JOIN_S)
