"""A step watchdog: ends a process that stopped making progress, with one line.

A multi-process job whose peer is alive but stuck (a hung read, a deadlocked
callback, a collective that never completes) would otherwise wait forever: JAX's
heartbeat only catches processes that died. :class:`Watchdog` runs a daemon thread
that, when no step finished for ``timeout`` seconds, prints one line to stderr and
ends the process at once with :data:`EXIT_STALLED` (``os._exit``: the main thread may
be blocked inside a collective, so nothing else could stop it). Checkpoints are
written atomically, so the last complete one survives and rerunning the same command
resumes from it.

:func:`abort` is the same one-line exit, for a caller that found a lost peer itself.
"""

from __future__ import annotations

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

RESUME_HINT = "rerun the same command (on every process) to resume from the last checkpoint"


def abort(message: str, status: int) -> None:
    """Prints ``error: message`` as one line on stderr and ends the process with ``status``.

    Skips interpreter shutdown on purpose: with a dead peer, ``jax.distributed``'s
    shutdown barrier would otherwise wait and then abort with a stack trace.
    """
    line = " ".join(message.split())
    try:
        sys.stderr.write(f"error: {line}\n")
        sys.stderr.flush()
    finally:
        os._exit(status)


_PEER_LOST = (
    "gloo", "connection closed", "connection reset", "connection refused", "broken pipe", "heartbeat",
    "unavailable:", "deadline_exceeded", "coordination service", "barrier",
)


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
