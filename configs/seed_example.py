"""The seed's example made right: a plain scan body ``c + b.T @ b`` through ``from_fn``.

    python -m launch.main --config=configs/seed_example.py --workdir=/tmp/seed
    python -m launch.main --config=configs/seed_example.py:quick --workdir=/tmp/seed_quick --jax_num_cpu_devices=8

The body is a module-level function, so its name (the fingerprint) is the same every run.
"""

import jax.numpy as jnp

from configs.common import base_config


def gram_body(carry, batch):
    """The seed meant ``XᵀX`` summed over micro-batches (not ``batch @ batch.T``)."""
    return carry + batch.T @ batch


def make_combiner(features: int):
    """``from_fn(gram_body, zeros((d, d)))``: what the config's ``combiner.name`` points at."""
    import sharded_scan

    return sharded_scan.from_fn(gram_body, jnp.zeros((features, features), jnp.float32))


def get_config(arg=None):
    c = base_config("configs.seed_example:make_combiner", None, arg, num_rows=100_000, features=128)
    c.combiner.kwargs.features = c.data.get_ref("features")  # one value: --config.data.features=N
    return c
