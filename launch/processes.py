"""Starts N local processes of one job, prefixes their output, stops them all when one fails."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from sharded_scan.checkpoint_store import COMMIT_MARKER
from sharded_scan.errors import UsageError
from sharded_scan.watchdog import EXIT_PEER_LOST

# The launch.main flags every process gets from launch.local (commands()), and how to set each instead.
SET_HERE = {
    "coordinator_address": "--port=P (before --)",
    "num_processes": "--num_processes=N before --",
    "process_id": "nothing: each process gets its index",
    "jax_num_cpu_devices": "--devices_per_process=N before --",
    "jax_platforms": "nothing: launch.local runs CPU processes (run launch.main itself on other platforms)",
}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commands(main_args: list[str], num_processes: int, devices: int, port: int) -> list[list[str]]:
    """The ``launch.main`` command line of each process."""
    return [
        [
            sys.executable, "-m", "launch.main", *main_args,
            f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={num_processes}", f"--process_id={i}",
            f"--jax_num_cpu_devices={devices}", "--jax_platforms=cpu",
        ]
        for i in range(num_processes)
    ]


def check_main_args(main_args: list[str]) -> None:
    """Raises a one-line UsageError when ``main_args`` set a flag that launch.local sets itself
    (it would be overridden silently)."""
    for arg in main_args:
        name = arg.lstrip("-").split("=", 1)[0]
        if arg.startswith("-") and name in SET_HERE:
            raise UsageError(f"{arg} after -- would be overridden: launch.local sets --{name} for every process; "
                             f"pass {SET_HERE[name]}.")


def resume_hint(main_args: list[str]) -> str:
    """What rerunning will do: resume from the last complete checkpoint, or start again."""
    workdir = next((a.split("=", 1)[1] for a in main_args if a.startswith("--workdir=")), None)
    directory = os.path.join(workdir, "checkpoints") if workdir else ""
    cursors = [int(n) for n in (os.listdir(directory) if os.path.isdir(directory) else [])
               if re.fullmatch(r"\d+", n) and os.path.isfile(os.path.join(directory, n, COMMIT_MARKER))]
    if cursors:
        return f"rerun the same command to resume from the checkpoint at row {max(cursors)}"
    return "no checkpoint was written yet, so rerunning the same command starts the job again"


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL it when launch.local dies (Linux), so no worker is orphaned."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _pump(i: int, stream, lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        with lock:
            sys.stdout.write(f"[{i}] {line.decode(errors='replace')}")
            sys.stdout.flush()


def launch(main_args: list[str], num_processes: int, devices: int, port: int = 0, kill_after: float = 30.0) -> int:
    """Starts the processes, waits for them, returns the job's exit status.

    The status is 0 when every process exits 0, else the first non-zero status seen
    (a process killed by signal S gives 128 + S). Every process is ended before this
    returns.
    """
    port = port or free_port()
    lock = threading.Lock()
    # Each in its own session: a Ctrl-C in the terminal reaches only this process, which passes
    # it on once (a second one, passed on again, aborts them at once). They die with this one.
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                         preexec_fn=_die_with_parent)
        for cmd in commands(main_args, num_processes, devices, port)
    ]
    pumps = [threading.Thread(target=_pump, args=(i, p.stdout, lock), daemon=True) for i, p in enumerate(procs)]
    for t in pumps:
        t.start()
    terminated_at: list[float] = []

    def forward(signum, frame):
        del frame
        terminated_at.append(time.monotonic())
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM if signum == signal.SIGTERM else signal.SIGINT)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    status = 0
    try:
        while True:
            running = [p for p in procs if p.poll() is None]
            failed = sorted((p for p in procs if p.returncode not in (None, 0)), key=_blame)
            if failed:
                status = _status(failed[0].returncode)
                with lock:
                    print(f"[local] process {procs.index(failed[0])} {_how(failed[0].returncode)}; stopping the "
                          f"others; {resume_hint(main_args)}", flush=True)
                break
            if not running or (terminated_at and time.monotonic() - terminated_at[0] > kill_after):
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        for t in pumps:
            t.join(timeout=5)
        for s, handler in previous.items():
            signal.signal(s, handler)
    if status:
        return status
    failed = sorted((p for p in procs if p.returncode), key=_blame)
    return _status(failed[0].returncode) if failed else 0


def _blame(proc: subprocess.Popen) -> int:
    """Orders processes that ended at once: the cause (a signal, an error) before a peer-lost exit."""
    if proc.returncode < 0:
        return 0
    return 2 if proc.returncode == EXIT_PEER_LOST else 1


def _how(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by {signal.Signals(-returncode).name} (status {128 - returncode})"
    return f"exited with status {returncode}"


def _status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode
