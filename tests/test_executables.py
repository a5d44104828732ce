"""The job-keyed cache of steps (sharded_scan/executables.py): a second fresh process of a small job runs its step
without tracing or compiling it; a job that differs in anything its program depends on, or a damaged entry, never
reuses an entry (issue 45, item 5)."""

import hashlib
import json
import os
import pathlib
import sys
import threading

import jax
import numpy as np
import pandas as pd
import pytest

import sharded_scan as ss
from sharded_scan import compile_cache, compiled, executables
from sharded_scan.program import build_program
from sharded_scan.sources import as_source
from tests import cli, forks

# Each "fresh process" below: a fork of one process that imported the library and JAX and ran nothing (tests/forks.py;
# nothing traced, compiled, loaded or lowered in it before, JAX's cache directory as its environment says), ~1.1 s of
# CPU of imports less each.
launcher_forks = forks.module_fixture()

# A small job in a process of its own: its result's bits, the functions JAX traced, and both caches' counts.
CHILD = """
import json
import jax
traced = []
jax.monitoring.register_event_duration_secs_listener(lambda event, seconds, **kw: traced.append(kw.get("fun_name"))
                                                     if event == "/jax/core/compile/jaxpr_trace_duration" else None)
import numpy as np
import sharded_scan as ss
from sharded_scan import compile_cache, executables
x = np.linspace(-3.0, 5.0, 600).reshape(200, 3) ** 3
table = ss.run(ss.Describe(), x).to_pandas()
print("RESULT", json.dumps({"traced": traced, "executables": executables.counts()._asdict(),
                            "jax": compile_cache.counts()._asdict(), "bits": table.to_numpy().tobytes().hex(),
                            "values": table.to_numpy().tolist()}))
"""


