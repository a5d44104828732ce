"""Multi-process start-up (``jax.distributed``) and preemption handling.

:func:`initialize` starts JAX's multi-controller runtime explicitly (coordinator
address, process count and id), or lets ``jax.distributed.initialize()`` detect a
cluster (Cloud TPU pod, SLURM, Open MPI, Kubernetes), or stays single-process.

:class:`PreemptionWatch` turns SIGTERM and Ctrl-C into a clean stop at a step boundary
that every process agrees on (:func:`any_process`); the engine then saves a checkpoint
and raises :class:`Preempted`. :func:`agree` checks that every process runs the same
job before any compute; :func:`all_processes`, :func:`gather_json` and :func:`barrier`
are the other small agreements the checkpointer needs.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import os
import signal
import threading
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils

from sharded_scan.digest import json_digest
from sharded_scan.errors import UsageError
from sharded_scan.identity import processes_difference
from sharded_scan.watchdog import PeerWatch

_log = logging.getLogger(__name__)

DEFAULT_INITIALIZATION_TIMEOUT = 300
DEFAULT_HEARTBEAT_TIMEOUT = 100
DEFAULT_SHUTDOWN_TIMEOUT = 300


class Preempted(Exception):  # noqa: N818 - an outcome, not a failure
    """The run stopped early on SIGTERM or SIGINT after saving a checkpoint at ``cursor``."""

    def __init__(self, cursor: int, num_rows: int, directory: str, signal_name: str = "SIGTERM"):
        self.cursor, self.num_rows, self.directory, self.signal_name = cursor, num_rows, directory, signal_name
        how = "preempted" if signal_name == "SIGTERM" else f"interrupted ({signal_name})"
        super().__init__(
            f"{how}: saved a checkpoint at row {cursor} of {num_rows} in {directory}; "
            "rerun the same command to resume."
        )


class Terminated(BaseException):
    """SIGTERM arrived before the run's first step (nothing was computed, so nothing needed
    saving), or while a run without checkpoints folded (``saved`` False: nothing was saved).

    Raised by :func:`stop_on_sigterm`'s handler (a ``BaseException``, like
    ``KeyboardInterrupt``: no ``except Exception`` on the way takes it for a failure); the
    CLI prints it on stdout and exits 0, as for :class:`Preempted` (143 when not ``saved``).
    """

    def __init__(self, saved: bool = True):
        self.saved = saved
        super().__init__(
            "preempted (SIGTERM) before the first step: nothing was computed yet, so nothing needed saving; rerun the "
            "same command to resume." if saved else
            "terminated (SIGTERM) while folding with checkpoints off: nothing was saved; rerun the same command to "
            "start again."
        )


class _Stop:
    """The process's SIGTERM state outside a run's steps (see :func:`stop_on_sigterm`)."""

    pending = False               # a SIGTERM deferred to the processes' next agreement (multi-process start-up)
    finishing: str | None = None  # set while the run saves and stops, or after its last step: a SIGTERM only logs it
    unsaved = False               # a run without checkpoints folds: a SIGTERM ends it at once


def stop_on_sigterm(already: bool = False) -> None:
    """Makes SIGTERM outside a run's steps end the job with one line (the launcher calls it first).

    Inside a run :class:`PreemptionWatch` saves at the next step boundary. Outside it, a
    SIGTERM used to end the process with status 143 and nothing printed; now:

    - before the first step, in one process: :class:`Terminated` at once;
    - before the first step, with ``jax.distributed`` running: deferred to the processes'
      next agreement on the job (:func:`agree`), where all of them raise
      :class:`Terminated` together (one process leaving alone would leave the others
      waiting in a collective);
    - while the run saves and stops, or after its last step (the final merge, the
      result's write): logged, and the job goes on to its end (its final checkpoint is
      already saved, and the result is moments away);
    - while a run without checkpoints folds: :class:`Terminated` (nothing saved; the CLI
      exits 143).

    Args:
      already: a SIGTERM arrived before this was called (the launcher notes one while
        it imports): raise :class:`Terminated` now.
    """
    _Stop.pending, _Stop.finishing = False, None
    signal.signal(signal.SIGTERM, _on_sigterm)
    if already:
        raise Terminated()


def _on_sigterm(signum, frame) -> None:
    del signum, frame
    if _Stop.finishing is not None:
        _log.warning("SIGTERM: already %s; it goes on.", _Stop.finishing)
    elif _Stop.unsaved:
        raise Terminated(saved=False)
    elif jax.distributed.is_initialized():
        _Stop.pending = True
        _log.warning("SIGTERM: every process stops together before the first step, when they next agree.")
    else:
        raise Terminated()


def finishing(what: str) -> None:
    """From now on a SIGTERM outside a run's steps only logs ``what`` (e.g. "past the last step: ...")."""
    _Stop.finishing = what


class Timeouts(NamedTuple):
    """``jax.distributed`` timeouts, in seconds."""

    initialization: int = DEFAULT_INITIALIZATION_TIMEOUT
    heartbeat: int = DEFAULT_HEARTBEAT_TIMEOUT
    shutdown: int = DEFAULT_SHUTDOWN_TIMEOUT


