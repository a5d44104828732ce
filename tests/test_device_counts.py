"""The same job on backends with 1 and 2 simulated devices (each in a process of its own: a fork of the test
process's fork server, JAX's backend unstarted, tests/forks.py) and on this process's 8 (tests/conftest.py): no
process of its own for the third size."""

import concurrent.futures
import json
import os
import sys

import numpy as np
import pytest

from tests import cli, forks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = f"""
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))
sys.path.insert(0, {ROOT!r})
from tests.test_device_counts import job
print(json.dumps(job()))
"""


def job() -> dict:
    """The job, on this process's backend (8 devices here, as tests/conftest.py sets; a subprocess's own)."""
    import jax

    import sharded_scan as ss

    x = np.random.default_rng(0).normal(size=(1009, 6)).astype(np.float32)
    gram = ss.run(ss.Gram(), x, microbatch=8)
    fixed = ss.run(ss.Gram(), x, microbatch=8, logical_shards=8)  # a multiple of every size here
    return {"devices": jax.device_count(), "gram": gram.tolist(), "fixed": fixed.tolist()}


def run_with_devices(count: int) -> dict:
    done = cli.run([sys.executable, "-c", SCRIPT, str(count)])
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def results():
    counts = (1, 2)
    # the two backends at once, this one meanwhile; forks of one process that imported JAX (~1 s of CPU less each)
    with forks.shared_serving(), concurrent.futures.ThreadPoolExecutor(len(counts)) as pool:
        done = pool.map(run_with_devices, counts)
        here = job()
        return {**dict(zip(counts, done, strict=True)), here["devices"]: here}


def test_every_backend_size_matches_float64(results):
    x = np.random.default_rng(0).normal(size=(1009, 6))
    want = x.astype(np.float32).astype(np.float64).T @ x.astype(np.float32).astype(np.float64)
    assert sorted(results) == [1, 2, 8]
    for count, got in results.items():
        assert got["devices"] == count
        np.testing.assert_allclose(got["gram"], want, rtol=1e-5, atol=1e-4)


def test_logical_shards_bitwise_across_backend_sizes(results):
    first = np.asarray(results[1]["fixed"], np.float32)
    for got in results.values():
        np.testing.assert_array_equal(np.asarray(got["fixed"], np.float32), first)
