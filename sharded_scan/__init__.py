"""sharded_scan: exact, restartable reductions over huge datasets on many devices.

Running: :func:`run`, :func:`run_with_report`, :func:`run_in_workdir`, with :class:`RunOptions`
and ``checkpoint=`` None, a directory or :class:`CheckpointOptions` (the same in all three).
What it raises to you, each one line: :class:`UsageError` (your input or options; its
:class:`NonFiniteError`: NaN or Inf met ``nan_policy="raise"``), :class:`StorageError` (the storage
refused a write), :class:`Preempted` (SIGTERM or SIGINT; a checkpoint was saved),
:class:`Terminated` (SIGTERM before the first step, or with no checkpoints) and :class:`ReadError`
(the data could not be read; the cause chained). Your own :class:`Combiner` counts rows exactly
past 2^31 with :mod:`counts` (``counts.zeros()``, ``counts.count_rows(acc, mask)``, ``counts.to_int``).
"""

import sys as _sys

from sharded_scan.checkpoint import CheckpointOptions
from sharded_scan.combiners import (
    PCA,
    AdditiveCombiner,
    Combiner,
    Correlation,
    Covariance,
    Describe,
    DistinctCount,
    Gradient,
    Gram,
    GroupBy,
    Histogram,
    LinearRegression,
    Moments,
    Quantiles,
    Sum,
    TopK,
    Weighted,
    from_datasketches,
    from_fn,
    hash_strings,
)
from sharded_scan.combiners import wide as counts
from sharded_scan.combiners.wrappers.policies import NonFiniteError
from sharded_scan.distributed import Preempted, Terminated
from sharded_scan.engine import Progress, RunReport, run, run_with_report
from sharded_scan.errors import StorageError, UsageError
from sharded_scan.mesh import make_mesh
from sharded_scan.options import RunOptions
from sharded_scan.prefetch import ReadError
from sharded_scan.workdir import run_in_workdir

# `import sharded_scan.counts` and `from sharded_scan.counts import ...` find the module itself: one home, one name
_sys.modules[f"{__name__}.counts"] = counts

__all__ = [
    "PCA",
    "AdditiveCombiner",
    "CheckpointOptions",
    "Combiner",
    "Correlation",
    "Covariance",
    "Describe",
    "DistinctCount",
    "Gradient",
    "Gram",
    "GroupBy",
    "Histogram",
    "LinearRegression",
    "Moments",
    "NonFiniteError",
    "Preempted",
    "Progress",
    "Quantiles",
    "ReadError",
    "RunOptions",
    "RunReport",
    "StorageError",
    "Sum",
    "Terminated",
    "TopK",
    "UsageError",
    "Weighted",
    "counts",
    "from_datasketches",
    "from_fn",
    "hash_strings",
    "make_mesh",
    "run",
    "run_in_workdir",
    "run_with_report",
]
