"""LinearRegression with l2=1.0: ridge regression of y on X (like sklearn Ridge(alpha=1.0)).

    python -m launch.main --config=ridge --workdir=/tmp/ridge
    python -m launch.main --config=ridge:quick --workdir=/tmp/ridge_quick --jax_num_cpu_devices=8

The penalty is `l2=1.0` on the coefficients (the intercept is not penalised); set another with
`--config.combiner.kwargs.l2=0.1`, or run `--config=linreg` for plain least squares (no penalty).
Read a file instead of synthetic rows with `--config.data.kind=npy --config.data.path=X.npy
--config.data.target_path=y.npy` (or `npy_shards`, `zarr`; `parquet`/`csv` with
`--config.data.target=COLUMN`). `--config.combiner.kwargs.solver=tsqr` (or `comoments`) picks
another accumulator (README, "Accuracy").
"""

from configs.common import base_config

L2 = 1.0  # the ridge penalty (sklearn Ridge's alpha)


def get_config(arg=None):
    kwargs = {"l2": L2, "fit_intercept": True, "solver": "whitened"}
    return base_config("LinearRegression", kwargs, arg, num_rows=1_000_000, features=32, targets=True)
