"""Checkpoint digests: the host's sums are the devices' sums, word for word, for every dtype a partial holds."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from sharded_scan import digest


def leaves():
    rng = np.random.default_rng(0)
    return [
        rng.normal(size=(5, 3)).astype(np.float32), rng.integers(-2**31, 2**31 - 1, size=9).astype(np.int32),
        np.uint32([0, 2**32 - 1]), rng.integers(0, 255, 11).astype(np.uint8), np.array([True, False, True]),
        rng.normal(size=4).astype(np.float16), rng.normal(size=4).astype(ml_dtypes.bfloat16), np.int16([-1, 5]),
        np.float32(3.5), np.zeros((0, 4), np.float32), np.float32([np.nan, -0.0, np.inf, 1e-45]),
        np.arange(24, dtype=np.float32).reshape(2, 3, 4).transpose(2, 0, 1),  # not C-contiguous
    ]


def test_host_digests_are_the_device_programs_and_one_changed_word_changes_them():
    host = digest.array_digests(leaves())
    on_devices = jax.device_get(digest._sums([jnp.asarray(x) for x in leaves()]))
    assert host == [f"{int(s[0]):08x}{int(s[1]):08x}" for s in on_devices]
    sharded = jax.device_put(np.arange(64, dtype=np.float32), jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(jax.devices()), ("data",)), jax.sharding.PartitionSpec("data")))
    assert digest.array_digests([sharded]) == digest.array_digests([np.arange(64, dtype=np.float32)])
    changed = leaves()
    changed[0][2, 1] = np.nextafter(changed[0][2, 1], np.inf)
    swapped = leaves()
    swapped[1][[0, 1]] = swapped[1][[1, 0]]
    assert [a != b for a, b in zip(digest.array_digests(changed), host, strict=True)] == [True] + [False] * 11
    assert digest.array_digests(swapped)[1] != host[1]
