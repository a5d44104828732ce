"""``logical_shards`` results are bitwise the same on every split of the job into processes and
devices, for every built-in, also after an elastic resume from one split onto another."""

import contextlib
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import cli, forks, multiprocess
from tests.helpers import XLA_DEFAULTS

# (processes, devices per process); 8x1 was dropped for the suite's time (8 processes: ~30 s of CPU): 4x2
# runs the process tree's rounds at depth 2 and 2x1 processes of one device; 1x2 (one process of two
# devices: Covariance and Histogram, each also on processes of one device and on a split of several
# processes) too, 4x2's processes have two devices each
SPLITS = [(1, 1), (1, 8), (2, 1), (2, 4), (4, 2)]
N, D = 4 * 8 * 512 + 37, 96  # ragged; micro-batches of 512 rows asked for (dots the threads could split)
# codegen left "auto": a logical_shards job's steps compile on XLA's defaults at any size (this one, 16,421 x 96
# values, is small); its merges, of 8 shards, cheaply as every such job's.
OPTIONS = dict(logical_shards=8, microbatch=512, steps_per_call=2, mesh="data:-1")
# With their matrix products left to XLA:CPU's matmul library, Gram, Covariance, PCA, LinearRegression and from_fn
# differ bitwise between processes of 1-3 and of 4 or more devices (at d=96 even with 256-row micro-batches; at d=32
# the library does not split the sums). Every built-in runs on 1x8 (the test's own 8-device process) and on processes
# of one device, and resumes on 1x8 from their checkpoints: those on 2x1 (a split of several processes too) from
# 2x1's, the others (Gram, Covariance, PCA, on 1x1) from 1x1's. Each other split runs a few, at least one of those
# five among them, and each built-in runs on a split of several processes, but PCA: its accumulator and merge are
# LinearRegression's (the same solver's add and merge, whitened.py's, of X where LinearRegression's are of [X | y];
# the rest of both runs on the host), which runs on 2x1. PCA and LinearRegression are the costliest to compile (~9 s
# of CPU a process each), so PCA runs in one process (1x1), not two. A built-in compiles in each process of each split
# it runs on: on 2x1 rather than on both 1x1 and 2x4, 2 processes compile it, not 3.
# "LinearRegression tsqr": Householder QR (jnp.linalg.qr, LAPACK's on CPU) in every add and merge, which
# fixed_order computes itself in a fixed order; of 32 columns (its QR's order is the code's at any width).
EVERY = ("Sum", "Gram", "Gram blocked", "Covariance", "Moments", "PCA", "LinearRegression", "Histogram",
         "Gradient", "from_fn", "LinearRegression tsqr")
# Sum and Histogram, cheap: on 2x1 only (processes of one device, several of them), not also on 1x1.
ON_2X1 = ("LinearRegression", "Gram blocked", "Moments", "Gradient", "from_fn", "LinearRegression tsqr", "Sum",
          "Histogram")
ON_1X1 = tuple(name for name in EVERY if name not in ON_2X1)
SAME_ACCUMULATOR = {"PCA": "LinearRegression"}  # PCA's split of several processes: LinearRegression's
SOME = {
    (2, 4): ("Gram",),  # crashed here, resumed on 4x2
    (2, 1): ON_2X1,  # resumed on 1x8 from here
    (4, 2): ("Covariance", "Gram"),  # resumed: Covariance from 1x8's checkpoints, Gram from 2x4's
}
# The elastic chain 2x4 -> 4x2 -> 1x8: Gram crashed on 2x4, resumed on 4x2 and crashed again, finished on 1x8
# (its last hop a save of several processes restored in one, as 2x1's are).
RELAYED = ("Gram",)


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
        "LinearRegression tsqr": (ss.LinearRegression(solver="tsqr"), "xy32"),
    }


class Crash(Exception):  # noqa: N818 - a stand-in for a kill
    pass


def crash_at_step(steps):
    def progress(p):
        if p.step >= steps:
            raise Crash

    return progress


