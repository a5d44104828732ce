"""The design's public contract: every stable name imports from where it is promised."""

import numpy as np

import sharded_scan as ss
from sharded_scan import combiners

CONTRACT = [
    "make_mesh", "run", "UsageError", "Combiner", "AdditiveCombiner",
    "Sum", "Gram", "Covariance", "Correlation", "Moments", "PCA", "LinearRegression", "Histogram", "Gradient",
    "from_fn",
    "Quantiles", "DistinctCount", "TopK", "hash_strings", "run_passes", "RunOptions", "StorageError",
    "run_in_workdir", "Describe", "GroupBy", "Weighted",
    "from_datasketches",
]
RESULT_FIELDS = {
    "SumResult": ("sum", "count", "columns"),
    "WeightedSumResult": ("sum", "count", "weight", "columns"),
    "GroupByResult": ("result", "rows", "keys"),
    "CovarianceResult": ("count", "mean", "cov", "columns", "pair_count"),
    "CorrelationResult": ("count", "mean", "corr", "columns", "pair_count"),
    "MomentsResult": ("count", "mean", "var", "min", "max", "skewness", "kurtosis", "nan_count", "zeros", "norm_l1",
                      "norm_l2", "columns"),
    "PCAResult": ("components", "explained_variance", "explained_variance_ratio", "mean", "singular_values", "columns"),
    "LinearRegressionResult": ("coef", "intercept", "rank", "cond", "r2", "residual_std", "coef_stderr",
                               "intercept_stderr", "columns"),
    "HistogramResult": ("counts", "edges", "columns"),
    "GradientResult": ("count", "loss", "grad"),
    "QuantilesResult": ("quantiles", "qs", "count", "rank_error", "passes", "sketch", "columns"),
    "DistinctCountResult": ("count", "exact", "relative_error", "sketch", "columns"),
    "TopKResult": ("values", "counts", "errors", "bound", "certain", "sketch", "columns"),
    "DescribeResult": ("count", "nan_count", "mean", "std", "min", "max", "percentiles", "qs", "rank_error", "passes",
                       "columns"),
}


def test_contract_names_are_exported():
    for name in CONTRACT:
        assert name in ss.__all__, name
        assert getattr(ss, name) is not None
    assert set(ss.__all__) <= set(dir(ss))
    assert set(combiners.__all__) <= set(dir(combiners))


def test_result_field_names_are_the_contracts():
    for name, fields in RESULT_FIELDS.items():
        assert name in combiners.__all__, name
        assert getattr(combiners, name)._fields == fields


def test_builtins_are_combiners_and_the_additive_ones_say_so():
    built = {
        "Sum": ss.Sum(), "Gram": ss.Gram(), "Covariance": ss.Covariance(), "Correlation": ss.Correlation(),
        "Moments": ss.Moments(),
        "PCA": ss.PCA(1), "LinearRegression": ss.LinearRegression(), "Histogram": ss.Histogram(2, (0, 1)),
        "Gradient": ss.Gradient(lambda p, x: x @ p, np.ones(2, np.float32)),
        "from_fn": ss.from_fn(lambda c, b: c + b.sum(0), np.zeros(2, np.float32)),
        "Quantiles": ss.Quantiles(qs=[0.5]), "DistinctCount": ss.DistinctCount(), "TopK": ss.TopK(),
        "Describe": ss.Describe(),
    }
    additive = {"Sum", "Gram", "Histogram", "Gradient", "from_fn"}
    for name, combiner in built.items():
        assert isinstance(combiner, ss.Combiner), name
        assert combiner.additive == (name in additive), name
        assert combiner.fingerprint()["combiner"] in (name, "from_fn")
