"""Sources: where rows come from. Each one reads a row range into host numpy.

A source has ``num_rows``, ``spec`` (a pytree of ``jax.ShapeDtypeStruct`` giving the
shape and dtype of one row of each leaf) and ``read(start, stop, pad_to=None)`` returning
that range as a pytree of numpy arrays, followed by zero rows up to ``pad_to`` rows when
asked (the last step). ``read`` must be safe to call from a reader thread (one reader at
a time), and ``read(n, n)`` returns zero rows of the right shapes. A source may define
``read(start, stop)`` alone: the base class then pads a copy of its rows.

Resuming. The engine resumes a job from a row ``cursor`` (saved in a checkpoint).
Before its first read it calls ``seek(cursor, state)``, where ``state`` is what
``state_at(cursor)`` returned when the checkpoint was taken (``{}`` when there was
none). Random-access sources (arrays, files, zarr, synthetic) are ``resumable``: the
cursor alone says where to read, their state is ``{}``, ``seek`` only checks the cursor.
``IteratorSource`` is ``sequential``: it can only be read forward (a read may skip
rows, never go back). It is resumable only when its iterable exposes its state with
``get_state()`` / ``set_state(state)``; then ``state_at(cursor)`` gives the iterable's
state before the batch holding row ``cursor`` plus the rows to skip in it. A resume at
``cursor > 0`` of an iterable without state raises a one-line :class:`UsageError`.

Validation. Every source checks its input when it is built (missing or unreadable
path, wrong shape, shards that disagree, non-numeric dtype) and raises a one-line
:class:`UsageError` before any compute.

Supervised data is a pytree of sources with equal row counts, e.g.
``as_source((NpySource("X.npy"), NpySource("y.npy")))``.
"""

from __future__ import annotations

from sharded_scan.sources.base import ALIGN, Source, aligned_empty, row_spec
from sharded_scan.sources.compose import TreeSource, as_source
from sharded_scan.sources.files import NpyShardsSource, NpySource, ZarrSource
from sharded_scan.sources.iterator import IteratorSource
from sharded_scan.sources.memory import ArraySource, SyntheticSource
from sharded_scan.sources.tabular import CsvSource, ParquetSource, dataframe_source

__all__ = [
    "ALIGN",
    "ArraySource",
    "CsvSource",
    "IteratorSource",
    "NpyShardsSource",
    "NpySource",
    "ParquetSource",
    "Source",
    "SyntheticSource",
    "TreeSource",
    "ZarrSource",
    "aligned_empty",
    "as_source",
    "dataframe_source",
    "row_spec",
]
