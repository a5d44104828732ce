r"""Runs one sharded_scan job from a config: ``python -m launch.main``.

    python -m launch.main --config=configs/gram.py:quick --workdir=/tmp/gram \
        --config.microbatch=64 --jax_num_cpu_devices=8

Writes ``WORKDIR/result.npz`` (the result's named arrays) and ``WORKDIR/summary.json``,
checkpoints under ``WORKDIR/checkpoints``; running the same command again resumes from
the latest checkpoint (or, when the job finished, says "already done", also from a
read-only workdir). One job at a time holds the workdir (``WORKDIR/lock.json``).
Multi-host: pass ``--coordinator_address``, ``--num_processes`` and ``--process_id`` on
every process, or none of them inside a TPU pod / SLURM / Open MPI job (detected).
Exit status: 0 done, or preempted / interrupted (saved; rerun to resume), 2 a usage
error (one line on stderr, nothing computed or written), 3 stalled, 4 a peer was lost,
5 a storage fault (one line; the last checkpoint is intact).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import time
from typing import Any

import jax
import numpy as np
from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from launch.config_args import merge_extra, shipped_configs, split_args
from launch.data import make_combiner, make_source, run_options
from launch.metrics import MetricsWriter, ProfileWindow, combine, parse_steps, tensorboardx_installed
from sharded_scan import distributed
from sharded_scan.checkpoint import Checkpointer, CheckpointOptions
from sharded_scan.digest import json_digest
from sharded_scan.engine import Progress, RunReport, run_program
from sharded_scan.errors import StorageError, UsageError
from sharded_scan.lease import Lease
from sharded_scan.paths import as_path, where
from sharded_scan.program import build_program
from sharded_scan.storage import check_writable, storage_error, storage_reason
from sharded_scan.watchdog import EXIT_PEER_LOST, EXIT_STORAGE, RESUME_HINT, abort, is_peer_lost

jax.config.config_with_absl()

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Job config: a shipped one by name (gram, ridge:quick; --list_configs) or a file PATH.py[:ARG].",
    lock_config=True,
)
_LIST_CONFIGS = flags.DEFINE_bool("list_configs", False, "Print the shipped configs, one a line, and exit.")
_PRINT_CONFIG = flags.DEFINE_bool("print_config", False, "Print the job's config after the overrides, and exit.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where result.npz, summary.json and checkpoints/ go.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job (multi-process).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index (multi-process).")
_INIT_TIMEOUT = flags.DEFINE_integer(
    "initialization_timeout", distributed.DEFAULT_INITIALIZATION_TIMEOUT,
    "Seconds to wait for every process to join jax.distributed.",
)
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
    "heartbeat_timeout", distributed.DEFAULT_HEARTBEAT_TIMEOUT,
    "Seconds without a heartbeat after which a process is declared dead and the job stops.",
)
_SHUTDOWN_TIMEOUT = flags.DEFINE_integer(
    "shutdown_timeout", distributed.DEFAULT_SHUTDOWN_TIMEOUT,
    "Seconds a finishing process waits for the others at shutdown.",
)
_STEP_TIMEOUT = flags.DEFINE_float(
    "step_timeout", 900.0,
    "Seconds without a finished step after which a process stops with one line (a stuck peer); 0 for off.",
)
_TENSORBOARD = flags.DEFINE_enum(
    "tensorboard", "auto", ["auto", "on", "off"],
    "TensorBoard scalars (rows/s, bytes/s, step and checkpoint seconds, progress) in WORKDIR/tensorboard from "
    "process 0: auto writes them when tensorboardX is installed.",
)
_PROFILE_STEPS = flags.DEFINE_string(
    "profile_steps", None, "A:B traces steps A..B (from 1) with jax.profiler into WORKDIR/profile (every process).",
)
_FORCE_UNLOCK = flags.DEFINE_bool(
    "force_unlock", False,
    "Take the workdir even though its lock file names a running job (only when you know that job is gone).",
)

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # Ctrl-C before the run could save (128 + SIGINT)
FORCE_HINT = "pass --force_unlock"
_EXTRA: dict[str, dict[str, Any]] = {}  # the --config.combiner.kwargs.NAME=VALUE overrides (launch.config_args)
OUTPUTS = ("result.npz", "summary.json")


def fail(message: str) -> None:
    """Prints one line and exits with the usage status."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USAGE)


def one_line(e: BaseException) -> str:
    """An exception's message (and its cause's) folded into one line."""
    parts = [str(e)] + ([str(e.__cause__)] if e.__cause__ is not None else [])
    lines = [line.strip() for part in parts for line in part.splitlines() if line.strip()]
    if any(line.startswith("Traceback") for line in lines):  # keep the heading and the error itself
        lines = [lines[0], lines[-1]] if not lines[0].startswith("Traceback") else [lines[-1]]
    return " ".join(dict.fromkeys(lines)) or type(e).__name__


