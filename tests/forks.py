"""A fork server for the processes the suite starts: one interpreter imports what the launcher imports (JAX, the
library, absl: ~1.1 s of CPU a process) once, and forks a child for each process a test asks for.

Each child is a process of its own, started as its command line would be and with the same code: its own session
(``os.killpg`` ends it), directory, environment, ``sys.argv``, ``sys.path[0]``, stdin/stdout/stderr (the caller's
file descriptors, passed over a Unix socket), the launcher's module imported and its flags parsed there, JAX's
backend unstarted (no backend, nothing traced or compiled, no thread in the server when it forks); at its end
Python's own exit steps (threads joined, exit handlers) and its exit status as the command's. Command lines it
runs: ``python -m launch.main ARGS``, ``python -m launch.local ARGS``, ``python -m tests.multiprocess ARGS`` and
``python -c CODE ARGS``, where the environment holds JAX's and XLA's variables as the server's (JAX reads those at
import), except ``JAX_PLATFORMS`` and ``JAX_COMPILATION_CACHE_DIR`` (set again in the child) and the cluster
variables JAX reads only when ``jax.distributed`` starts. Any other command is started as before, a fresh
interpreter: :func:`forkable` says which.

Use: ``with serving(): ...`` (or a module's ``launcher_forks = module_fixture()``): while a server is open,
``tests/cli.py``'s ``run``/``run_all``/``started`` and ``tests/multiprocess.py``'s ``spawn`` fork what it can
run. It starts at the first such process (nothing started, nothing paid) and ends with the block, killing any
child still running; its children's CPU is then counted in the process that opened it (``RUSAGE_CHILDREN``,
``SHARDED_SCAN_TEST_CPU``). The modules' fixtures and ``cli.run_forked`` share one server a test process instead
(:func:`shared_serving`: it outlives their blocks, which still kill their children left running; each child's CPU
is counted in the test that waited for it, :func:`forked_cpu`). ``python -m tests.forks --client=MODULE ARGS`` stands
for ``python -m MODULE ARGS`` in a shell (tests/test_docs.py): it runs them in a child of the server named by
``$SHARDED_SCAN_TEST_FORKS`` with its own stdin, stdout, stderr, directory and environment, and exits with its
status. Only the standard library at import: clients start fast.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOCKET_ENV = "SHARDED_SCAN_TEST_FORKS"
# python -m MODULE: the function the child runs (the module imported in the child: launch.main and launch.local
# define flags of the same names, so the server imports only what they import)
MODULES = {"launch.main": "cli", "launch.local": "cli", "tests.multiprocess": "_child"}
# and orbax, which a job imports at its first save (~0.2 s of CPU; tests/test_damaged_checkpoints.py checks, in a
# fresh interpreter, that a job without checkpoints never does)
PRELOADED = ("absl.app", "ml_collections.config_flags", "launch.config_args", "launch.data", "launch.help",
             "launch.logs", "launch.metrics", "launch.outputs", "launch.processes", "sharded_scan.workdir",
             "tests.multiprocess", "orbax.checkpoint")
# Read by JAX or XLA at import or when its backend starts: forked children must have the server's values.
SAME_PREFIXES = ("JAX_", "XLA_", "TF_")
# ... except: the platform (set again in the child) and what JAX reads only when jax.distributed starts (a
# cluster's coordinator, tests/test_launch_recipes.py).
SET_AGAIN = {"JAX_PLATFORMS": "jax_platforms", "JAX_COMPILATION_CACHE_DIR": "jax_compilation_cache_dir"}
MAY_DIFFER = (*SET_AGAIN, "JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_PORT", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
              "JAX_LOCAL_DEVICE_IDS")
MESSAGE = 1 << 20
START_TIMEOUT = 120

_open: list[Server] = []  # the innermost open server last (one per pytest process: xdist workers are processes)
_shared: list[Server] = []  # this process's server for the modules' blocks (shared_serving)
_forked_cpu = [0.0]  # CPU seconds of its children that ended
_lock = threading.Lock()


class Server:
    """The server process (started at the first :meth:`fork`) and its socket."""

    def __init__(self, env: dict[str, str], counted: bool = False):
        """``counted``: its children's CPU seconds are added to :func:`forked_cpu` as they end (a server that
        ends with a block is reaped by this process, which counts them then)."""
        self.env, self.counted = env, counted
        self.children: list[Forked] = []  # the children it forked (shared_serving kills a block's leftovers)
        self._dir = tempfile.TemporaryDirectory(prefix="forks-")
        self.path = os.path.join(self._dir.name, "socket")
        self._proc: subprocess.Popen | None = None
        self._log = os.path.join(self._dir.name, "server.log")

    def start(self) -> None:
        with _lock:
            if self._proc is not None:
                return
            with open(self._log, "wb") as log:
                self._proc = subprocess.Popen([sys.executable, "-m", "tests.forks", f"--serve={self.path}"],
                                              cwd=ROOT, env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                              stderr=log, start_new_session=True)
            ready, _, _ = select.select([self._proc.stdout], [], [], START_TIMEOUT)
            line = self._proc.stdout.readline() if ready else b""
            if line.strip() != b"ready":
                self.close()
                raise AssertionError(f"the fork server did not start: {self.log_tail()}")

    def log_tail(self) -> str:
        try:
            with open(self._log, errors="replace") as f:
                return f.read()[-3000:]
        except OSError:
            return "(no log)"

    def fork(self, cmd: list[str], cwd: str, env: dict[str, str], fds: tuple[int, int, int]) -> Forked:
        """Starts ``cmd`` in directory ``cwd`` with ``env`` and ``fds`` as its stdin, stdout and stderr."""
        self.start()
        child = Forked(self.path, cmd, cwd, env, fds, self.log_tail, counted=self.counted)
        with _lock:  # tests fork from several threads at once
            self.children = [c for c in self.children if c.returncode is None] + [child]
        return child

    def close(self) -> None:
        """Ends the server: it kills its children still running, reaps them, and exits."""
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()  # EOF: the server's signal to end
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            proc.stdout.close()
        self._dir.cleanup()


def _kind(cmd: list[str]) -> str | None:
    """The module ``cmd`` runs with ``python -m``, ``"-c"``, or None where a fork cannot run it."""
    if len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m" and cmd[2] in MODULES:
        return cmd[2]
    if len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-c":
        return "-c"
    return None


def forkable(cmd: list[str], env: dict[str, str]) -> Server | None:
    """The open server that can run ``cmd`` in ``env`` as a fork, or None (start it as a fresh process)."""
    if not _open or _kind(cmd) is None:
        return None
    server = _open[-1]
    return server if _same_start(env, server.env) else None


def _same_start(env: dict[str, str], server_env: dict[str, str]) -> bool:
    """Whether a child of a server started in ``server_env`` starts as a process started in ``env`` would."""
    keys = {k for k in (*env, *server_env) if k.startswith(SAME_PREFIXES) and k not in MAY_DIFFER}
    return all(env.get(k) == server_env.get(k) for k in keys)


def start(cmd: list[str], cwd, env: dict[str, str], out, err=None, new_session: bool = False):
    """``cmd`` running in ``cwd`` with ``env``, stdout to the file ``out`` and stderr to ``err`` (``out`` where None),
    stdin empty: a fork of the open server where it can run ``cmd`` (it leads a session of its own), else a fresh
    process (in a session of its own where ``new_session``)."""
    err = out if err is None else err
    server = forkable(cmd, env)
    if server is None:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                start_new_session=new_session)
    with open(os.devnull, "rb") as null:
        return server.fork(cmd, str(cwd), env, (null.fileno(), out.fileno(), err.fileno()))


@contextlib.contextmanager
def serving(env: dict[str, str] | None = None) -> Iterator[Server]:
    """A fork server (environment ``env``, by default ``tests/cli.py``'s) for the processes started in the
    block; it ends, with every child still running, when the block does."""
    if env is None:
        from tests import cli

        env = cli.env()
    server = Server(env)
    _open.append(server)
    try:
        yield server
    finally:
        _open.remove(server)
        server.close()


def module_fixture():
    """A module's autouse fixture serving its processes: ``launcher_forks = forks.module_fixture()``
    (:func:`shared_serving`)."""
    import pytest

    @pytest.fixture(scope="module", autouse=True)
    def launcher_forks():
        with shared_serving() as server:
            yield server

    return launcher_forks


@contextlib.contextmanager
def shared_serving() -> Iterator[Server]:
    """:func:`serving` (``tests/cli.py``'s environment) by this process's one server, started at its first fork
    and ended by :func:`close_shared` (tests/conftest.py, as a session ends), not a server a block: each server
    imports JAX, the library, absl and orbax (~0.8 s of CPU), once a test process rather than once a module. When
    the block ends its children still running are killed, as a server of its own would kill them; each child's CPU
    seconds, which reach this process only when the server ends, come in its status message (:func:`forked_cpu`).
    A block whose environment differs from the server's in what its forks must share gets a server of its own."""
    from tests import cli

    env = cli.env()
    if not _shared:
        _shared.append(Server(env, counted=True))
    server = _shared[0]
    if not _same_start(env, server.env):
        with serving(env) as own:
            yield own
        return
    with _lock:
        before = set(server.children)
    _open.append(server)
    try:
        yield server
    finally:
        _open.remove(server)
        with _lock:
            left = [c for c in server.children if c not in before]
        for child in left:
            if child.poll() is None:
                child.kill()
                with contextlib.suppress(subprocess.TimeoutExpired, AssertionError):
                    child.wait(30)


def close_shared() -> None:
    """Ends this process's shared server (:func:`shared_serving`), killing any child still running."""
    while _shared:
        _shared.pop().close()


def forked_cpu() -> float:
    """CPU seconds of the shared server's children that ended so far, as their caller read their status."""
    return _forked_cpu[0]


class Forked:
    """A forked child, as much of ``subprocess.Popen`` as the tests use: ``pid``, ``returncode``, ``poll``,
    ``wait``, ``send_signal``, ``kill``, ``terminate``."""

    def __init__(self, path: str, cmd: list[str], cwd: str, env: dict[str, str], fds: tuple[int, int, int],
                 log_tail=lambda: "(no log here)", counted: bool = False):
        self.args, self.returncode, self._log_tail, self._counted = cmd, None, log_tail, counted
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.connect(path)
        request = {"kind": _kind(cmd), "args": cmd[2:] if _kind(cmd) == "-c" else cmd[3:], "cwd": str(cwd),
                   "env": env}
        socket.send_fds(self._sock, [json.dumps(request).encode()], list(fds))
        first = self._message()  # the child's, once it leads its own session; or the server's, where it failed
        self.pid, self.returncode = first["pid"], first.get("exit")

    def _message(self) -> dict:
        message = self._sock.recv(MESSAGE)
        if not message:
            raise AssertionError(f"the fork server ended before its child ended: {self._log_tail()}")
        return json.loads(message)

    def _read(self) -> None:
        message = self._message()
        if self._counted:
            with _lock:
                _forked_cpu[0] += message.get("cpu", 0.0)
        self.returncode = message["exit"]
        self._sock.close()

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._sock], [], [], 0)[0]:
            self._read()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._sock], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not a pid the system may have given another process since
            # it may have ended and been reaped by the server before its status reached us: nothing to do (as Popen)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


