"""The Combiner protocol and the built-in reductions."""

from sharded_scan.combiners.base import AdditiveCombiner, Combiner
from sharded_scan.combiners.sums import Gram, Sum, SumResult

__all__ = ["AdditiveCombiner", "Combiner", "Gram", "Sum", "SumResult"]
