"""sharded_scan: exact, restartable reductions over huge datasets on many devices."""

from sharded_scan.checkpoint import CheckpointOptions
from sharded_scan.combiners import AdditiveCombiner, Combiner, Gram, Sum
from sharded_scan.distributed import Preempted
from sharded_scan.engine import Progress, RunReport, run, run_with_report
from sharded_scan.errors import UsageError
from sharded_scan.mesh import make_mesh

__all__ = [
    "AdditiveCombiner",
    "CheckpointOptions",
    "Combiner",
    "Gram",
    "Preempted",
    "Progress",
    "RunReport",
    "Sum",
    "UsageError",
    "make_mesh",
    "run",
    "run_with_report",
]
