"""LinearRegression: ridge regression of y on X (like sklearn Ridge).

    python -m launch.main --config=configs/ridge.py --workdir=/tmp/ridge
    python -m launch.main --config=configs/ridge.py:quick --workdir=/tmp/ridge_quick --jax_num_cpu_devices=8

Read a file instead of synthetic rows with `--config.data.kind=npy --config.data.path=X.npy`
(or `npy_shards`, `zarr`). `--config.combiner.kwargs.solver=tsqr` (or `comoments`) picks
another accumulator (README, "Accuracy").
"""

from configs.common import base_config


def get_config(arg=None):
    kwargs = {'l2': 1.0, 'fit_intercept': True, 'solver': 'whitened'}
    return base_config("LinearRegression", kwargs, arg, num_rows=1_000_000, features=32, targets=True)
