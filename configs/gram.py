"""Gram: the (d, d) Gram matrix X^T X.

    python -m launch.main --config=configs/gram.py --workdir=/tmp/gram
    python -m launch.main --config=configs/gram.py:quick --workdir=/tmp/gram_quick --jax_num_cpu_devices=8

Read a file instead of synthetic rows with `--config.data.kind=npy --config.data.path=X.npy`
(or `npy_shards`, `zarr`).
"""

from configs.common import base_config


def get_config(arg=None):
    return base_config("Gram", None, arg, num_rows=1_000_000, features=64)
