"""TopK: the most frequent values of every column with their counts (tf.Transform's vocabulary, Beam's Top).

    python -m launch.main --config=configs/topk.py --workdir=/tmp/topk
    python -m launch.main --config=configs/topk.py:quick --workdir=/tmp/topk_quick --jax_num_cpu_devices=8

`--config.combiner.kwargs.k=K` values per column, from `capacity` monitored ones. Synthetic rows are
continuous (every value about once): point it at your ids with
`--config.data.kind=npy --config.data.path=ids.npy` (or `npy_shards`, `zarr`); strings: count
`sharded_scan.hash_strings(words)`.
"""

from configs.common import base_config


def get_config(arg=None):
    return base_config("TopK", {"k": 10, "capacity": 4096}, arg, num_rows=1_000_000, features=16)
