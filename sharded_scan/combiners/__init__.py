"""The Combiner protocol and the built-in reductions."""

from sharded_scan.combiners.base import AdditiveCombiner, Combiner
from sharded_scan.combiners.functional import from_fn
from sharded_scan.combiners.gradient import Gradient, GradientResult
from sharded_scan.combiners.histogram import Histogram, HistogramResult
from sharded_scan.combiners.pca import PCA, PCAResult
from sharded_scan.combiners.regression import LinearRegression, LinearRegressionResult
from sharded_scan.combiners.statistics import Covariance, CovarianceResult, Moments, MomentsResult
from sharded_scan.combiners.sums import Gram, Sum, SumResult

__all__ = [
    "PCA",
    "AdditiveCombiner",
    "Combiner",
    "Covariance",
    "CovarianceResult",
    "Gradient",
    "GradientResult",
    "Gram",
    "Histogram",
    "HistogramResult",
    "LinearRegression",
    "LinearRegressionResult",
    "Moments",
    "MomentsResult",
    "PCAResult",
    "Sum",
    "SumResult",
    "from_fn",
]
