"""Linear algebra: linear regression, PCA, gradients, and the solvers and factors they run on."""
