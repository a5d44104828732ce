"""PCA: the top-k principal components (like sklearn PCA).

    python -m launch.main --config=configs/pca.py --workdir=/tmp/pca
    python -m launch.main --config=configs/pca.py:quick --workdir=/tmp/pca_quick --jax_num_cpu_devices=8

Read a file instead of synthetic rows with `--config.data.kind=npy --config.data.path=X.npy`
(or `npy_shards`, `zarr`). `--config.combiner.kwargs.solver=tsqr` (or `comoments`) picks
another accumulator (README, "Accuracy").
"""

from configs.common import base_config


def get_config(arg=None):
    return base_config("PCA", {'k': 8, 'solver': 'whitened'}, arg, num_rows=1_000_000, features=64)
