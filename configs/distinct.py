"""DistinctCount: distinct values per column from HyperLogLog registers (Spark's approx_count_distinct).

    python -m launch.main --config=configs/distinct.py --workdir=/tmp/distinct
    python -m launch.main --config=configs/distinct.py:quick --workdir=/tmp/distinct_quick --jax_num_cpu_devices=8

`--config.combiner.kwargs.precision=P` sets 2^P registers per column (standard error 1.04/sqrt(2^P));
`--config.combiner.kwargs.exact_up_to=E` counts columns with at most E values exactly (default
2^precision, as `DistinctCount`; 0: the estimate alone). Synthetic rows
are continuous (nearly every value distinct): point it at your ids with
`--config.data.kind=npy --config.data.path=ids.npy` (or `npy_shards`, `zarr`).
"""

from configs.common import base_config


def get_config(arg=None):
    return base_config("DistinctCount", {"precision": 14}, arg, num_rows=1_000_000, features=16)