def reduce_builtins(names=EVERY, crash_into: str | None = None, resume_from: str | None = None, checkpointed=None,
                    relay=(), relayed=(), plain=True):
    """The result leaves of the built-ins ``names``, by name (runs in each process of a split).

    ``crash_into``: also run each one (of ``checkpointed``, default all) with checkpoints in
    ``crash_into/NAME`` and crash it after 2 steps; ``resume_from``: also finish each from the
    checkpoints there (another split's), as ``"NAME resumed"``, but those in ``relay``: resumed and
    crashed again, for another split to finish; those in ``relayed`` resume past step 1 (a crash
    in step 2 saved step 1; a relay's, step 2). ``plain=False``: no uninterrupted run (a process that
    ran them already).
    """
    import sharded_scan as ss

    x, y = data()
    every = combiners()
    out = {}
    for name in names:
        combiner, kind = every[name]
        rows = {"x": x, "xy": (x, y), "xy32": (x[:, :32], y)}[kind]
        if plain:
            out[name] = [np.asarray(leaf) for leaf in jax.tree.leaves(ss.run(combiner, rows, **OPTIONS))]
        if checkpointed is not None and name not in checkpointed:
            continue
        if crash_into:
            checkpoint = ss.CheckpointOptions(f"{crash_into}/{name}", every_steps=1)
            with contextlib.suppress(Crash):
                ss.run(combiner, rows, checkpoint=checkpoint, progress=crash_at_step(2), **OPTIONS)
        if resume_from:
            checkpoint = ss.CheckpointOptions(f"{resume_from}/{name}", every_steps=1)
            if name in relay:
                with contextlib.suppress(Crash):
                    ss.run(combiner, rows, checkpoint=checkpoint, progress=crash_at_step(2), **OPTIONS)
                continue
            result, report = ss.run_with_report(combiner, rows, checkpoint=checkpoint, **OPTIONS)
            assert report.resumed_from_cursor and report.resumed_from_step > (1 if name in relayed else 0), name
            out[f"{name} resumed"] = [np.asarray(leaf) for leaf in jax.tree.leaves(result)]
    return out


@contextlib.contextmanager
def split_running(split, **kwargs):
    """``reduce_builtins(**kwargs)`` on ``split``'s processes; yields a function that waits for
    them and returns their result, checked to be the same on every process. The first process compiles
    each program for the others (they would each compile the same at once: 2x1's pair 88 -> 55 CPU-s)."""
    with multiprocess.running("tests.test_reproducible:reduce_builtins", *split, kwargs=kwargs,
                              share_compiles=True) as group:

        def result():
            per_process = group.results(timeout=240)
            for got in per_process[1:]:
                assert got.keys() == per_process[0].keys(), split
                for name, leaves in got.items():
                    for a, b in zip(leaves, per_process[0][name], strict=True):
                        np.testing.assert_array_equal(a, b, err_msg=f"{name} on {split}")
            return per_process[0]

        yield result


def test_every_builtin_is_bitwise_the_same_on_every_process_and_device_split(tmp_path):
    # The suite compiles with XLA:CPU's legacy emitters (tests/conftest.py); users' programs compile with
    # its default ones, whose fusions and multiply-adds the bits must not depend on either: this test runs
    # in a fresh python process of 8 devices on the default emitters (its processes too; this module's main).
    if cli.LEGACY_EMITTERS in os.environ.get("XLA_FLAGS", ""):
        env = {k: v for k, v in cli.env().items() if k != "SHARDED_SCAN_TEST_CPU"}
        # XLA's defaults, each program's code in one LLVM module (the same code, less compile CPU: tests/conftest.py)
        env["XLA_FLAGS"] = "--xla_cpu_parallel_codegen_split_count=1"
        log = tmp_path / "default_emitters.log"
        (tmp_path / "run").mkdir()
        with cli.started([sys.executable, "-m", "tests.test_reproducible", str(tmp_path / "run")], log, env) as proc:
            code = proc.wait(timeout=600)
        assert code == 0, log.read_text()[-4000:]
        return
    every_builtin_bitwise(tmp_path)


