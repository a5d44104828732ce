"""Moments: count, mean, variance, min and max of every column.

    python -m launch.main --config=configs/moments.py --workdir=/tmp/moments
    python -m launch.main --config=configs/moments.py:quick --workdir=/tmp/moments_quick --jax_num_cpu_devices=8

Read a file instead of synthetic rows with `--config.data.kind=npy --config.data.path=X.npy`
(or `npy_shards`, `zarr`).
"""

from configs.common import base_config


def get_config(arg=None):
    return base_config("Moments", {'ddof': 0}, arg, num_rows=1_000_000, features=64)
