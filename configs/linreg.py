"""LinearRegression with no penalty: ordinary least squares of y on X (like sklearn LinearRegression).

    python -m launch.main --config=linreg --workdir=/tmp/linreg
    python -m launch.main --config=linreg:quick --workdir=/tmp/linreg_quick --jax_num_cpu_devices=8

`l2=0`: a rank-deficient X gets the minimum-norm solution (like numpy.linalg.lstsq), with `rank`
and `cond` in the result; `--config=ridge` is the same job with a penalty. Read a file with
`--config.data.kind=parquet --config.data.path=F.parquet --config.data.target=COLUMN` (or `csv`;
`npy` with `--config.data.target_path=y.npy`).
"""

from configs.common import base_config


def get_config(arg=None):
    kwargs = {"l2": 0.0, "fit_intercept": True, "solver": "whitened"}
    return base_config("LinearRegression", kwargs, arg, num_rows=1_000_000, features=32, targets=True)
