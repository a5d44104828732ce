"""The Combiner protocol and the built-in reductions."""

from sharded_scan.combiners.base import AdditiveCombiner, Combiner
from sharded_scan.combiners.correlation import Correlation, CorrelationResult
from sharded_scan.combiners.describe import Describe, DescribeResult
from sharded_scan.combiners.distinct import DistinctCount, DistinctCountResult
from sharded_scan.combiners.functional import from_fn
from sharded_scan.combiners.gradient import Gradient, GradientResult
from sharded_scan.combiners.grouped import GroupBy, GroupByResult
from sharded_scan.combiners.histogram import Histogram, HistogramResult
from sharded_scan.combiners.passes import MultiPass
from sharded_scan.combiners.pca import PCA, PCAResult
from sharded_scan.combiners.quantiles import Quantiles, QuantilesResult
from sharded_scan.combiners.regression import LinearRegression, LinearRegressionResult
from sharded_scan.combiners.seeded import from_datasketches
from sharded_scan.combiners.statistics import Covariance, CovarianceResult, Moments, MomentsResult
from sharded_scan.combiners.sums import Gram, Sum, SumResult, WeightedSumResult
from sharded_scan.combiners.topk import TopK, TopKResult
from sharded_scan.combiners.weighted import Weighted
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
