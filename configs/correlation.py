"""Correlation: the Pearson correlation matrix and column means (like np.corrcoef).

    python -m launch.main --config=correlation --workdir=/tmp/correlation
    python -m launch.main --config=correlation:quick --workdir=/tmp/correlation_quick --jax_num_cpu_devices=8

Read a file instead of synthetic rows with `--config.data.kind=parquet --config.data.path=F.parquet`
(or `csv`, `npy`, `npy_shards`, `zarr`); weighted by a Parquet/CSV column `w`: `--config.data.weight=w`.
"""

from configs.common import base_config


def get_config(arg=None):
    return base_config("Correlation", {}, arg, num_rows=1_000_000, features=64)
