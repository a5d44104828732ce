"""Run a function in N local JAX processes of M CPU devices each, as N hosts would.

Usage from a test::

    from tests import multiprocess

    def worker(n):                    # module level, importable as tests.test_x:worker
        import jax, sharded_scan as ss
        return ss.run(ss.Sum(), np.ones((n, 3)), mesh="data:-1").sum

    results = multiprocess.run_processes("tests.test_x:worker", 2, 2, kwargs={"n": 10})
    # results[i] is what process i returned (pickled back), i = jax.process_index()

Each child is ``python -m tests.multiprocess`` started from the repository root. Before
the backend starts it sets ``jax_num_cpu_devices=M``, then calls
``jax.distributed.initialize('127.0.0.1:PORT', N, i)`` on a fresh free port with a long
heartbeat (a loaded machine starves live processes for seconds; the test kills every
child when it ends) and a short shutdown timeout, imports ``module:function``, calls it
with ``kwargs`` and pickles the return value. ``run_processes`` raises ``AssertionError``
with every child's exit code and output tail when one fails or the timeout passes, and kills every child in a
``finally`` whatever happens. ``running`` starts them and hands back a ``Group`` whose
``results`` waits for them, for a test that works while they run (they are killed when
its ``with`` block ends). For tests that kill or restart processes themselves, ``spawn``
starts them and ``kill_all`` ends them (call it in a ``finally``). ``share_compiles=True``:
the first process compiles each program for all (:func:`share_compiled_programs`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from launch.processes import free_port
from tests import collector, forks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 18 processes of test_reproducible on 2 loaded cores missed a 5 s heartbeat (a live process aborted);
# every child is killed by the test anyway, so a long heartbeat costs nothing when one dies.
HEARTBEAT_S = 60
INIT_TIMEOUT_S = 60
SHUTDOWN_TIMEOUT_S = 10


def spawn(
    target: str,
    num_processes: int,
    devices_per_process: int,
    outdir: str,
    kwargs: dict[str, Any] | None = None,
    port: int | None = None,
    env: dict[str, str] | None = None,
    share_compiles: bool = False,
) -> list[subprocess.Popen]:
    """Starts the processes; process ``i`` pickles its result to ``outdir/result-i.pkl``.

    Output goes to ``outdir/log-i.txt``. The caller must end them (``kill_all``). ``share_compiles``:
    see :func:`share_compiled_programs`. Forks of the open fork server where there is one (tests/forks.py).
    """
    port = port or free_port()
    with open(os.path.join(outdir, "kwargs.pkl"), "wb") as f:
        pickle.dump(kwargs or {}, f)
    child_env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", **(env or {})}
    procs = []
    for i in range(num_processes):
        cmd = [sys.executable, "-m", "tests.multiprocess", f"--target={target}", f"--outdir={outdir}",
               f"--num_processes={num_processes}", f"--process_id={i}",
               f"--devices_per_process={devices_per_process}", f"--port={port}",
               *(["--share_compiles"] if share_compiles else [])]
        with open(os.path.join(outdir, f"log-{i}.txt"), "wb") as log:
            procs.append(forks.start(cmd, ROOT, child_env, log))  # a fork of the open fork server where there is one
    return procs


def kill_all(procs: list[subprocess.Popen]) -> None:
    """Kills every child still running and reaps it."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(10)


