"""Multi-process start-up (``jax.distributed``) and preemption handling.

:func:`initialize` starts JAX's multi-controller runtime explicitly (coordinator
address, process count and id), or lets ``jax.distributed.initialize()`` detect a
cluster (Cloud TPU pod, SLURM, Open MPI, Kubernetes), or stays single-process.

:class:`PreemptionWatch` turns SIGTERM into a clean stop at a step boundary that every
process agrees on; the engine then saves a checkpoint and raises :class:`Preempted`.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any, NamedTuple

import jax

from sharded_scan.errors import UsageError

_log = logging.getLogger(__name__)

DEFAULT_INITIALIZATION_TIMEOUT = 300
DEFAULT_HEARTBEAT_TIMEOUT = 100
DEFAULT_SHUTDOWN_TIMEOUT = 300


class Preempted(Exception):  # noqa: N818 - an outcome, not a failure
    """The run stopped early on SIGTERM after saving a checkpoint at ``cursor``."""

    def __init__(self, cursor: int, num_rows: int, directory: str):
        self.cursor, self.num_rows, self.directory = cursor, num_rows, directory
        super().__init__(
            f"preempted: saved a checkpoint at row {cursor} of {num_rows} in {directory}; "
            "rerun the same command to resume."
        )


class Timeouts(NamedTuple):
    """``jax.distributed`` timeouts, in seconds."""

    initialization: int = DEFAULT_INITIALIZATION_TIMEOUT
    heartbeat: int = DEFAULT_HEARTBEAT_TIMEOUT
    shutdown: int = DEFAULT_SHUTDOWN_TIMEOUT


def detected_cluster() -> str | None:
    """The cluster ``jax.distributed.initialize()`` would detect, or None."""
    try:  # no public API lists the clusters; this is the list jax.distributed.initialize() walks
        from jax._src.clusters import ClusterEnv
    except ImportError:  # pragma: no cover - jax moved it
        return None
    for env in ClusterEnv._cluster_types:
        try:
            if not env.opt_in_only_method and env.is_env_present():
                return env.__name__
        except Exception as e:  # noqa: BLE001 - a probe failing means "not this cluster"
            _log.debug("cluster probe %s failed: %s", env.__name__, e)
    return None


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeouts: Timeouts | None = None,
    local_device_ids: Any = None,
) -> str:
    """Starts ``jax.distributed`` when this is a multi-process job.

    Call it first, before anything touches a JAX backend.

    Args:
      coordinator_address: ``host:port`` of process 0's coordinator. Given together
        with ``num_processes`` and ``process_id``, they start the runtime explicitly.
      num_processes: the number of processes of the job.
      process_id: this process's index, ``0 <= process_id < num_processes``.
      timeouts: initialization, heartbeat and shutdown timeouts in seconds.
      local_device_ids: the local devices this process uses (GPU clusters with one
        process per GPU); None for all.

    Returns:
      How it started: ``"explicit"``, ``"auto:<ClusterName>"`` or ``"single"``.

    Raises:
      UsageError: only some of the three explicit settings are given, or they are
        out of range.
    """
    timeouts = timeouts or Timeouts()
    given = [coordinator_address is not None, num_processes is not None, process_id is not None]
    kwargs = {
        "initialization_timeout": int(timeouts.initialization),
        "heartbeat_timeout_seconds": int(timeouts.heartbeat),
        "shutdown_timeout_seconds": int(timeouts.shutdown),
        "local_device_ids": local_device_ids,
    }
    if any(given) and not all(given):
        raise UsageError(
            "give all of --coordinator_address, --num_processes and --process_id, or none of them "
            "(to auto-detect a TPU pod, SLURM or Open MPI job)."
        )
    if all(given):
        check_address(coordinator_address)
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise UsageError(
                f"process_id must be in [0, num_processes); got process_id={process_id}, "
                f"num_processes={num_processes}."
            )
        if num_processes == 1:
            return "single"
        jax.distributed.initialize(coordinator_address, num_processes, process_id, **kwargs)
        return "explicit"
    cluster = detected_cluster()
    if cluster is None:
        return "single"
    jax.distributed.initialize(**kwargs)
    return f"auto:{cluster}"


def check_address(address: str) -> None:
    """Raises UsageError unless ``address`` reads ``host:port`` with a port in 1..65535."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(
            f"--coordinator_address must be host:port of process 0, e.g. 10.0.0.1:1234; got {address!r}."
        )


def _preemption_service() -> bool:
    """Whether this multi-process job runs JAX's preemption service (on unless turned off at start-up)."""
    return bool(jax.config.jax_enable_preemption_service)


class PreemptionWatch:
    """Says at which step boundary to stop after a SIGTERM, the same on every process.

    With several processes it uses JAX's preemption service
    (``multihost_utils.reached_preemption_sync_point``), which catches SIGTERM itself and
    agrees on a step with the other processes; :meth:`should_stop` must then be called
    after every step on every process. With one process a Python SIGTERM handler sets a
    flag (only while the watch is entered, and only from the main thread). A watch
    that is not ``enabled`` changes nothing and never stops.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._flag = threading.Event()
        self._previous: Any = None
        self._installed = False
        self._multi = False

    def __enter__(self) -> PreemptionWatch:
        self._multi = self.enabled and jax.distributed.is_initialized()
        if self._multi and not _preemption_service():
            _log.warning("jax_enable_preemption_service is off: SIGTERM will stop this job without a checkpoint.")
            self.enabled = self._multi = False
        if self.enabled and not self._multi and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def _on_sigterm(self, signum, frame) -> None:
        del signum, frame
        _log.warning("SIGTERM: finishing the current step, then saving a checkpoint.")
        self._flag.set()

    def should_stop(self, step: int) -> bool:
        """Whether to save and stop after step ``step`` (0-based within this run)."""
        if not self.enabled:
            return False
        if self._multi:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self._flag.is_set()