def not_a_field(e: BaseException) -> str:
    """One readable line for an override of a field the config does not have."""
    inner = e.args[0] if e.args and isinstance(e.args[0], BaseException) else e
    text = str(inner.args[0] if inner.args else inner)
    name = re.search(r'Key "([^"]+)"', text) or re.match(r"""\W*([\w.]+)""", text)
    suggestion = re.search(r'Did you mean "([^"]+)"', text)
    hint = (f'; did you mean "{suggestion.group(1)}"?' if suggestion
            else "; check the spelling (--print_config lists them).")
    return f"bad --config override: {(name.group(1) if name else text)!r} is not a field of this config{hint}"


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing that reports a bad flag or config override as one line.

    ``--config`` may name a shipped config from anywhere, and ``--config.combiner.kwargs.NAME``
    any argument of the combiner (:mod:`launch.config_args`).
    """
    global _EXTRA
    try:
        argv, _EXTRA = split_args(argv)
        sys.argv[1:] = argv[1:]  # config_flags finds the --config.FIELD overrides in sys.argv
        return flags.FLAGS(argv)
    except UsageError as e:
        fail(str(e))
    except flags.Error as e:
        fail(one_line(e))
    except (KeyError, AttributeError) as e:  # a locked config refuses an unknown field
        fail(not_a_field(e))
    except (TypeError, ValueError, OSError) as e:
        fail(f"bad --config: {one_line(e)}")
    return []


def load_config() -> Any:
    """The parsed ``--config`` (loaded lazily by ml_collections), or one line and exit."""
    try:
        config = _CONFIG.value
        if config is not None:
            config.keys()  # a config file that failed to load raises only when first used
    except (KeyError, AttributeError) as e:
        fail(not_a_field(e))
    except Exception as e:  # noqa: BLE001 - whatever the config file raises is a usage error here
        fail(f"bad --config: {one_line(e)}")
    if config is None:
        fail("--config is required, e.g. --config=gram:quick (--list_configs shows the shipped ones).")
    merge_extra(config, _EXTRA)
    return config


class ProgressLog:
    """Logs step/total, rows/s and ETA about every ``every_seconds`` on process 0."""

    def __init__(self, every_seconds: float):
        self.every_seconds = every_seconds
        self._next = every_seconds
        self._first: Progress | None = None

    def __call__(self, p: Progress) -> None:
        if self._first is None:
            self._first = p  # rates count from here: the first step includes compilation
        if jax.process_index() != 0 or (p.seconds < self._next and p.step < p.total_steps):
            return
        self._next = p.seconds + self.every_seconds
        rows, seconds = p.rows_done - self._first.rows_done, p.seconds - self._first.seconds
        left = p.num_rows - p.rows_done
        if rows > 0 and seconds > 0:
            rate, eta = f"{rows / seconds:.3g} rows/s", time.strftime("%H:%M:%S", time.gmtime(left / (rows / seconds)))
        else:  # only the first step so far: its time is mostly compiling
            rate, eta = "rows/s from the second step on", "00:00:00" if left == 0 else "?"
        logging.info(
            "step %d/%d  rows %d/%d (%.1f%%)  %s  ETA %s",
            p.step, p.total_steps, p.rows_done, p.num_rows, 100.0 * p.rows_done / p.num_rows, rate, eta,
        )


def named_arrays(result: Any) -> dict[str, np.ndarray]:
    """The result's arrays by name: NamedTuple fields, dict keys, or ``result``."""
    if isinstance(result, np.ndarray | np.generic):
        return {"result": np.asarray(result)}
    if hasattr(result, "_asdict"):
        items = result._asdict().items()
    elif isinstance(result, dict):
        items = result.items()
    else:
        leaves = jax.tree_util.tree_leaves_with_path(result)
        items = [(jax.tree_util.keystr(path).strip("[]'.") or "result", leaf) for path, leaf in leaves]
    out: dict[str, np.ndarray] = {}
    for name, value in items:
        inner = named_arrays(value)
        for key, array in inner.items():
            out[str(name) if key == "result" else f"{name}.{key}"] = array
    return out


def row_bytes(source: Any) -> int:
    return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(source.spec))


def summary(report: RunReport, source: Any, config: Any, started_as: str) -> dict[str, Any]:
    """The ``summary.json`` record of one run."""
    seconds = max(report.seconds, 1e-9)
    return {
        "rows": report.rows,
        "rows_this_run": report.rows_this_run,
        "seconds": report.seconds,
        "rows_per_second": report.rows_this_run / seconds,
        "bytes_per_second": report.rows_this_run * row_bytes(source) / seconds,
        "steps": report.steps,
        "devices": report.devices,
        "processes": report.processes,
        "mesh": report.mesh,
        "distributed": started_as,
        "resumed_from_step": report.resumed_from_step,
        "resumed_from_cursor": report.resumed_from_cursor,
        "checkpoints_written": report.checkpoints_written,
        "merge_bytes": report.merge_bytes,
        "passes": report.passes,
        "config": json.loads(json.dumps(config.to_dict(), default=repr)),
    }


