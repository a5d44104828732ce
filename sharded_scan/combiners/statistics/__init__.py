"""Statistics: sums, moments, co-moments (covariance, correlation), histograms and ``Describe``."""
