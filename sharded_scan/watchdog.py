"""A step watchdog: ends a process that stopped making progress, with one line.

A multi-process job whose peer is alive but stuck (a hung read, a deadlocked
callback, a collective that never completes) would otherwise wait forever: JAX's
heartbeat only catches processes that died. :class:`Watchdog` runs a daemon thread
that, when no step finished for ``timeout`` seconds, prints one line to stderr and
ends the process at once with :data:`EXIT_STALLED` (``os._exit``: the main thread may
be blocked inside a collective, so nothing else could stop it). Checkpoints are
written atomically, so the last complete one survives and rerunning the same command
resumes from it.

:class:`PeerWatch` ends a process whose peer gave no sign of life for a third of
``jax.distributed``'s heartbeat timeout, before JAX's heartbeat aborts every process with a
C++ stack. :func:`abort` is the same one-line exit, for a caller that found a lost peer itself.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from sharded_scan.errors import UsageError

EXIT_STALLED = 3    # the watchdog fired: no step finished in time
EXIT_PEER_LOST = 4  # another process of the job died or became unreachable
EXIT_STORAGE = 5    # the storage refused a write (no space, read-only, permission, quota)

RESUME_HINT = ("rerun the same command (on every process) to resume from the last checkpoint (a job without "
               "checkpoints starts over)")


_ENDING = threading.Lock()  # held by the thread that ends the process: one line, whichever comes first


def abort(message: str, status: int) -> None:
    """Prints ``error: message`` as one line on stderr and ends the process with ``status``.

    Skips interpreter shutdown on purpose: with a dead peer, ``jax.distributed``'s
    shutdown barrier would otherwise wait and then abort with a stack trace. In a job of
    several processes the peers are told first (:meth:`PeerWatch.farewell`), so that one
    still waiting for this process ends with one line too. A second caller (another
    thread) waits for the end.
    """
    line = " ".join(message.split())
    _ENDING.acquire()
    try:
        sys.stderr.write(f"error: {line}\n")
        sys.stderr.flush()
        if PeerWatch.current is not None:
            PeerWatch.current.farewell(line, status)
    finally:
        os._exit(status)


_PEER_LOST = (
    "gloo", "connection closed", "connection reset", "connection refused", "broken pipe", "heartbeat",
    "unavailable:", "deadline_exceeded", "coordination service", "barrier",
)


class PeerWatch:
    """Ends this process with one line when a peer of the job gives no sign of life for ``timeout`` s.

    JAX's heartbeat ends every process of a job with a fatal C++ log line, a stack trace and
    SIGABRT (status 134) once a process sent no heartbeat for ``--heartbeat_timeout``
    seconds (a stopped, frozen or cut-off host), and JAX offers no hook to end it otherwise.
    This check waits a third as long (``timeout``), so this process ends first, with one line
    and :data:`EXIT_PEER_LOST`: every process bumps a counter in the coordination service's
    key-value store every ``timeout / 10`` s and reads the others'. A process that ends
    says so (:meth:`stop`, :meth:`farewell`) and is no longer expected; one that ended with
    an error (:func:`abort`: its line and status) ends the others after ``grace`` seconds
    with a line naming it and its reason (where they would have waited for it in a
    collective), unless they end first by themselves (the same error: a disagreement on
    the job). The coordinator (process 0, which holds the store) not answering is a lost
    peer too.

    Args:
      client: ``jax.distributed``'s client (``key_value_set``, ``key_value_dir_get``).
      process, processes: this process's index and the job's process count.
      heartbeat: ``jax.distributed``'s heartbeat timeout in seconds; a peer is lost after a third of it.
      on_lost: called with the message instead of :func:`abort` (tests).
    """

    PREFIX = "sharded_scan/liveness"
    current: PeerWatch | None = None  # the one started, which :func:`abort` tells the peers through

    def __init__(self, client: Any, process: int, processes: int, heartbeat: float,
                 on_lost: Callable[[str], None] | None = None):
        self.client, self.process, self.processes = client, process, processes
        self.heartbeat, self.timeout = heartbeat, heartbeat / 3  # JAX's own check fired after 2/3 of it, under load
        self._on_lost = on_lost
        self._interval = max(self.timeout / 10, 0.05)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        now = time.monotonic()
        self._answered, self._seen, self._counts, self._done = now, dict.fromkeys(range(processes), now), {}, set()
        self._failed: dict[int, tuple[int, str, float]] = {}  # peers that ended with an error: status, line, seen
        self.grace = min(self.timeout, 3.0)
        self._threads = [threading.Thread(target=target, name=f"sharded_scan-peers-{name}", daemon=True)
                         for name, target in (("pulse", self._pulse), ("check", self._check))]

    def start(self) -> PeerWatch:
        for thread in self._threads:
            thread.start()
        PeerWatch.current = self
        return self

    def stop(self) -> None:
        """Stops watching and tells the peers that this process ended on purpose (call before
        ``jax.distributed.shutdown``)."""
        self.farewell("", 0)

    def farewell(self, line: str, status: int) -> None:
        """Stops watching and tells the peers how this process ends (``status``, its one ``line``).

        The coordinator (process 0) ending with an error then waits, at most ``2 * timeout``
        seconds, until every peer still alive has ended too: the store they read it from lives in it.
        """
        if self._stop.is_set():
            return
        self._stop.set()
        if PeerWatch.current is self:
            PeerWatch.current = None
        if threading.current_thread() is not self._threads[0]:
            self._threads[0].join(2 * self._interval)  # not longer: a call to a coordinator that is gone
        try:
            self.client.key_value_set(f"{self.PREFIX}/done/{self.process}", json.dumps([status, line]),
                                      allow_overwrite=True)
            deadline = time.monotonic() + 2 * self.timeout
            while status and self.process == 0 and time.monotonic() < deadline:
                now = self._look()
                with self._lock:
                    if all(now - seen > self.timeout for peer, seen in self._seen.items()
                           if peer != self.process and peer not in self._done):
                        return  # every peer ended, or is lost itself (waiting would meet JAX's heartbeat abort)
                time.sleep(self._interval)
        except Exception:  # noqa: BLE001 - the coordinator is gone: nobody is left to tell
            return

    def _pulse(self) -> None:
        count = 0
        while not self._stop.is_set():
            count += 1
            try:
                self.client.key_value_set(f"{self.PREFIX}/alive/{self.process}", str(count), allow_overwrite=True)
                self._look()
            except Exception:  # noqa: BLE001 - the coordinator did not answer: _check counts the time
                pass
            self._stop.wait(self._interval)

    def _look(self) -> float:
        """Reads the peers' counters and farewells from the store; returns when."""
        alive = self.client.key_value_dir_get(f"{self.PREFIX}/alive/")
        done = self.client.key_value_dir_get(f"{self.PREFIX}/done/")
        now = time.monotonic()
        with self._lock:
            self._answered = now
            self._done = {int(key.rsplit("/", 1)[-1]) for key, _ in done}
            for key, value in done:
                peer, (status, line) = int(key.rsplit("/", 1)[-1]), _ending(value)
                if status and peer != self.process and peer not in self._failed:
                    self._failed[peer] = (status, line, now)
            for key, value in alive:
                peer = int(key.rsplit("/", 1)[-1])
                if self._counts.get(peer) != value:
                    self._counts[peer], self._seen[peer] = value, now
        return now

    def _check(self) -> None:
        while not self._stop.wait(self._interval):
            message = self.lost(time.monotonic())
            if message is not None:
                if self._on_lost is None:
                    abort(message, EXIT_PEER_LOST)
                self._on_lost(message)
                return

    def lost(self, now: float) -> str | None:
        """The message when a peer is lost at time ``now``, else None."""
        with self._lock:
            quiet = [(now - seen, peer) for peer, seen in self._seen.items()
                     if peer != self.process and peer not in self._done]
            answered = now - self._answered
            failed = [(peer, status, line) for peer, (status, line, seen) in sorted(self._failed.items())
                      if now - seen > self.grace]
        who = f"process {self.process} of {self.processes} lost a peer: "
        if failed:
            peer, status, line = failed[0]
            return f"{who}process {peer} ended (status {status}): {line}"
        why = (f"(stopped, frozen or cut off; JAX's heartbeat would end every process with a C++ abort at "
               f"{self.heartbeat:g} s), so it stops; {RESUME_HINT}.")
        if answered > self.timeout and self.process != 0:
            return f"{who}the coordinator (process 0) has not answered for {answered:.0f} s {why}"
        idle, peer = max(quiet, default=(0.0, None))
        if idle > self.timeout:
            return f"{who}process {peer} gave no sign of life for {idle:.0f} s {why}"
        return None


