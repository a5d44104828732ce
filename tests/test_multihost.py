"""Multi-host slicing: 2 processes x 2 CPU devices give the result of 1 process x 4 devices (to float
rounding: no `logical_shards`, so a `psum` over processes, whose order no code of ours pins), also with a
state split over `model`, whose checkpoint resumes whole in one process.

The 2 x 2 processes run both tests' jobs (``both_workers``): one start, imports and ``jax.distributed``
for the module (~4.5 s of CPU less than a group a test); the module's fixture waits for them to end."""

import jax
import numpy as np
import pytest

from tests import forks, multiprocess
from tests.helpers import assert_to_rounding, f64, rel_err

# The module's processes: forks of one process that imported the launcher (tests/forks.py), ~1.1 s of CPU
# less each than a fresh interpreter.
launcher_forks = forks.module_fixture()

N, D = 1237, 6  # ragged against the 4 x 8 x 2 rows of a step


def worker(npy: str, prefetch: int):
    import jax

    import sharded_scan as ss
    from sharded_scan.sources import ArraySource, IteratorSource, NpySource, SyntheticSource

    class Logged(NpySource):
        def __init__(self, path):
            super().__init__(path)
            self.ranges = []

        def read(self, start, stop):
            self.ranges.append((start, stop))
            return super().read(start, stop)

    x = np.load(npy)
    logged = Logged(npy)
    kw = dict(mesh="data:-1", microbatch=8, steps_per_call=2, prefetch=prefetch)
    results = {
        "gram_npy": ss.run(ss.Gram(), logged, **kw),
        "sum_array": tuple(ss.run(ss.Sum(), ArraySource(x), **kw)),
        "sum_xy": tuple(ss.run(ss.Sum(), SyntheticSource(N, D, seed=5, targets=True, chunk_rows=100), **kw)),
        "gram_iterator": ss.run(ss.Gram(), IteratorSource([x[:500], x[500:501], x[501:]], N), **kw),
    }
    return {"process": jax.process_index(), "devices": jax.device_count(), "ranges": logged.ranges, **results}


def both_workers(worker_kwargs: dict, split_kwargs: dict):
    """:func:`worker`'s and :func:`split_worker`'s results, one after the other in the same processes."""
    return {"rows": worker(**worker_kwargs), "split": split_worker(**split_kwargs)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(x, checkpoint, one, two)``: :func:`worker` on 1 x 4 and :func:`both_workers` on 2 x 2, at once,
    both ended here; ``checkpoint``, the 2 x 2 processes' crashed split save."""
    from tests.test_wide_model import FIVE, FIVE_RUN

    tmp = tmp_path_factory.mktemp("multihost")
    x = np.random.default_rng(0).normal(size=(N, D)).astype(np.float32)
    np.save(tmp / "x.npy", x)
    rows = {"npy": str(tmp / "x.npy"), "prefetch": 2}
    split = {"x": FIVE, "run": FIVE_RUN, "checkpoint": str(tmp / "split")}
    with multiprocess.running("tests.test_multihost:worker", 1, 4, kwargs=rows) as one, \
            multiprocess.running("tests.test_multihost:both_workers", 2, 2,
                                 kwargs={"worker_kwargs": rows, "split_kwargs": split}) as two:
        return x, split["checkpoint"], one.results(timeout=120), two.results(timeout=120)


def test_two_processes_match_one_process_and_read_only_their_rows(runs):
    x, _, one, two = runs
    two = [r["rows"] for r in two]
    assert [r["process"] for r in two] == [0, 1] and all(r["devices"] == 4 for r in one + two)
    assert rel_err(one[0]["gram_npy"], f64(x).T @ f64(x)) < 1e-5
    for key in ("gram_npy", "sum_array", "sum_xy", "gram_iterator"):
        want = jax.tree.leaves(one[0][key])
        for r in two:
            got = jax.tree.leaves(r[key])
            assert len(got) == len(want) > 0
            for g, w in zip(got, want, strict=True):  # a row read twice or missed is far beyond rounding
                assert_to_rounding(g, w)

    # Each step has 4 blocks of 16 rows; process p reads blocks 2p, 2p+1 of every step only.
    step, half = 64, 32
    for p, r in enumerate(two):
        want = [(c + p * half, min(c + (p + 1) * half, N)) for c in range(0, N, step) if c + p * half < N]
        got = [(a, b) for a, b in r["ranges"] if b > a]
        assert got == want, p
    assert one[0]["ranges"][: 2] == [(0, 64), (64, 128)]


def split_worker(x: np.ndarray, run: dict, checkpoint: str):
    """Covariance of ``x`` on ``data:2,model:2``, then again crashed after its saves into ``checkpoint``."""
    import jax

    import sharded_scan as ss
    from tests.helpers import CrashError, crash_at

    mesh = ss.make_mesh("data:2,model:2")
    result = ss.run(ss.Covariance(), x, mesh=mesh, **run)
    try:
        ss.run(ss.Covariance(), x, mesh=mesh, checkpoint=ss.CheckpointOptions(checkpoint, every_steps=1),
               progress=crash_at(2), **run)
    except CrashError:
        pass
    else:
        raise AssertionError("the run did not crash")
    return {"processes": jax.tree.map(lambda d: d.process_index, mesh.devices.tolist()), "cov": result}


def test_a_state_split_over_model_across_processes_is_one_processes_and_resumes_whole(runs):
    # test_wide_model's 5 columns (padded to 6 over model:2) and options, imported in the fixture and here
    # so that the children import only this module. Covariance only: a sketch's program cost each process
    # ~1.4 s more.
    import sharded_scan as ss
    from tests.test_wide_model import FIVE, FIVE_RUN

    _, checkpoint, _, two = runs
    results = [r["split"] for r in two]
    whole = ss.run(ss.Covariance(), FIVE, mesh="data:4", **FIVE_RUN)
    # jax.make_mesh puts each process's 2 devices on one row: model spans a process's devices, data crosses processes.
    assert [r["processes"] for r in results] == [[[0, 0], [1, 1]]] * 2
    assert rel_err(whole.cov, np.cov(f64(FIVE), rowvar=False)) < 1e-5
    for r in results:  # the split's programs are of other shapes (test_wide_model): to rounding, the count exact
        assert_to_rounding(r["cov"], whole)
    got, report = ss.run_with_report(ss.Covariance(), FIVE, mesh="data:4", checkpoint=checkpoint, **FIVE_RUN)
    assert report.resumed_from_cursor > 0  # the 2 processes' split save, converted to whole in one process
    assert_to_rounding(got, whole)