def _child(cache, keyed: str = "1") -> dict:
    env = dict(cli.env(), JAX_COMPILATION_CACHE_DIR=str(cache), SHARDED_SCAN_EXECUTABLE_CACHE=keyed)
    done = cli.run([sys.executable, "-c", CHILD], environment=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_a_second_process_of_a_small_job_runs_its_step_from_the_job_keyed_cache_untraced(tmp_path):
    cold, warm = _child(tmp_path), _child(tmp_path)
    assert cold["executables"] == {"looked_up": 1, "loaded": 0, "stored": 1}
    assert "local_step" in cold["traced"]
    assert not list(tmp_path.glob("jit_local_step*"))  # kept by the job alone: serialized and written once
    # The second: the step neither traced nor compiled (one program, loaded from the job-keyed cache), and its
    # memory estimate read from the entry instead of the step's trace.
    assert warm["executables"] == {"looked_up": 1, "loaded": 1, "stored": 0}
    assert "local_step" not in warm["traced"], warm["traced"]
    assert warm["jax"] == {"looked_up": 1, "from_cache": 1}
    assert warm["bits"] == cold["bits"]
    # Without the entry, the step JAX's cache loads (written where the job-keyed cache was off) is not kept: XLA:CPU
    # serializes such an executable without its kernels (a later process failed at its first step: "Function ...
    # not found").
    for entry in (tmp_path / executables.SUBDIRECTORY).iterdir():
        entry.unlink()
    assert _child(tmp_path, keyed="0")["executables"] == {"looked_up": 0, "loaded": 0, "stored": 0}
    assert list(tmp_path.glob("jit_local_step*"))
    from_jax = _child(tmp_path)
    assert from_jax["executables"] == {"looked_up": 1, "loaded": 0, "stored": 0}
    assert from_jax["jax"] == {"looked_up": 1, "from_cache": 1} and from_jax["bits"] == cold["bits"]
    x = np.linspace(-3.0, 5.0, 600).reshape(200, 3) ** 3
    np.testing.assert_allclose(warm["values"], pd.DataFrame(x).describe().to_numpy(), rtol=1e-12)


@pytest.fixture
def job_cache(tmp_path, monkeypatch):
    """This process's compilation cache in ``tmp_path`` and the job-keyed cache on, as a user's process has them;
    the suite's cache restored after."""
    before = jax.config.jax_compilation_cache_dir
    monkeypatch.setenv(executables.ENV, "1")
    compile_cache.use(str(tmp_path / "cache"))
    compiled._KEYED.clear()
    try:
        yield tmp_path / "cache" / executables.SUBDIRECTORY
    finally:
        compiled._KEYED.clear()
        compile_cache.use(before)


def _entries(directory) -> set[str]:
    return {name for name in os.listdir(directory) if name.endswith(".exe")} if directory.exists() else set()


def test_a_job_that_differs_in_config_shape_dtype_or_devices_keys_anew_and_a_damaged_entry_is_replaced(job_cache):
    x = np.arange(96, dtype=np.float32).reshape(32, 3) / 7
    x[3, 1] = np.nan
    omit = dict(nan_policy="omit", mesh="data:2")

    def sums(rows, **options):
        before = executables.counts()
        got = ss.run(ss.Sum(), rows, **options).sum
        now = executables.counts()
        return got, (now.loaded - before.loaded, now.stored - before.stored)

    first, counted = sums(x, **omit)
    assert counted == (0, 1) and len(_entries(job_cache)) == 1
    np.testing.assert_allclose(first, np.nansum(x.astype(np.float64), 0), rtol=1e-6)
    compiled._KEYED.clear()  # as a fresh process: the entry loaded from disk
    again, counted = sums(x, **omit)
    assert counted == (1, 0)
    np.testing.assert_array_equal(again, first)

    # Each differs from the first in what its step computes; each gets its own entry and its own right answer.
    rows_kept = x[np.isfinite(x).all(1)].astype(np.float64).sum(0)  # a NaN's whole row skipped: same shapes
    for rows, options, expected in (
        (x, dict(omit, nan_policy="omit_rows"), rows_kept),
        (x[:, :2], omit, np.nansum(x[:, :2].astype(np.float64), 0)),
        (x.astype(np.float64), omit, np.nansum(x.astype(np.float64), 0)),
        (x, dict(omit, mesh="data:4"), np.nansum(x.astype(np.float64), 0)),
    ):
        got, counted = sums(rows, **options)
        assert counted == (0, 1), options
        np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert len(_entries(job_cache)) == 5

    # A damaged entry (truncated, then one whose bytes match their digest but hold no executable): ignored and
    # replaced, the right answer each time.
    path = pathlib.Path(executables._path(build_program(ss.Sum(), as_source(x), ss.RunOptions(**omit)).step_key))
    whole = path.read_bytes()
    header_end = whole.index(b"\n", len(executables.MAGIC))
    header = json.loads(whole[len(executables.MAGIC):header_end])
    foreign = whole[header_end + 1:][:header["key_bytes"]] + b"not an executable"
    forged_header = dict(header, bytes=len(foreign), sha256=hashlib.sha256(foreign).hexdigest())
    forged = executables.MAGIC + json.dumps(forged_header).encode() + b"\n" + foreign
    for damaged in (whole[:len(whole) // 2], forged):
        path.write_bytes(damaged)
        compiled._KEYED.clear()
        got, counted = sums(x, **omit)
        assert counted == (0, 1)
        np.testing.assert_array_equal(got, first)
        assert path.read_bytes() != damaged


def test_the_job_keyed_cache_keys_what_it_can_spell_keeps_whole_bounded_entries_off_with_jax_s(job_cache, monkeypatch):
    with pytest.raises(executables.UnkeyableError):
        executables.canonical(ss.from_fn(lambda acc, rows: acc + rows.sum(0), np.zeros(3, np.float32)))
    with pytest.raises(executables.UnkeyableError):
        executables.canonical(object())
    with pytest.raises(executables.UnkeyableError, match="equality is its own"):  # its range: operands
        executables.canonical(ss.Histogram(bins=4, range=(0.0, 1.0)))
    assert executables.canonical(0.1) != executables.canonical(0.1 + 2 ** -56)
    assert executables.canonical(np.arange(3.0)) != executables.canonical(np.arange(3.0) + 1)
    assert executables.canonical((1,)) != executables.canonical([1])
    assert executables.directory() == str(job_cache)
    # Writers at once (threads here, processes alike: a temporary file each, renamed): one whole entry, no leftovers.
    program = jax.jit(lambda x: x + 1).lower(np.ones(2, np.float32)).compile()
    writers = [threading.Thread(target=executables.store, args=("a key", program, (1, 2))) for _ in range(4)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert os.listdir(job_cache) == [os.path.basename(executables._path("a key"))]
    assert executables.load("a key").figures == (1, 2)
    os.remove(executables._path("a key"))
    # At most MAX_ENTRIES: the least recently used (stored or loaded) goes.
    monkeypatch.setattr(executables, "MAX_ENTRIES", 2)
    for number, name in enumerate(("first", "second")):
        executables.store(name, program, (0, 0))
        os.utime(executables._path(name), (number, number))
    assert executables.load("first") is not None  # used now: the newest
    executables.store("third", program, (0, 0))
    assert _entries(job_cache) == {os.path.basename(executables._path(n)) for n in ("first", "third")}
    for name in ("first", "third"):
        os.remove(executables._path(name))
    calls_back = jax.jit(lambda x: jax.pure_callback(np.negative, jax.ShapeDtypeStruct((2,), np.float32), x))
    executables.store("a key", calls_back.lower(np.ones(2, np.float32)).compile(), (0, 0))
    assert _entries(job_cache) == set()  # a callback is its process's own: nothing kept
    compile_cache.use(None)
    assert executables.directory() is None


# An entry loaded and run in a process that lowered no LAPACK call of its own.
LAPACK_CHILD = """
import sys
import numpy as np
from sharded_scan import executables
loaded = executables.executable(executables.load(sys.argv[1]))
print("RESULT", np.asarray(loaded(np.array([[4.0, 2.0], [2.0, 3.0]], np.float32))).tolist())
"""


def test_a_step_holding_a_lapack_call_runs_from_the_job_keyed_cache_in_a_fresh_process(job_cache):
    # LinearRegression's and PCA's steps call LAPACK (Cholesky, QR, triangular solves), whose kernels jaxlib binds
    # only when it lowers such a call: loaded in a fresh process, such a step ended the process with a
    # segmentation fault at its first call.
    import jax.numpy as jnp

    spd = np.array([[4.0, 2.0], [2.0, 3.0]], np.float32)
    executables.store("a cholesky", jax.jit(jnp.linalg.cholesky).lower(spd).compile(), (0,))
    assert len(_entries(job_cache)) == 1
    env = dict(cli.env(), JAX_COMPILATION_CACHE_DIR=str(job_cache.parent), SHARDED_SCAN_EXECUTABLE_CACHE="1")
    done = cli.run([sys.executable, "-c", LAPACK_CHILD, "a cholesky"], environment=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (done.returncode, done.stderr[-2000:])
    np.testing.assert_allclose(json.loads(lines[-1].removeprefix("RESULT ")), np.linalg.cholesky(spd), rtol=1e-6)
