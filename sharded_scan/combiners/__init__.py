"""The Combiner protocol and the built-in reductions."""

from sharded_scan.combiners.base import AdditiveCombiner, Combiner
from sharded_scan.combiners.functional import from_fn
from sharded_scan.combiners.linalg.gradient import Gradient, GradientResult
from sharded_scan.combiners.linalg.pca import PCA, PCAResult
from sharded_scan.combiners.linalg.regression import LinearRegression, LinearRegressionResult
from sharded_scan.combiners.passes import MultiPass
from sharded_scan.combiners.sketches.distinct import DistinctCount, DistinctCountResult
from sharded_scan.combiners.sketches.quantiles import Quantiles, QuantilesResult
from sharded_scan.combiners.sketches.seeded import from_datasketches
from sharded_scan.combiners.sketches.topk import TopK, TopKResult
from sharded_scan.combiners.statistics.comoments import Covariance, CovarianceResult
from sharded_scan.combiners.statistics.correlation import Correlation, CorrelationResult
from sharded_scan.combiners.statistics.describe import Describe, DescribeResult
from sharded_scan.combiners.statistics.histogram import Histogram, HistogramResult
from sharded_scan.combiners.statistics.moments import Moments, MomentsResult
from sharded_scan.combiners.statistics.sums import Gram, Sum, SumResult, WeightedSumResult
from sharded_scan.combiners.wrappers.grouped import GroupBy, GroupByResult
from sharded_scan.combiners.wrappers.weighted import Weighted
from sharded_scan.dtypes import hash_strings

__all__ = [
    "PCA",
    "AdditiveCombiner",
    "Combiner",
    "Correlation",
    "CorrelationResult",
    "Covariance",
    "CovarianceResult",
    "Describe",
    "DescribeResult",
    "DistinctCount",
    "DistinctCountResult",
    "Gradient",
    "GradientResult",
    "Gram",
    "GroupBy",
    "GroupByResult",
    "Histogram",
    "HistogramResult",
    "LinearRegression",
    "LinearRegressionResult",
    "Moments",
    "MomentsResult",
    "MultiPass",
    "PCAResult",
    "Quantiles",
    "QuantilesResult",
    "Sum",
    "SumResult",
    "TopK",
    "TopKResult",
    "Weighted",
    "WeightedSumResult",
    "from_datasketches",
    "from_fn",
    "hash_strings",
]