def write_outputs(workdir: str, result: Any, record: dict[str, Any], intact: str) -> None:
    """Writes result.npz and summary.json atomically (temp file, then rename; any epath workdir).

    Raises:
      StorageError: the workdir refused a write; ``intact`` says what is still there.
    """
    arrays = named_arrays(result)
    root, written = as_path(workdir), []
    try:
        root.mkdir(parents=True, exist_ok=True)
        for name, write in (("result.npz", lambda f: np.savez(f, **arrays)),
                            ("summary.json", lambda f: f.write(json.dumps(record, indent=2, default=repr).encode()))):
            tmp = root / f"{name}.tmp"
            written.append(tmp)
            with tmp.open("wb") as f:
                write(f)
            tmp.replace(root / name)
    except OSError as e:
        code = storage_reason(e)
        if code is None:
            raise
        needed = sum(a.nbytes for a in arrays.values()) + (64 << 10)
        raise storage_error(f"write {root / OUTPUTS[0]}", code, intact, needed) from None
    finally:
        for tmp in written:
            if tmp.exists():
                tmp.unlink()


def finished(workdir: str, job: str) -> dict[str, Any] | None:
    """The summary of this job when the workdir holds its result, else None (reads only)."""
    root = as_path(workdir)
    try:
        record = json.loads((root / OUTPUTS[1]).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("job") != job:
        return None
    return record if (root / OUTPUTS[0]).is_file() else None


def load_result(workdir: str) -> dict[str, np.ndarray]:
    with (as_path(workdir) / OUTPUTS[0]).open("rb") as f, np.load(f) as arrays:
        return {k: arrays[k] for k in arrays.files}


def workdir_lease(workdir: str, job: str, force: bool) -> Lease | None:
    """The workdir's lease, taken by process 0 for the job; every process gets its answer.

    Raises:
      UsageError: another job holds the workdir.
    """
    lease, problem = None, None
    if jax.process_index() == 0:
        lease = Lease(workdir, job, force, FORCE_HINT)
        try:
            lease.acquire()
        except UsageError as e:
            lease, problem = None, str(e)
    problem = distributed.gather_json(problem)[0]
    if problem is not None:
        raise UsageError(problem)
    return lease


def run_job(
    config: Any, workdir: str, started_as: str = "single", step_timeout: float | None = None,
    force_unlock: bool = False, tensorboard: bool = False, profile_steps: tuple[int, int] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Runs the job ``config`` describes with checkpoints in ``workdir``; writes the outputs.

    A job whose result is already in ``workdir`` is not run again: its result and
    summary are returned (this reads only, so it works on a read-only workdir too).

    ``tensorboard`` writes TensorBoard scalars to ``workdir/tensorboard``; ``profile_steps``
    ``(A, B)`` traces steps A..B into ``workdir/profile``.

    Returns:
      ``(result, summary)``.

    Raises:
      UsageError: a bad config, data, another job holding the workdir, or a
        checkpoint of another job or of changed data.
      StorageError: a checkpoint or the result could not be written.
      sharded_scan.Preempted: SIGTERM or SIGINT arrived and a checkpoint was saved.
    """
    combiner = make_combiner(config.combiner)
    source = make_source(config.data)
    root = as_path(workdir)  # an unknown URL scheme is one line here, before any compute
    ck = config.checkpoint
    checkpoint = None
    if ck.enabled:
        checkpoint = Checkpointer(CheckpointOptions(
            str(root / "checkpoints"), every_steps=ck.every_steps, every_seconds=ck.every_seconds,
            keep=ck.keep, per_job=ck.per_job, ignore_changed_data=ck.ignore_changed_data, force_unlock=force_unlock,
        ), force_hint=FORCE_HINT)
    progress = combine(
        ProgressLog(config.log_every_seconds),
        MetricsWriter(str(root / "tensorboard"), row_bytes=row_bytes(source)) if tensorboard else None,
        ProfileWindow(*profile_steps, str(root / "profile")) if profile_steps else None,
    )
    options = run_options(config, checkpoint=checkpoint, progress=progress, step_timeout=step_timeout)
    program = build_program(combiner, source, options)
    job = json_digest(program.fingerprint)
    done = distributed.gather_json(finished(workdir, job))[0]
    if done is not None:
        logging.info("already done: %s holds this job's result (%s rows); nothing to do (a new --workdir runs it "
                     "again).", os.path.join(workdir, OUTPUTS[0]), done.get("rows"))
        return load_result(workdir), {**done, "already_done": True}
    check_writable(workdir)
    lease = workdir_lease(workdir, job, force_unlock)
    try:
        with progress:  # flushes the scalars and stops a trace, also when the run fails
            result, report = run_program(program, source)
        record = {**summary(report, source, config, started_as), "job": job}
        if jax.process_index() == 0:
            intact = (f"the finished job's checkpoint in {os.path.join(workdir, 'checkpoints')} is intact"
                      if ck.enabled else "nothing else was changed (checkpoints are off: a rerun starts afresh)")
            write_outputs(workdir, result, record, intact)
    finally:
        if lease is not None:
            lease.release()
    return result, record


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        fail(f"unexpected arguments {argv[1:]}; every option is a --flag.")
    if _LIST_CONFIGS.value:
        for name, doc in shipped_configs().items():
            print(f"{name:14s} {doc}")
        return
    config = load_config()
    if _PRINT_CONFIG.value:
        print(config, end="")
        return
    tensorboard = _TENSORBOARD.value == "on" or (_TENSORBOARD.value == "auto" and tensorboardx_installed())
    try:
        profile_steps = parse_steps(_PROFILE_STEPS.value) if _PROFILE_STEPS.value else None
    except UsageError as e:
        fail(f"--profile_steps: {e}")
    if not _WORKDIR.value:
        fail("--workdir is required: where result.npz, summary.json and checkpoints/ go.")
    workdir = where(_WORKDIR.value)  # absolute if local; a URL (gs://...) as given
    if config.get("x64", False):
        jax.config.update("jax_enable_x64", True)  # before anything touches a backend
    try:
        started_as = distributed.initialize(
            _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
            timeouts=distributed.Timeouts(_INIT_TIMEOUT.value, _HEARTBEAT_TIMEOUT.value, _SHUTDOWN_TIMEOUT.value),
        )
        logging.info(
            "process %d of %d (%s), %d devices: %s", jax.process_index(), jax.process_count(), started_as,
            jax.device_count(), jax.devices()[0].platform,
        )
        if jax.process_count() > 1:
            # JAX ends a process whose coordinator died with a one-line fatal log and abort();
            # absl's faulthandler would add every Python thread's stack to it.
            signal.signal(signal.SIGABRT, signal.SIG_DFL)
        _, record = run_job(config, workdir, started_as, _STEP_TIMEOUT.value or None, _FORCE_UNLOCK.value,
                            tensorboard, profile_steps)
    except UsageError as e:
        fail(str(e))
    except StorageError as e:  # one line; skip interpreter shutdown, where orbax's threads would add tracebacks
        abort(str(e) if jax.process_count() == 1 else f"process {jax.process_index()}: {e}", EXIT_STORAGE)
    except distributed.Preempted as e:
        print(str(e), flush=True)
        sys.exit(0)
    except KeyboardInterrupt:
        abort(f"interrupted before the run could save; {RESUME_HINT}.", EXIT_INTERRUPTED)
    except Exception as e:
        if jax.process_count() > 1 and is_peer_lost(e):  # one line, and no shutdown barrier to abort in
            abort(f"process {jax.process_index()} of {jax.process_count()} lost a peer ({one_line(e)[:160]}); "
                  f"{RESUME_HINT}.", EXIT_PEER_LOST)
        raise
    if jax.process_index() == 0 and not record.get("already_done"):
        logging.info(
            "done: %d rows in %.2f s (%.3g rows/s) on %d devices; wrote %s",
            record["rows"], record["seconds"], record["rows_per_second"], record["devices"],
            os.path.join(workdir, "result.npz"),
        )


class _QuietLibraries(logging.Filter):
    """Drops orbax's INFO chatter (every save logs a dozen lines); keeps its warnings and
    errors, without their tracebacks (a failed save ends in one ``error:`` line of ours)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "/orbax/" not in record.pathname:
            return True
        record.exc_info, record.exc_text = None, None
        return record.levelno >= logging.WARNING


def _quiet_unraisable(hook: Any) -> Any:
    """Drops what tensorstore prints when a write fails mid-save: callbacks into orbax's closed
    event loops (``RuntimeError: Event loop is closed``); the save's failure is reported once."""

    def unraisable(info: Any) -> None:
        if not (isinstance(info.exc_value, RuntimeError) and "Event loop is closed" in str(info.exc_value)):
            hook(info)

    return unraisable


def cli() -> None:
    sys.unraisablehook = _quiet_unraisable(sys.unraisablehook)
    absl_logging.set_verbosity(absl_logging.INFO)
    absl_logging.get_absl_handler().addFilter(_QuietLibraries())
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no TPU backend" noise
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    cli()
