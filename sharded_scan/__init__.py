"""sharded_scan: exact, restartable reductions over huge datasets on many devices."""

from sharded_scan.combiners import (
    PCA,
    AdditiveCombiner,
    Combiner,
    Covariance,
    Gradient,
    Gram,
    Histogram,
    LinearRegression,
    Moments,
    Sum,
    from_fn,
)
from sharded_scan.engine import Progress, run
from sharded_scan.errors import UsageError
from sharded_scan.mesh import make_mesh

__all__ = [
    "PCA",
    "AdditiveCombiner",
    "Combiner",
    "Covariance",
    "Gradient",
    "Gram",
    "Histogram",
    "LinearRegression",
    "Moments",
    "Progress",
    "Sum",
    "UsageError",
    "from_fn",
    "make_mesh",
    "run",
]
