"""GroupBy: Moments (count, mean, variance, min, max of every column) per key, like pandas' groupby.

    python -m launch.main --config=groupby --workdir=/tmp/groupby
    python -m launch.main --config=groupby:quick --workdir=/tmp/groupby_quick --jax_num_cpu_devices=8

Synthetic rows come with keys 0..999 drawn with Zipf frequencies (`data.key=zipf:1000`). Per key of a
Parquet or CSV file's integer column `k`, weighted by its column `w` (a GroupBy of Weighted(Moments)):
`--config.data.kind=parquet --config.data.path=F.parquet --config.data.key=k --config.data.weight=w
--config.combiner.kwargs.num_keys=K`. Another statistic per key: `--config.combiner.inner.name=Sum`.
"""

from configs.common import base_config


def get_config(arg=None):
    c = base_config("GroupBy", {"num_keys": 1000, "out_of_range": "raise"}, arg, num_rows=1_000_000, features=8)
    if arg == "quick":
        c.combiner.kwargs.num_keys = 10
    c.combiner.inner = {"name": "Moments", "kwargs": {}}
    c.data.key = f"zipf:{c.combiner.kwargs.num_keys}"
    return c
