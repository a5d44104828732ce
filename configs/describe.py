"""Describe: pandas' df.describe() of every column, and the per-feature statistics a training pipeline reads.

    python -m launch.main --config=configs/describe.py --workdir=/tmp/describe
    python -m launch.main --config=configs/describe.py:quick --workdir=/tmp/describe_quick --jax_num_cpu_devices=8

Writes `describe.json` (per feature: count, nan_count, mean, std, min, max, q01, q25, q50, q75, q99;
`sharded_scan.combiners.statistics.describe.DescribeResult.to_json` gives the format) next to `result.npz`.
`--config.combiner.kwargs.percentiles='(0.05, 0.95)'` picks the percentiles, `--config.combiner.kwargs.exact=True`
makes them exact (a few more passes). Read a file instead of synthetic rows with
`--config.data.kind=parquet --config.data.path=PATH.parquet` (or `csv`, `npy`, `npy_shards`, `zarr`).
"""

from configs.common import base_config

PERCENTILES = (0.01, 0.25, 0.5, 0.75, 0.99)


def get_config(arg=None):
    return base_config("Describe", {"percentiles": PERCENTILES}, arg, num_rows=1_000_000, features=16)
