"""Covariance: the covariance matrix and column means (like np.cov).

    python -m launch.main --config=configs/covariance.py --workdir=/tmp/covariance
    python -m launch.main --config=configs/covariance.py:quick --workdir=/tmp/covariance_quick --jax_num_cpu_devices=8

Read a file instead of synthetic rows with `--config.data.kind=npy --config.data.path=X.npy`
(or `npy_shards`, `zarr`).
"""

from configs.common import base_config


def get_config(arg=None):
    return base_config("Covariance", {'ddof': 1}, arg, num_rows=1_000_000, features=64)
