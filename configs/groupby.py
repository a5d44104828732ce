"""GroupBy: Moments (count, mean, variance, min, max of every column) per key, like pandas' groupby.

    python -m launch.main --config=groupby --workdir=/tmp/groupby
    python -m launch.main --config=groupby:quick --workdir=/tmp/groupby_quick --jax_num_cpu_devices=8

Synthetic rows come with keys 0..999 drawn with Zipf frequencies (`data.key=zipf:1000`: `num_keys` 1000).
Per key of a Parquet or CSV file's column `city` (strings, integers...: grouped by value, as pandas'
`groupby("city")`, at most `max_keys` distinct keys), weighted by its column `w` (a GroupBy of
Weighted(Moments)): `--config.data.kind=parquet --config.data.path=F.parquet --config.data.key=city
--config.data.weight=w`; integer keys 0..K-1, dense: `--config.combiner.kwargs.num_keys=K`. Another
statistic per key: `--config.combiner.inner.name=Sum`.
"""

from ml_collections import config_dict

from configs.common import base_config


def get_config(arg=None):
    kwargs = {"num_keys": config_dict.placeholder(int), "max_keys": config_dict.placeholder(int),
              "out_of_range": "raise"}
    c = base_config("GroupBy", kwargs, arg, num_rows=1_000_000, features=8)
    c.combiner.inner = {"name": "Moments", "kwargs": {}}
    c.data.key = "zipf:10" if arg == "quick" else "zipf:1000"  # num_keys: K of zipf:K unless set
    return c
