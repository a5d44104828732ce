"""Runs ``launch.main`` / ``launch.local`` in subprocesses for the launcher tests.

Every process started here ends in the test that started it (``finally`` kills it).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 120
# the suite's XLA:CPU code generation (tests/conftest.py), not the defaults users get
LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def main_cmd(*args: str, devices: int = 4) -> list[str]:
    return [sys.executable, "-m", "launch.main", *args, f"--jax_num_cpu_devices={devices}", "--jax_platforms=cpu"]


def local_cmd(num_processes: int, devices: int, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "launch.local", f"--num_processes={num_processes}", f"--devices_per_process={devices}",
        "--", *args, "--heartbeat_timeout=10",
    ]


def env() -> dict[str, str]:
    e = dict(os.environ, PYTHONUNBUFFERED="1")
    # tests/site: a sitecustomize setting the cycle collector as in the suite's own processes (tests/collector.py)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests" / "site"), e.get("PYTHONPATH", "")])
    e.pop("JAX_NUM_CPU_DEVICES", None)
    return e


def run(cmd: list[str], timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """Runs ``cmd`` to the end (killed at ``timeout``); stdout and stderr as text."""
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)


def run_all(cmds: list[list[str]], timeout: float = TIMEOUT, at_once: int = 4) -> list[subprocess.CompletedProcess]:
    """Runs independent commands ``at_once`` at a time, like :func:`run` each (every one ends
    here: killed at ``timeout``); their results in order."""
    with concurrent.futures.ThreadPoolExecutor(at_once) as pool:
        return list(pool.map(lambda cmd: run(cmd, timeout), cmds))


# One interpreter imports the launcher (JAX, absl, the library: ~1.1 s of CPU a process) and forks a child per
# command line: each a process of its own with fresh flags, JAX unstarted (no backend, no thread in the parent),
# its own directory, sys.path[0], stdout, stderr and exit status, running what ``python -m launch.main ARGS``
# runs (``launch.main.cli``) from the same modules, then the exit handlers (but no interpreter teardown). For
# single-process command lines: usage errors, --help, --list_configs, jobs whose claims are the launcher's
# (tests/test_cli_config.py's file kinds); ``python -m launch.main`` itself starts in tests/test_launch.py's run,
# the parquet and own-combiner runs of tests/test_cli_config.py, the multi-process tests and tests/test_docs.py.
FORKED = """
import atexit, json, os, sys
from tests import collector
collector.fewer_collections()
import launch.main
collector.freeze()
jobs = json.load(sys.stdin)
pids = []
for args, cwd, out, err in jobs:
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(cwd)
            sys.path[0] = cwd  # as python -m puts it
            for fd, path in ((1, out), (2, err)):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            sys.argv = [launch.main.__file__, *args]
            try:
                launch.main.cli()
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            atexit._run_exitfuncs()
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
    pids.append(pid)
print(json.dumps([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]))
"""


def run_forked(cmds: list[list[str]], cwd: Path = ROOT, timeout: float = TIMEOUT) -> list[subprocess.CompletedProcess]:
    """Runs single-process :func:`main_cmd` command lines side by side, each in a process forked from one
    that imported the launcher (:data:`FORKED`), started in ``cwd`` (all killed at ``timeout``); their
    results in order, as :func:`run`'s."""
    import tempfile

    prefix = [sys.executable, "-m", "launch.main"]
    assert all(cmd[:3] == prefix for cmd in cmds), cmds
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [(cmd[3:], str(cwd), f"{tmp}/{i}.out", f"{tmp}/{i}.err") for i, cmd in enumerate(cmds)]
        parent = subprocess.Popen([sys.executable, "-c", FORKED], cwd=ROOT, env=env(), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = parent.communicate(json.dumps(jobs), timeout=timeout)  # it waits for its children
        except BaseException:  # the parent and its children: one process group, ended here
            os.killpg(parent.pid, signal.SIGKILL)
            parent.wait(timeout=30)
            raise
        assert parent.returncode == 0, stdout + stderr
        codes = json.loads(stdout.splitlines()[-1])
        return [subprocess.CompletedProcess(cmd, code, Path(out).read_text(), Path(err).read_text())
                for cmd, code, (*_, out, err) in zip(cmds, codes, jobs, strict=True)]


@contextlib.contextmanager
def started(cmd: list[str], log_path: Path, environment: dict[str, str] | None = None):
    """A running ``cmd`` in its own process group (with ``environment``, by default :func:`env`),
    output to ``log_path``; the group is killed on exit."""
    log = open(log_path, "w")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(cmd, cwd=ROOT, env=environment or env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        log.close()


def checkpoints(workdir: Path) -> list[int]:
    """Cursors of the complete checkpoints under ``workdir/checkpoints``."""
    where = workdir / "checkpoints"
    if not where.is_dir():
        return []
    return sorted(int(p.name) for p in where.iterdir() if re.fullmatch(r"\d+", p.name))


def wait_for_checkpoint(workdir: Path, proc: subprocess.Popen, at_least: int = 1, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = checkpoints(workdir)
        if len(found) >= at_least:
            return found
        assert proc.poll() is None, f"the run ended (status {proc.returncode}) before checkpointing"
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint in {workdir} after {timeout} s")


def result(workdir: Path) -> dict[str, np.ndarray]:
    with np.load(workdir / "result.npz") as f:
        return {k: f[k] for k in f.files}


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray], exact: bool = True) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        if exact:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        else:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-5 * np.abs(b[k]).max(), err_msg=k)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """Asserts a usage failure: status 2, one ``error:`` line, no traceback; returns the line."""
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, out
    assert "Traceback" not in out, out
    assert len(errors) == 1, out
    return errors[0]


def summary(workdir: Path) -> dict:
    return json.loads((workdir / "summary.json").read_text())
