r"""Runs one sharded_scan job from a config: ``python -m launch.main``. Intentionally kept short.

    python -m launch.main --config=gram:quick --workdir=/tmp/gram --config.microbatch=64

Flags and the config, then one library call, :func:`sharded_scan.run_in_workdir` (writes
``WORKDIR/result.npz``, ``result.json``, ``result.csv``, ``describe.json`` (:mod:`launch.outputs`),
``summary.json`` and ``checkpoints/``; resumes; or says "already done"),
then its exit status: 0 done or preempted (saved; rerun to resume), 2 a usage error (one
line), 3 stalled, 4 a peer was lost, 5 a storage fault (one line), 130 Ctrl-C before a save, 143 SIGTERM
with checkpoints off (one line: nothing saved).
``sharded-scan show WORKDIR`` (:mod:`launch.show`) prints a finished job's result as a table.
Multi-host: ``--coordinator_address``, ``--num_processes`` and ``--process_id`` on every
process, or none of them inside a TPU pod / SLURM / Open MPI job (detected).
"""

from __future__ import annotations

import contextlib
import signal

# ruff: noqa: E402 - as a program, SIGTERM is noted from here on, not left to end the process unseen (status 143,
# nothing printed) while JAX is imported; main() hands it to sharded_scan (distributed.stop_on_sigterm).
_EARLY_SIGTERM: list[int] = []


def _note_sigterm(signum, frame) -> None:
    _EARLY_SIGTERM.append(signum)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _note_sigterm)

import json
import logging
import sys
from collections.abc import Iterator
from typing import Any

import jax
from absl import app, flags
from ml_collections import config_flags

from launch.config_args import command_line_error, merge_extra, shipped_configs, split_args
from launch.data import make_combiner, make_source, run_options
from launch.help import flag_lines, help_text
from launch.logs import ProgressLog, set_up_logging
from launch.metrics import MetricsWriter, ProfileWindow, combine, parse_steps, tensorboardx_installed
from launch.outputs import result_files
from sharded_scan import distributed
from sharded_scan.checkpoint import CheckpointOptions
from sharded_scan.errors import UsageError
from sharded_scan.paths import as_path, where
from sharded_scan.workdir import EXIT_USAGE, exits, row_bytes, run_in_workdir

jax.config.config_with_absl()

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Job config: a shipped one by name (gram, ridge:quick; --list_configs) or a file PATH.py[:ARG].",
    lock_config=True)
_LIST_CONFIGS = flags.DEFINE_bool("list_configs", False, "Print the shipped configs, one a line, and exit.")
_PRINT_CONFIG = flags.DEFINE_bool("print_config", False, "Print the job's config after the overrides, and exit.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where result.npz, result.json, summary.json and checkpoints/ go.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job (multi-process).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index (multi-process).")
_INIT_TIMEOUT = flags.DEFINE_integer("initialization_timeout", distributed.DEFAULT_INITIALIZATION_TIMEOUT,
                                     "Seconds to wait for every process to join jax.distributed.")
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer("heartbeat_timeout", distributed.DEFAULT_HEARTBEAT_TIMEOUT,
                                          "Seconds without a heartbeat after which a process is declared dead.")
_SHUTDOWN_TIMEOUT = flags.DEFINE_integer("shutdown_timeout", distributed.DEFAULT_SHUTDOWN_TIMEOUT,
                                         "Seconds a finishing process waits for the others at shutdown.")
_STEP_TIMEOUT = flags.DEFINE_float("step_timeout", 900.0, "Seconds without a finished step after which a process "
                                   "stops with one line (a stuck peer); 0 for off.")
_TENSORBOARD = flags.DEFINE_enum("tensorboard", "auto", ["auto", "on", "off"], "TensorBoard scalars in "
                                 "WORKDIR/tensorboard from process 0; auto: when tensorboardX is installed.")
_PROFILE_STEPS = flags.DEFINE_string("profile_steps", None, "A:B traces steps A..B (from 1) with jax.profiler into "
                                     "WORKDIR/profile (every process).")
_FORCE_UNLOCK = flags.DEFINE_bool("force_unlock", False, "Take the workdir even though its lock file names a "
                                  "running job (only when you know that job is gone).")
_EXTRA: dict[str, dict[str, Any]] = {}  # the --config.combiner.kwargs.NAME=VALUE overrides (launch.config_args)
HELP = ("--help", "-help", "-h", "--helpshort", "-helpshort", "-?")  # ours; absl's --helpfull lists JAX's too


