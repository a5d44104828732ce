"""Histogram: per-column histograms over a fixed range.

    python -m launch.main --config=configs/histogram.py --workdir=/tmp/histogram
    python -m launch.main --config=configs/histogram.py:quick --workdir=/tmp/histogram_quick --jax_num_cpu_devices=8

Read a file instead of synthetic rows with `--config.data.kind=npy --config.data.path=X.npy`
(or `npy_shards`, `zarr`).
"""

from configs.common import base_config


def get_config(arg=None):
    return base_config("Histogram", {'bins': 32, 'range': (-4.0, 4.0)}, arg, num_rows=1_000_000, features=16)