# Public environment variables that name the launcher, in the order JAX's detection tries them
# (Open MPI before SLURM: mpirun inside a SLURM allocation is Open MPI's job). Only a label:
# jax.distributed.initialize() itself decides whether there is a cluster.
CLUSTER_HINTS = (
    ("ompi", ("OMPI_MCA_orte_hnp_uri",)),
    ("slurm", ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")),
    ("tpu", ("TPU_WORKER_HOSTNAMES",)),
    ("tpu", ("TPU_PROCESS_ADDRESSES",)),
    ("tpu", ("MEGASCALE_COORDINATOR_ADDRESS",)),
    ("k8s", ("KUBERNETES_SERVICE_HOST",)),  # JAX asks the API server only with `kubernetes` installed
)
# What jax.distributed.initialize() raises when it finds no cluster and was given no address
# (jax/_src/distributed.py; tests/test_launch_recipes.py pins it), and when a backend already runs.
_NO_CLUSTER = "coordinator_address should be defined."
_BACKEND_RUNNING = "must be called before any JAX calls"


def cluster_hint(environ: Any = None) -> str | None:
    """The launcher that public environment variables name (``"slurm"``, ``"ompi"``, ...), or None.

    A label for logs: whether JAX finds a cluster is for ``jax.distributed.initialize()``
    to say (a Cloud TPU VM, for one, is found through its metadata server, not the
    environment).
    """
    environ = os.environ if environ is None else environ
    for name, needed in CLUSTER_HINTS:
        if all(v in environ for v in needed):
            if name == "k8s" and importlib.util.find_spec("kubernetes") is None:
                continue
            return name
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

    Call it first, before anything touches a JAX backend. With none of the three
    explicit settings, ``jax.distributed.initialize()`` detects the cluster itself
    (Cloud TPU, SLURM, Open MPI, Kubernetes); where it finds none, this is one process.

    Args:
      coordinator_address: ``host:port`` of process 0's coordinator. Given together
        with ``num_processes`` and ``process_id``, they start the runtime explicitly.
      num_processes: the number of processes of the job.
      process_id: this process's index, ``0 <= process_id < num_processes``.
      timeouts: initialization, heartbeat and shutdown timeouts in seconds.
      local_device_ids: the local devices this process uses (GPU clusters with one
        process per GPU); None for JAX's choice (on SLURM and Open MPI GPUs: the
        device of the local rank).

    Returns:
      How it started: ``"explicit"``; ``"auto:<hint>"`` when JAX detected a cluster,
      ``<hint>`` naming it from public environment variables (``slurm``, ``ompi``,
      ``tpu``, ``k8s``; ``cluster`` when none names it); or ``"single"`` (one process,
      ``jax.distributed`` not started).

    Raises:
      UsageError: only some of the three explicit settings are given, or they are
        out of range; or a JAX backend already runs inside a cluster.
      UsageError: JAX refused a half-set environment (``JAX_COORDINATOR_ADDRESS`` alone).
      RuntimeError: JAX's own, when it cannot start (a cluster it detects but cannot
        join, an initialization timeout).
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
        _start_runtime(coordinator_address, num_processes, process_id, **kwargs)
        return "explicit"
    hint = cluster_hint()
    try:
        _start_runtime(**kwargs)
    except ValueError as e:  # raised before JAX's state changes: jax.distributed stays unstarted
        if str(e) != _NO_CLUSTER:  # a half-set environment, e.g. JAX_COORDINATOR_ADDRESS alone
            raise UsageError(
                f"jax.distributed cannot start from this environment ({' '.join(str(e).split())}); set "
                "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID together, or pass "
                "--coordinator_address, --num_processes and --process_id."
            ) from None
        _log.debug("jax.distributed.initialize() found no cluster: one process")
        return "single"
    except RuntimeError as e:
        if _BACKEND_RUNNING not in str(e):
            raise
        if hint is not None:
            raise UsageError(
                f"a JAX backend already runs, so this {hint} job cannot start jax.distributed; call "
                "sharded_scan.distributed.initialize() before anything touches JAX (jax.devices(), an array)."
            ) from None
        return "single"  # too late to ask JAX, and nothing names a cluster
    return f"auto:{hint or 'cluster'}"


def _start_runtime(*args: Any, **kwargs: Any) -> None:
    """``jax.distributed.initialize`` without JAX's preemption service, with :func:`watch_peers`.

    The engine catches SIGTERM itself (:class:`PreemptionWatch`) and agrees on the step
    after every step; the service's own SIGTERM handler and sync point are not needed.
    The setting is restored when the runtime did not start.
    """
    previous = jax.config.jax_enable_preemption_service
    jax.config.update("jax_enable_preemption_service", False)
    try:
        jax.distributed.initialize(*args, **kwargs)
    except BaseException:
        jax.config.update("jax_enable_preemption_service", previous)
        raise
    watch_peers(kwargs.get("heartbeat_timeout_seconds", DEFAULT_HEARTBEAT_TIMEOUT))


