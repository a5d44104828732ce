"""sharded_scan: exact, restartable reductions over huge datasets on many devices."""

from sharded_scan.combiners import AdditiveCombiner, Combiner, Gram, Sum
from sharded_scan.engine import Progress, run
from sharded_scan.errors import UsageError
from sharded_scan.mesh import make_mesh

__all__ = [
    "AdditiveCombiner",
    "Combiner",
    "Gram",
    "Progress",
    "Sum",
    "UsageError",
    "make_mesh",
    "run",
]