def fail(message: str) -> None:
    """Prints one line and exits with the usage status."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USAGE)


@contextlib.contextmanager
def cli_wording() -> Iterator[None]:
    """A UsageError leaves as its command-line line (``UsageError.cli``: ``--config.FIELD=V`` fixes, not Python's)."""
    try:
        yield
    except UsageError as e:
        e.args = (e.cli,)
        raise


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing that reports a bad flag or config override as one line."""
    global _EXTRA
    try:
        if any(arg in HELP for arg in argv[1:]):
            print_help([arg for arg in argv if arg not in HELP])
        argv, _EXTRA = split_args(argv)
        sys.argv[1:] = argv[1:]  # config_flags finds the --config.FIELD overrides in sys.argv
        return flags.FLAGS(argv)
    except (flags.Error, KeyError, AttributeError, TypeError, ValueError, OSError, SyntaxError) as e:
        fail(command_line_error(e))
    return []


def print_help(argv: list[str]) -> None:
    """Prints ``--help`` (the flags, and the fields of ``--config`` when one is given) and exits 0."""
    named = next((a.split("=", 1)[1] for a in argv if a.startswith(("--config=", "-config="))), "")
    if named:
        parse_flags(argv)  # a config that does not load is its one line and status 2
    holders = [v for v in globals().values() if isinstance(v, flags.FlagHolder)]
    print(help_text(flag_lines(holders), load_config() if named else None, named))
    sys.exit(0)


def load_config() -> Any:
    """The parsed ``--config`` (loaded lazily by ml_collections), or one line and exit."""
    try:
        config = _CONFIG.value
        if config is None:
            raise UsageError("--config is required, e.g. --config=gram:quick (--list_configs shows the shipped ones).")
        config.keys()  # a config file that failed to load raises only when first used
    except Exception as e:  # noqa: BLE001 - whatever the config file raises is a usage error here
        fail(command_line_error(e))
    merge_extra(config, _EXTRA)
    return config


def run_job(
    config: Any, workdir: str, started_as: str = "single", step_timeout: float | None = None,
    force_unlock: bool = False, tensorboard: bool = False, profile_steps: tuple[int, int] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """The job ``config`` describes, run in ``workdir`` (:func:`sharded_scan.run_in_workdir`), its result
    also as ``result.json`` (and ``result.csv`` for a per-column result, ``describe.json`` for ``Describe``:
    :mod:`launch.outputs`), each covered by ``summary.json``'s digests.

    ``tensorboard`` writes TensorBoard scalars to ``workdir/tensorboard``; ``profile_steps``
    ``(A, B)`` traces steps A..B into ``workdir/profile``.
    """
    combiner, source, root = make_combiner(config.combiner, config.data), make_source(config.data), as_path(workdir)
    progress = combine(
        ProgressLog(config.log_every_seconds),
        MetricsWriter(str(root / "tensorboard"), row_bytes=row_bytes(source)) if tensorboard else None,
        ProfileWindow(*profile_steps, str(root / "profile")) if profile_steps else None,
    )
    ck = config.checkpoint
    result, summary = run_in_workdir(
        combiner, source, workdir, run_options(config, progress=progress, step_timeout=step_timeout),
        checkpoint=CheckpointOptions(**{k: v for k, v in ck.items() if k != "enabled"}) if ck.enabled else None,
        force_unlock=force_unlock,
        record={"distributed": started_as, "config": json.loads(json.dumps(config.to_dict(), default=repr))},
        outputs=result_files(combiner),
    )
    return result, summary


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        fail(f"unexpected arguments {argv[1:]}; every option is a --flag.")
    if _LIST_CONFIGS.value:
        print("\n".join(f"{name:14s} {doc}" for name, doc in shipped_configs().items()))
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
    if config.get("x64", False):
        jax.config.update("jax_enable_x64", True)  # before anything touches a backend
    with exits(), cli_wording():
        distributed.stop_on_sigterm(already=bool(_EARLY_SIGTERM))
        started_as = distributed.initialize(
            _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
            timeouts=distributed.Timeouts(_INIT_TIMEOUT.value, _HEARTBEAT_TIMEOUT.value, _SHUTDOWN_TIMEOUT.value),
        )
        logging.info("process %d of %d (%s), %d devices: %s", jax.process_index(), jax.process_count(), started_as,
                     jax.device_count(), jax.devices()[0].platform)
        if jax.process_count() > 1:
            # a dead coordinator: JAX's one-line fatal log and abort(), without absl's stacks of every thread
            signal.signal(signal.SIGABRT, signal.SIG_DFL)
        run_job(config, where(_WORKDIR.value), started_as, _STEP_TIMEOUT.value or None, _FORCE_UNLOCK.value,
                tensorboard, profile_steps)


def cli() -> None:
    if sys.argv[1:2] == ["show"]:  # sharded-scan show WORKDIR: prints a finished job's result (launch.show)
        from launch.show import main as show

        sys.exit(show(sys.argv[2:]))
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # the installed entry point: noted from here on
        signal.signal(signal.SIGTERM, _note_sigterm)
    set_up_logging()
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    cli()
