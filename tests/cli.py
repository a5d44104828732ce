"""Runs ``launch.main`` / ``launch.local`` in subprocesses for the launcher tests: fresh interpreters, or forks
of the open fork server (a module's, shared by the test process: tests/forks.py) where it can run the command.

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
import tempfile
import time
from pathlib import Path

import numpy as np

from tests import forks

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


def run(cmd: list[str], timeout: float = TIMEOUT, cwd: Path = ROOT,
        environment: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs ``cmd`` in ``cwd`` with ``environment`` (by default :func:`env`) to the end (killed at ``timeout``);
    stdout and stderr as text. A fork of the open fork server where it can run ``cmd`` (tests/forks.py), else a
    fresh process."""
    environment = environment or env()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = forks.start(cmd, cwd, environment, out, err, new_session=True)
        try:
            proc.wait(timeout)
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):  # its group may have ended since the poll
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
        out.seek(0)
        err.seek(0)
        text = [f.read().decode(errors="replace") for f in (out, err)]
        return subprocess.CompletedProcess(cmd, proc.returncode, *text)


def run_all(cmds: list[list[str]], timeout: float = TIMEOUT, at_once: int = 4) -> list[subprocess.CompletedProcess]:
    """Runs independent commands ``at_once`` at a time, like :func:`run` each (every one ends
    here: killed at ``timeout``); their results in order."""
    with concurrent.futures.ThreadPoolExecutor(at_once) as pool:
        return list(pool.map(lambda cmd: run(cmd, timeout), cmds))


def run_forked(cmds: list[list[str]], cwd: Path = ROOT, timeout: float = TIMEOUT) -> list[subprocess.CompletedProcess]:
    """Runs single-process :func:`main_cmd` command lines side by side in ``cwd``, each in a process forked
    from one that imported the launcher (the open fork server, else one for these: tests/forks.py), all killed
    at ``timeout``; their results in order, as :func:`run`'s. For command lines whose claims are the launcher's
    (usage errors, --help, --list_configs, jobs); ``python -m launch.main`` itself, a fresh interpreter, starts
    in tests/test_cli_config.py's own-combiner run, tests/test_storage_faults.py's disk-full run and
    launch.local's processes."""
    prefix = [sys.executable, "-m", "launch.main"]
    assert all(cmd[:3] == prefix for cmd in cmds), cmds
    with contextlib.ExitStack() as stack:
        if forks.forkable(cmds[0], env()) is None:
            stack.enter_context(forks.shared_serving())
        with concurrent.futures.ThreadPoolExecutor(len(cmds)) as pool:
            return list(pool.map(lambda cmd: run(cmd, timeout, cwd), cmds))


@contextlib.contextmanager
def started(cmd: list[str], log_path: Path, environment: dict[str, str] | None = None):
    """A running ``cmd`` in its own process group (with ``environment``, by default :func:`env`),
    output to ``log_path``; the group is killed on exit. A fork of the open fork server where it can run
    ``cmd`` (tests/forks.py), else a fresh process."""
    log = open(log_path, "w")  # noqa: SIM115 - closed in finally
    proc = forks.start(cmd, ROOT, environment or env(), log, new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # its group may have ended since the poll
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