def watch_peers(heartbeat: float) -> PeerWatch | None:
    """Starts a :class:`~sharded_scan.watchdog.PeerWatch` (a peer silent for a third of ``heartbeat``
    seconds ends this process in one line, before JAX's heartbeat aborts it), stopped at exit.

    None when ``jax.distributed`` runs one process, or its client is not where JAX 0.10 keeps
    it (``jax._src.distributed.global_state.client``, as orbax reads it too: JAX has no public
    accessor); then JAX's heartbeat ends a job whose peer stopped (WORKSPACE.md).
    """
    state = getattr(getattr(getattr(jax, "_src", None), "distributed", None), "global_state", None)
    client = getattr(state, "client", None)
    if client is None or getattr(state, "num_processes", 1) == 1:  # not jax.process_count(): no backend yet
        return None
    peers = PeerWatch(client, state.process_id, state.num_processes, heartbeat).start()
    atexit.register(peers.stop)  # runs before JAX's own atexit shutdown (registered when jax was imported)
    return peers


def check_address(address: str) -> None:
    """Raises UsageError unless ``address`` reads ``host:port`` with a port in 1..65535."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(
            f"--coordinator_address must be host:port of process 0, e.g. 10.0.0.1:1234; got {address!r}."
        )


class PreemptionWatch:
    """Catches SIGTERM and SIGINT while a job runs, so that it can save and stop between steps.

    While entered (from the main thread) a SIGTERM or the first SIGINT only sets
    :attr:`signal_name`; the engine then agrees with every process
    (:func:`any_process`, once per step) and all of them save at the same step
    boundary and stop. A second SIGINT ends the process at once (the default action:
    nothing more is saved; the last checkpoint is intact). This replaces JAX's
    preemption service for the run, whose sync point can fall on a step a process has
    already passed under load (no save, the job runs on); afterwards SIGTERM and SIGINT
    have their previous Python handlers (the default for a SIGTERM JAX had caught). A
    watch that is not ``enabled`` changes nothing.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> PreemptionWatch:
        _Stop.finishing, _Stop.unsaved = None, not self.enabled  # a new run: a SIGTERM stops it again
        if self.enabled and threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        _Stop.unsaved = False
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def _on_signal(self, signum, frame) -> None:
        del frame
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C aborts at once
            _log.warning("SIGINT: saving a checkpoint after the current step, then stopping; "
                         "press Ctrl-C again to abort at once without saving.")
        elif self.signal_name is None:
            _log.warning("SIGTERM: saving a checkpoint after the current step, then stopping.")
        else:
            _log.warning("SIGTERM again: already saving a checkpoint after the current step, then stopping.")
        self.signal_name = self.signal_name or name
        finishing("saving a checkpoint and stopping")


def any_process(*flags: bool) -> tuple[bool, ...]:
    """Each flag OR-ed over every process (one small collective when there are several).

    Every process must call it at the same point with the same number of flags.
    """
    if jax.process_count() == 1:
        return tuple(bool(f) for f in flags)
    gathered = np.asarray(multihost_utils.process_allgather(np.asarray(flags, np.int32)))
    return tuple(bool(v) for v in gathered.reshape(-1, len(flags)).any(axis=0))


def all_processes(ok: bool) -> bool:
    """Whether ``ok`` holds on every process (every process must call it)."""
    return not any_process(not ok)[0]


def gather_json(value: Any) -> list[Any]:
    """``value`` (JSON) of every process, in process order, on every process."""
    if jax.process_count() == 1:
        return [value]
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.int32(len(data)))).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: len(data)] = data
    everyone = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
    return [json.loads(bytes(everyone[i, : lengths[i]]).decode()) for i in range(len(lengths))]


def agree(terms: dict[str, Any], what: str, fix: str, stop: bool = False) -> None:
    """Returns when every process passed the same ``terms`` (JSON); else raises on every process.

    Cheap: one small gather of the terms' digest (and of whether a process was told to
    stop); the terms themselves are gathered only when the digests differ, to name the
    field. Every process must call it at the same point.

    Args:
      terms, what, fix: what must be the same, its name and the fix, for the message.
      stop: this process caught a SIGTERM (a deferred one counts too, :func:`stop_on_sigterm`).

    Raises:
      UsageError: on every process, naming the first field that differs, its values and
        the processes that hold each: ``processes disagree on {what}: {field} differs
        (process 0: ..., process 1: ...); {fix}.``
      Terminated: some process was told to stop (on every process).
    """
    stop = stop or _Stop.pending
    if jax.process_count() == 1:
        if stop:
            raise Terminated()
        return
    answers = gather_json([json_digest(terms), stop])
    if len({digest for digest, _ in answers}) > 1:
        difference = processes_difference(gather_json(terms)) or "their digests differ"
        raise UsageError(f"processes disagree on {what}: {difference}; {fix}.")
    if any(stopped for _, stopped in answers):
        raise Terminated()


def barrier(name: str) -> None:
    """Waits until every process reached ``name`` (nothing with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
