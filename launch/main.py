r"""Runs one sharded_scan job from a config: ``python -m launch.main``.

    python -m launch.main --config=configs/gram.py:quick --workdir=/tmp/gram \
        --config.microbatch=64 --jax_num_cpu_devices=8

Writes ``WORKDIR/result.npz`` (the result's named arrays) and ``WORKDIR/summary.json``,
checkpoints under ``WORKDIR/checkpoints``; running the same command again resumes from
the latest checkpoint. Multi-host: pass ``--coordinator_address``, ``--num_processes``
and ``--process_id`` on every process, or none of them inside a TPU pod / SLURM / Open
MPI job (detected). Exit status: 0 done or preempted (saved; rerun to resume), 2 a
usage error (one line on stderr, nothing computed or written).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

import jax
import numpy as np
from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from launch.data import make_combiner, make_source, run_options
from sharded_scan import distributed
from sharded_scan.checkpoint import CheckpointOptions, check_writable
from sharded_scan.engine import Progress, RunReport, run_with_report
from sharded_scan.errors import UsageError
from sharded_scan.watchdog import EXIT_PEER_LOST, RESUME_HINT, abort, is_peer_lost

jax.config.config_with_absl()

_CONFIG = config_flags.DEFINE_config_file("config", None, "Job config: configs/NAME.py[:ARG].", lock_config=True)
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

EXIT_USAGE = 2


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


def field_name(e: BaseException) -> str:
    return repr(str(e.args[0] if e.args else e).strip("\"'"))


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing that reports a bad flag or config override as one line."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        fail(one_line(e))
    except (KeyError, AttributeError) as e:  # a locked config refuses an unknown field
        fail(f"bad --config override: {field_name(e)} is not a field of this config; check the spelling.")
    except (TypeError, ValueError, OSError) as e:
        fail(f"bad --config: {one_line(e)}")
    return []


def load_config() -> Any:
    """The parsed ``--config`` (loaded lazily by ml_collections), or one line and exit."""
    try:
        config = _CONFIG.value
        if config is not None:
            config.keys()  # a config file that failed to load raises only when first used
    except KeyError as e:
        fail(f"bad --config override: {field_name(e)} is not a field of this config; check the spelling.")
    except Exception as e:  # noqa: BLE001 - whatever the config file raises is a usage error here
        fail(f"bad --config: {one_line(e)}")
    if config is None:
        fail("--config is required, e.g. --config=configs/gram.py:quick.")
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
        rate = rows / seconds if rows > 0 and seconds > 0 else float("nan")
        eta = (p.num_rows - p.rows_done) / rate
        logging.info(
            "step %d/%d  rows %d/%d (%.1f%%)  %.3g rows/s  ETA %s",
            p.step, p.total_steps, p.rows_done, p.num_rows, 100.0 * p.rows_done / p.num_rows, rate,
            time.strftime("%H:%M:%S", time.gmtime(eta)) if np.isfinite(eta) else "?",
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


def write_outputs(workdir: str, result: Any, record: dict[str, Any]) -> None:
    """Writes result.npz and summary.json atomically (temp file, then rename)."""
    tmp = os.path.join(workdir, "result.tmp.npz")
    np.savez(tmp, **named_arrays(result))
    os.replace(tmp, os.path.join(workdir, "result.npz"))
    tmp = os.path.join(workdir, "summary.json.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2, default=repr)
    os.replace(tmp, os.path.join(workdir, "summary.json"))


def run_job(
    config: Any, workdir: str, started_as: str = "single", step_timeout: float | None = None
) -> tuple[Any, dict[str, Any]]:
    """Runs the job ``config`` describes with checkpoints in ``workdir``; writes the outputs.

    Returns:
      ``(result, summary)``.

    Raises:
      UsageError: a bad config, data, or a checkpoint of another job.
      sharded_scan.Preempted: SIGTERM arrived and a checkpoint was saved.
    """
    check_writable(workdir)
    combiner = make_combiner(config.combiner)
    source = make_source(config.data)
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create the workdir {workdir}: {e.strerror}; pick another path.") from None
    ck = config.checkpoint
    checkpoint = None
    if ck.enabled:
        checkpoint = CheckpointOptions(
            os.path.join(workdir, "checkpoints"), every_steps=ck.every_steps, every_seconds=ck.every_seconds,
            keep=ck.keep,
        )
    options = run_options(
        config, checkpoint=checkpoint, progress=ProgressLog(config.log_every_seconds), step_timeout=step_timeout
    )
    result, report = run_with_report(combiner, source, options)
    record = summary(report, source, config, started_as)
    if jax.process_index() == 0:
        write_outputs(workdir, result, record)
    return result, record


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        fail(f"unexpected arguments {argv[1:]}; every option is a --flag.")
    config = load_config()
    if not _WORKDIR.value:
        fail("--workdir is required: where result.npz, summary.json and checkpoints/ go.")
    workdir = os.path.abspath(_WORKDIR.value)
    if config.get("x64", False):
        jax.config.update("jax_enable_x64", True)  # before anything touches a backend
    try:
        check_writable(workdir)
        started_as = distributed.initialize(
            _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
            timeouts=distributed.Timeouts(_INIT_TIMEOUT.value, _HEARTBEAT_TIMEOUT.value, _SHUTDOWN_TIMEOUT.value),
        )
        logging.info(
            "process %d of %d (%s), %d devices: %s", jax.process_index(), jax.process_count(), started_as,
            jax.device_count(), jax.devices()[0].platform,
        )
        _, record = run_job(config, workdir, started_as, _STEP_TIMEOUT.value or None)
    except UsageError as e:
        fail(str(e))
    except distributed.Preempted as e:
        print(str(e), flush=True)
        sys.exit(0)
    except Exception as e:
        if jax.process_count() > 1 and is_peer_lost(e):  # one line, and no shutdown barrier to abort in
            abort(f"process {jax.process_index()} of {jax.process_count()} lost a peer ({one_line(e)[:160]}); "
                  f"{RESUME_HINT}.", EXIT_PEER_LOST)
        raise
    if jax.process_index() == 0:
        logging.info(
            "done: %d rows in %.2f s (%.3g rows/s) on %d devices; wrote %s",
            record["rows"], record["seconds"], record["rows_per_second"], record["devices"],
            os.path.join(workdir, "result.npz"),
        )


class _QuietLibraries(logging.Filter):
    """Drops orbax's INFO chatter (every save logs a dozen lines); keeps its warnings."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or "/orbax/" not in record.pathname


def cli() -> None:
    absl_logging.set_verbosity(absl_logging.INFO)
    absl_logging.get_absl_handler().addFilter(_QuietLibraries())
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no TPU backend" noise
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    cli()
