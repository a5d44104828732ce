"""Quantiles: per-column quantiles from a KLL sketch (tf.Transform's quantiles, Spark's approxQuantile).

    python -m launch.main --config=configs/quantiles.py --workdir=/tmp/quantiles
    python -m launch.main --config=configs/quantiles.py:quick --workdir=/tmp/quantiles_quick --jax_num_cpu_devices=8

`--config.combiner.kwargs.qs='(0.1, 0.5, 0.9)'` picks the quantiles and `--config.combiner.kwargs.k=N`
the sketch size (rank error about 1/k). Read a file instead of synthetic rows with
`--config.data.kind=npy --config.data.path=X.npy` (or `npy_shards`, `zarr`).
"""

from configs.common import base_config

QS = (0.0, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)


def get_config(arg=None):
    return base_config("Quantiles", {"qs": QS, "k": 8192}, arg, num_rows=1_000_000, features=16)