def every_builtin_bitwise(tmp_path):
    assert sorted([(1, 8), (1, 1), *SOME]) == sorted(SPLITS) and set(EVERY) == set(combiners())
    assert set(ON_1X1) | set(ON_2X1) == set(EVERY) and SOME[(2, 1)] == ON_2X1
    assert (jax.process_count(), jax.local_device_count()) == (1, 8)  # conftest or __main__: this process is 1x8
    on_several = {name for (processes, _), names in SOME.items() if processes > 1 for name in names}
    assert set(EVERY) == on_several | set(SAME_ACCUMULATOR) and set(SAME_ACCUMULATOR.values()) <= on_several
    for name, twin in SAME_ACCUMULATOR.items():  # one solver's add and merge: their states fold and merge alike
        assert combiners()[name][0].solver == combiners()[twin][0].solver, name
    # relay: 2x4's and 1x8's checkpoints, then 4x2's
    from_1x1, from_2x1, relay = (str(tmp_path / f"from-{split}") for split in ("1x1", "2x1", "relay"))
    results = {}  # by split, then "NAME" or "NAME resumed"
    # The test's own process (8 devices) is split 1x8; the other splits' processes run meanwhile, forks of one
    # process that imported JAX, the library and orbax (tests/forks.py), not nine fresh interpreters.
    with contextlib.ExitStack() as stack:
        stack.enter_context(forks.serving())
        waits = {
            (1, 1): stack.enter_context(split_running((1, 1), names=ON_1X1, crash_into=from_1x1)),
            (2, 1): stack.enter_context(split_running((2, 1), names=ON_2X1, crash_into=from_2x1)),
            (2, 4): stack.enter_context(
                split_running((2, 4), names=SOME[(2, 4)], crash_into=relay, checkpointed=RELAYED)
            ),
        }
        resumed_on_4x2 = tuple(name for name in SOME[(4, 2)] if name not in RELAYED)
        results[(1, 8)] = reduce_builtins(crash_into=relay, checkpointed=resumed_on_4x2)
        # the resumes here: their uninterrupted runs are (1, 8)'s, in this process
        results[(1, 1)] = waits.pop((1, 1))()
        results["1x1 resumed on 1x8"] = reduce_builtins(ON_1X1, resume_from=from_1x1, plain=False)
        results[(2, 1)] = waits.pop((2, 1))()
        results["2x1 resumed on 1x8"] = reduce_builtins(ON_2X1, resume_from=from_2x1, plain=False)
        results[(2, 4)] = waits.pop((2, 4))()
        with split_running((4, 2), names=SOME[(4, 2)], resume_from=relay, relay=RELAYED) as wait:
            results[(4, 2)] = wait()
        results["2x4, 4x2 resumed on 1x8"] = reduce_builtins(RELAYED, resume_from=relay, relayed=RELAYED,
                                                             plain=False)
        results.update({split: wait() for split, wait in waits.items()})

    def names(combiners, resumed=False, plain=True):
        return {*(combiners if plain else ()), *(f"{name} resumed" for name in combiners if resumed)}

    assert {split: set(got) for split, got in results.items()} == {
        (1, 8): names(EVERY), (1, 1): names(ON_1X1), "1x1 resumed on 1x8": names(ON_1X1, True, plain=False),
        "2x1 resumed on 1x8": names(ON_2X1, True, plain=False),
        (4, 2): names(SOME[(4, 2)]) | names(resumed_on_4x2, resumed=True),
        "2x4, 4x2 resumed on 1x8": names(RELAYED, True, plain=False),
        **{split: names(SOME[split]) for split in ((2, 4), (2, 1))},
    }
    want = results[(1, 8)]
    for split, got in results.items():
        for name, leaves in got.items():
            for a, b in zip(leaves, want[name.removesuffix(" resumed")], strict=True):
                np.testing.assert_array_equal(a, b, err_msg=f"{name} on {split}")
    x, _ = data()
    gram = np.asarray(want["Gram"][0], np.float64)
    assert np.abs(gram - x.astype(np.float64).T @ x).max() / np.abs(gram).max() < 1e-6


@pytest.mark.slow
def test_the_whitened_solver_is_bitwise_on_one_device_and_two_where_it_whitens_with_a_full_basis(monkeypatch):
    # Correlated columns and a drift make LinearRegression's (and PCA's: the same) fold, whitened.py's, re-whiten
    # with a full basis, whose Cholesky divides each row by its pivot: XLA's simplifier made that a product with the
    # pivot's reciprocal in the step compiled for two devices (of data or of model alike) and not in the one for one
    # device, so the results differed in their last bits (fixed_order.divided). The i.i.d. data above never takes
    # that path. The steps compile on XLA's defaults, as a user's do (about 3 CPU-s each).
    import sharded_scan as ss
    from sharded_scan import compiled

    real = compiled.compile_step
    monkeypatch.setattr(compiled, "compile_step", lambda *a: real(*a[:-1], a[-1] or XLA_DEFAULTS))
    rng = np.random.default_rng(1)
    x = (3 + rng.normal(size=(600, 4))).astype(np.float32)
    x[:, 1] = 0.5 * x[:, 0] + 1e-3 * x[:, 1]
    x[300:] += np.linspace(0, 5, 4, dtype=np.float32)
    y = x[:, 0] + 1 + rng.normal(size=600).astype(np.float32)
    fit = {mesh: ss.run(ss.LinearRegression(), (x, y), mesh=mesh, logical_shards=2)
           for mesh in ("data:1", "data:2", "data:1,model:2")}
    for mesh, got in fit.items():
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(fit["data:1"]), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=mesh)
    # within its accuracy: numpy's float64 least squares
    design = np.column_stack([np.ones(600), x.astype(np.float64)])
    want = np.linalg.lstsq(design, y.astype(np.float64), rcond=None)[0]
    np.testing.assert_allclose(np.concatenate([[fit["data:1"].intercept], fit["data:1"].coef]), want, rtol=1e-3)


def test_gpus_are_told_once_how_to_get_bitwise_results(caplog):
    from sharded_scan.program import DETERMINISTIC_GPU_FLAG, warn_if_not_reproducible

    warn_if_not_reproducible.cache_clear()
    for _ in range(2):
        warn_if_not_reproducible("gpu", "")
    warn_if_not_reproducible("gpu", DETERMINISTIC_GPU_FLAG)
    warn_if_not_reproducible("cpu", "")
    warnings = [r.getMessage() for r in caplog.records if "bitwise" in r.getMessage()]
    assert len(warnings) == 1 and DETERMINISTIC_GPU_FLAG in warnings[0]


if __name__ == "__main__":  # the test above, in a process of its own: python -m tests.test_reproducible DIR
    from tests import collector

    collector.fewer_collections()
    collector.freeze()
    jax.config.update("jax_num_cpu_devices", 8)
    every_builtin_bitwise(pathlib.Path(sys.argv[1]))