def _tail(outdir: str, i: int, chars: int = 3000) -> str:
    try:
        with open(os.path.join(outdir, f"log-{i}.txt"), errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return "(no output)"



def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """Their exit statuses once all ended or one failed (None: still running at ``timeout``)."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            time.sleep(0.5)  # let the others print why, then stop
            break
        time.sleep(0.05)
    return [p.poll() for p in procs]

class Group:
    """Processes started by :func:`running`; :meth:`results` waits for them."""

    def __init__(self, target: str, procs: list[subprocess.Popen], outdir: str):
        self.target, self.procs, self.outdir = target, procs, outdir

    def results(self, timeout: float = 120) -> list[Any]:
        """Waits up to ``timeout`` seconds for every process; their return values by process id.

        Raises:
          AssertionError: a process failed or the timeout passed; the message holds each
            process's exit code and output tail.
        """
        codes = wait_all(self.procs, timeout)
        if any(c != 0 for c in codes):
            report = "\n".join(f"--- process {i}: exit {c}\n{_tail(self.outdir, i)}" for i, c in enumerate(codes))
            why = f"timed out after {timeout}s (exit None: still running)" if None in codes else "failed"
            raise AssertionError(f"{self.target} {why}\n{report}")
        results = []
        for i in range(len(self.procs)):
            with open(os.path.join(self.outdir, f"result-{i}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


@contextlib.contextmanager
def running(
    target: str,
    num_processes: int,
    devices_per_process: int,
    *,
    kwargs: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    share_compiles: bool = False,
) -> Iterator[Group]:
    """Starts ``module:function(**kwargs)`` in every process; every one is killed on exit.

    For a test that does other work while they run: ``with running(...) as group: ...;
    group.results(timeout)``. Arguments as for :func:`run_processes`.
    """
    with tempfile.TemporaryDirectory(prefix="multiprocess-") as outdir:
        procs = []
        try:
            procs = spawn(target, num_processes, devices_per_process, outdir, kwargs, env=env,
                          share_compiles=share_compiles)
            yield Group(target, procs, outdir)
        finally:
            kill_all(procs)


def run_processes(
    target: str,
    num_processes: int,
    devices_per_process: int,
    *,
    kwargs: dict[str, Any] | None = None,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    share_compiles: bool = False,
) -> list[Any]:
    """Runs ``module:function(**kwargs)`` in every process and returns their results.

    Args:
      target: ``"package.module:function"``, importable from the repository root.
      num_processes: N processes, joined with ``jax.distributed``.
      devices_per_process: M CPU devices in each.
      kwargs: keyword arguments for the function (picklable).
      timeout: seconds for all of them together.
      env: extra environment variables.
      share_compiles: the first process compiles each program for all (:func:`share_compiled_programs`);
        not for tests that kill or stop processes (the others would wait on a dead one's programs).

    Returns:
      The return values, indexed by process id.

    Raises:
      AssertionError: a process failed or the timeout passed; the message holds each
        process's exit code and output tail.
    """
    with running(target, num_processes, devices_per_process, kwargs=kwargs, env=env,
                 share_compiles=share_compiles) as group:
        return group.results(timeout)


def share_compiled_programs():
    """The first process compiles each program the processes run together and hands its executable to the
    others (JAX's ``jax_share_binary_between_hosts``), instead of every process compiling it at the same time
    (test_reproducible's 2x1: 88 -> 55 CPU-s). JAX keys a program differently on each CPU process (the
    topology's fingerprint; the mode of XLA's GPU autotuning cache), which would leave the others waiting for
    a key never sent: here the key holds the devices' kinds and global ids instead, the same on every process
    of one job and apart between layouts, and XLA's GPU caches are off. The processes then run one executable,
    the one each would have compiled (the same program, options, flags and machine). Test code reaching into
    ``jax._src``: under a JAX without the function replaced, each process compiles its own."""
    from jax._src import cache_key, config

    if not hasattr(cache_key, "_hash_accelerator_config"):  # another JAX: each process compiles its own
        return

    def same_on_every_process(hash_obj, devices):
        for device in devices.flat:
            hash_obj.update(f"{device.device_kind}:{device.id}".encode())

    cache_key._hash_accelerator_config = same_on_every_process
    config.update("jax_persistent_cache_enable_xla_caches", "none")
    config.update("jax_share_binary_between_hosts", True)
    # a key never sent fails the wait in minutes (JAX's default: 20), before the test's own timeout
    config.update("jax_share_binary_between_hosts_timeout_ms", 300_000)


def _child() -> None:
    parser = argparse.ArgumentParser()
    for name in ("target", "outdir"):
        parser.add_argument(f"--{name}", required=True)
    for name in ("num_processes", "process_id", "devices_per_process", "port"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--share_compiles", action="store_true")
    a = parser.parse_args()
    collector.fewer_collections()

    import jax

    jax.config.update("jax_num_cpu_devices", a.devices_per_process)
    jax.distributed.initialize(
        f"127.0.0.1:{a.port}", a.num_processes, a.process_id,
        initialization_timeout=INIT_TIMEOUT_S, heartbeat_timeout_seconds=HEARTBEAT_S,
        shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S,
    )
    if a.share_compiles:
        share_compiled_programs()
    module, function = a.target.split(":")
    with open(os.path.join(a.outdir, "kwargs.pkl"), "rb") as f:
        kwargs = pickle.load(f)
    target = getattr(importlib.import_module(module), function)
    collector.freeze()
    result = target(**kwargs)
    with open(os.path.join(a.outdir, f"result-{a.process_id}.pkl.tmp"), "wb") as f:
        pickle.dump(result, f)
    os.replace(os.path.join(a.outdir, f"result-{a.process_id}.pkl.tmp"),
               os.path.join(a.outdir, f"result-{a.process_id}.pkl"))
    jax.distributed.shutdown()


if __name__ == "__main__":
    _child()