# ---------------------------------------------------------------- the server process


def _child(kind: str, args: list[str], cwd: str, env: dict[str, str], fds: list[int], conn: socket.socket,
           keep: set[int]) -> None:
    """In the forked child: becomes the command's process, runs it, exits with its status (never returns)."""
    code = 1
    try:
        os.setsid()
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: ends with the server, never orphaned
        conn.send(json.dumps({"pid": os.getpid()}).encode())  # its caller may signal its group from now on
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in keep | set(fds):  # the server's sockets, pipe and selector, and the passed copies
            if fd > 2:
                with contextlib.suppress(OSError):
                    os.close(fd)
        os.chdir(cwd)
        before = {name: os.environ.get(name) for name in SET_AGAIN}
        os.environ.clear()
        os.environ.update(env)
        import jax

        for name, option in SET_AGAIN.items():  # JAX read these at import: as it would have read them here
            if env.get(name) != before[name]:
                jax.config.update(option, env.get(name))
        try:
            if kind == "-c":
                import types

                sys.argv, sys.path[0] = ["-c", *args[1:]], ""
                main = types.ModuleType("__main__")
                sys.modules["__main__"] = main
                exec(compile(args[0], "<string>", "exec"), main.__dict__)
            else:
                import importlib

                sys.path[0] = cwd  # as python -m puts it
                module = importlib.import_module(kind)
                sys.argv = [module.__file__, *args]
                getattr(module, MODULES[kind])()
            code = 0
        except SystemExit as e:
            if isinstance(e.code, int) or e.code is None:
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            threading._shutdown()  # as the interpreter at its exit: non-daemon threads joined, then atexit
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _serve(path: str) -> None:
    import selectors

    from tests import collector

    collector.fewer_collections()
    import importlib

    for module in PRELOADED:  # imported once, here, for every child
        importlib.import_module(module)

    collector.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    for fileobj in (listener, wake_r, sys.stdin):
        selector.register(fileobj, selectors.EVENT_READ)
    print("ready", flush=True)

    def reap(flags: int) -> None:
        while children:
            pid, status, usage = os.wait4(-1, flags)
            if pid == 0:
                return
            conn = children.pop(pid, None)
            if conn is not None:
                cpu = usage.ru_utime + usage.ru_stime  # with its own children's that it waited for
                with contextlib.suppress(OSError):
                    conn.send(json.dumps({"pid": pid, "exit": os.waitstatus_to_exitcode(status), "cpu": cpu}).encode())
                conn.close()

    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(conn, MESSAGE, 3)
                request = json.loads(message)
                sys.stdout.flush()
                sys.stderr.flush()
                keep = {listener.fileno(), wake_r, wake_w, selector.fileno(), conn.fileno(),
                        *(c.fileno() for c in children.values())}
                pid = os.fork()
                if pid == 0:
                    _child(request["kind"], request["args"], request["cwd"], request["env"], fds, conn, keep)
                for fd in fds:
                    os.close(fd)
                children[pid] = conn  # the child sends its pid; the server, its status when it ends
            elif key.fileobj is wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                reap(os.WNOHANG)
            elif not os.read(0, 1):  # stdin closed: the block that opened the server ended
                for pid in list(children):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                reap(0)
                return


def _client(module: str, args: list[str]) -> int:
    """Runs ``python -m MODULE ARGS`` in a child of the server at ``$SHARDED_SCAN_TEST_FORKS`` with this process's
    stdin, stdout, stderr, directory and environment; its exit status (a signal's: 128 + the signal)."""
    cmd = [sys.executable, "-m", module, *args]
    child = Forked(os.environ[SOCKET_ENV], cmd, os.getcwd(), dict(os.environ), (0, 1, 2))
    for sig in (signal.SIGINT, signal.SIGTERM):  # passed on, as to a process the shell started itself
        signal.signal(sig, lambda signum, _: child.send_signal(signum))
    code = child.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    if sys.argv[1].startswith("--serve="):
        _serve(sys.argv[1].removeprefix("--serve="))
    elif sys.argv[1].startswith("--client="):
        sys.exit(_client(sys.argv[1].removeprefix("--client="), sys.argv[2:]))
