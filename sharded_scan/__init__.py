"""sharded_scan: exact, restartable reductions over huge datasets on many devices."""

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
from sharded_scan.distributed import Preempted
from sharded_scan.engine import Progress, RunReport, run, run_passes, run_with_report
from sharded_scan.errors import StorageError, UsageError
from sharded_scan.mesh import make_mesh
from sharded_scan.options import RunOptions
from sharded_scan.workdir import run_in_workdir

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
    "Preempted",
    "Progress",
    "Quantiles",
    "RunOptions",
    "RunReport",
    "StorageError",
    "Sum",
    "TopK",
    "UsageError",
    "Weighted",
    "from_datasketches",
    "from_fn",
    "hash_strings",
    "make_mesh",
    "run",
    "run_in_workdir",
    "run_passes",
    "run_with_report",
]
