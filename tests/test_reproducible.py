"""``logical_shards`` results are bitwise the same on every split of the job into processes and
devices, for every built-in, also after an elastic resume from one split onto another."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from tests import multiprocess

SPLITS = [(1, 1), (1, 2), (1, 8), (2, 1), (2, 4), (4, 2), (8, 1)]  # (processes, devices per process)
N, D = 4 * 8 * 512 + 37, 64  # ragged; micro-batches of 512 rows asked for (dots the threads could split)
OPTIONS = dict(logical_shards=8, microbatch=512, steps_per_call=2, mesh="data:-1")


def squared_error(params, batch):
    x, y = batch
    return (x @ params - y) ** 2


def gram_body(carry, batch):
    return carry + batch.T @ batch


def data():
    rng = np.random.default_rng(0)
    x = (3 + rng.normal(size=(N, D))).astype(np.float32)
    y = (x[:, :5].sum(1) + rng.normal(size=N)).astype(np.float32)
    return x, y


def combiners():
    import sharded_scan as ss

    return {
        "Sum": (ss.Sum(), "x"),
        "Gram": (ss.Gram(), "x"),
        "Gram blocked": (ss.Gram(block=16), "x"),
        "Covariance": (ss.Covariance(), "x"),
        "Moments": (ss.Moments(), "x"),
        "PCA": (ss.PCA(3), "x"),
        "LinearRegression": (ss.LinearRegression(), "xy"),
        "Histogram": (ss.Histogram(16, (-1.0, 7.0)), "x"),
        "Gradient": (ss.Gradient(squared_error, np.linspace(0, 1, D).astype(np.float32)), "xy"),
        "from_fn": (ss.from_fn(gram_body, jnp.zeros((D, D))), "x"),
    }


class Crash(Exception):  # noqa: N818 - a stand-in for a kill
    pass


def crash_at_step(steps):
    def progress(p):
        if p.step >= steps:
            raise Crash

    return progress


def reduce_every_builtin(crash_into: str | None = None, resume_from: str | None = None):
    """Every built-in's result leaves by name (runs in each process of a split).

    ``crash_into``: also run each one with checkpoints in ``crash_into/NAME`` and crash it
    after 2 steps; ``resume_from``: also finish each from the checkpoints there (another
    split's), as ``"NAME resumed"``.
    """
    import sharded_scan as ss

    x, y = data()
    out = {}
    for name, (combiner, kind) in combiners().items():
        rows = x if kind == "x" else (x, y)
        out[name] = [np.asarray(leaf) for leaf in jax.tree.leaves(ss.run(combiner, rows, **OPTIONS))]
        if crash_into:
            checkpoint = ss.CheckpointOptions(f"{crash_into}/{name}", every_steps=1)
            with contextlib.suppress(Crash):
                ss.run(combiner, rows, checkpoint=checkpoint, progress=crash_at_step(2), **OPTIONS)
        if resume_from:
            checkpoint = ss.CheckpointOptions(f"{resume_from}/{name}", every_steps=1)
            result, report = ss.run_with_report(combiner, rows, checkpoint=checkpoint, **OPTIONS)
            assert report.resumed_from_cursor, name
            out[f"{name} resumed"] = [np.asarray(leaf) for leaf in jax.tree.leaves(result)]
    return out


def test_every_builtin_is_bitwise_the_same_on_every_process_and_device_split(tmp_path):
    crashed = {(1, 2): str(tmp_path / "from-1x2"), (2, 4): str(tmp_path / "from-2x4")}
    resumes = {(4, 2): crashed[(1, 2)], (1, 8): crashed[(2, 4)]}  # after the split that crashed
    order = [(1, 1), (1, 2), (2, 1), (2, 4), (1, 8), (4, 2), (8, 1)]
    assert sorted(order) == sorted(SPLITS)
    results = {}
    for split in order:
        kwargs = {"crash_into": crashed.get(split), "resume_from": resumes.get(split)}
        per_process = multiprocess.run_processes(
            "tests.test_reproducible:reduce_every_builtin", *split, kwargs=kwargs, timeout=240
        )
        for got in per_process[1:]:  # every process returns the same result
            for name, leaves in got.items():
                for a, b in zip(leaves, per_process[0][name], strict=True):
                    np.testing.assert_array_equal(a, b, err_msg=f"{name} on {split}")
        results[split] = per_process[0]
    want = results[(1, 1)]
    for split, got in results.items():
        for name, leaves in got.items():
            for a, b in zip(leaves, want[name.removesuffix(" resumed")], strict=True):
                np.testing.assert_array_equal(a, b, err_msg=f"{name} on {split[0]} x {split[1]}")
    assert {"Gram resumed", "LinearRegression resumed"} <= set(results[(1, 8)]) & set(results[(4, 2)])
    x, _ = data()
    gram = np.asarray(want["Gram"][0], np.float64)
    assert np.abs(gram - x.astype(np.float64).T @ x).max() / np.abs(gram).max() < 1e-6


def test_gpus_are_told_once_how_to_get_bitwise_results(caplog):
    from sharded_scan.program import DETERMINISTIC_GPU_FLAG, warn_if_not_reproducible

    warn_if_not_reproducible.cache_clear()
    for _ in range(2):
        warn_if_not_reproducible("gpu", "")
    warn_if_not_reproducible("gpu", DETERMINISTIC_GPU_FLAG)
    warn_if_not_reproducible("cpu", "")
    warnings = [r.getMessage() for r in caplog.records if "bitwise" in r.getMessage()]
    assert len(warnings) == 1 and DETERMINISTIC_GPU_FLAG in warnings[0]