def _ending(value: str) -> tuple[int, str]:
    """``(status, line)`` of a peer's farewell (``[status, line]`` in JSON; ``"1"``: an older clean end)."""
    try:
        status, line = json.loads(value)
        return int(status), str(line)
    except (ValueError, TypeError):
        return 0, ""


def is_peer_lost(error: BaseException) -> bool:
    """Whether ``error`` (raised in a multi-process job) says another process is gone."""
    text = f"{error} {error.__cause__ or ''}".lower()
    return any(word in text for word in _PEER_LOST)


def check_timeout(timeout: Any) -> float | None:
    """``timeout`` as positive seconds, or None (off); raises UsageError otherwise."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise UsageError(f"step_timeout must be a positive number of seconds or None, got {timeout!r}.")
    return float(timeout)


class Watchdog:
    """Ends the process with one line when :meth:`beat` was not called for ``timeout`` s.

    Use it as a context manager around the loop and call :meth:`beat` after every
    step; ``timeout=None`` makes it do nothing. The clock starts on ``__enter__``, so
    the first interval also covers compilation and a restore.

    Args:
      timeout: seconds without a beat before the process is ended; None for off (as
        :func:`check_timeout` gives it: ``RunOptions.step_timeout`` is checked there).
      on_stall: called with the message instead of :func:`abort` (tests); the
        watchdog then stops watching.
    """

    def __init__(self, timeout: float | None, on_stall: Callable[[str], None] | None = None):
        self.timeout = timeout
        self._on_stall = on_stall
        self._last = time.monotonic()
        self._beats = 0
        self._where = "before the first step"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Watchdog:
        self._last = time.monotonic()
        if self.timeout is not None:
            self._thread = threading.Thread(target=self._watch, name="sharded_scan-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def beat(self, where: str | None = None) -> None:
        """Records progress; ``where`` (e.g. ``"after row 4096"``) goes into the message."""
        self._last = time.monotonic()
        self._beats += 1
        if where is not None:
            self._where = where

    def message(self, idle: float) -> str:
        import jax  # the backend is up: the watchdog is entered inside a run

        who = f"process {jax.process_index()} of {jax.process_count()}: " if jax.process_count() > 1 else ""
        return (
            f"{who}no step finished for {idle:.0f} s (step_timeout {self.timeout:g} s; last progress {self._where}): "
            f"this process or a peer of the job is stuck, so it stops; {RESUME_HINT}."
        )

    def _watch(self) -> None:
        poll = min(1.0, self.timeout / 4)
        while not self._stop.wait(poll):
            idle = time.monotonic() - self._last
            if idle > self.timeout:
                if self._on_stall is None:
                    abort(self.message(idle), EXIT_STALLED)
                self._on_stall(self.message(idle))
                return
