r"""Runs one job as N processes on this machine: the CPU stand-in for N hosts.

    python -m launch.local --num_processes=2 --devices_per_process=2 -- \
        --config=configs/gram.py:quick --workdir=/tmp/gram2

Each process runs ``python -m launch.main <args after -->`` with
``--coordinator_address=127.0.0.1:<free port> --num_processes=N --process_id=i
--jax_num_cpu_devices=M --jax_platforms=cpu`` (those flags after ``--`` are refused in one line: they
would be overridden). Their output is prefixed ``[i]``. When
one exits non-zero the others are killed and this exits with its status; SIGTERM or
Ctrl-C here is passed on to every process (which then save a checkpoint and stop).
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

from launch.processes import check_main_args, launch
from sharded_scan.errors import UsageError
from sharded_scan.workdir import EXIT_USAGE

_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 2, "Processes to start.", lower_bound=1)
_DEVICES = flags.DEFINE_integer("devices_per_process", 1, "Simulated CPU devices per process.", lower_bound=1)
_PORT = flags.DEFINE_integer("port", 0, "Coordinator port on 127.0.0.1; 0 picks a free one.")
_GRACE = flags.DEFINE_float("kill_after", 30.0, "Seconds to wait after passing on SIGTERM before SIGKILL.")


def main(argv: list[str]) -> None:
    main_args = argv[1:]
    try:
        if not main_args:
            raise UsageError("give the launch.main arguments after --, e.g. -- --config=gram:quick --workdir=DIR")
        check_main_args(main_args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(launch(main_args, _NUM_PROCESSES.value, _DEVICES.value, _PORT.value, _GRACE.value))


def cli() -> None:
    app.run(main)


if __name__ == "__main__":
    cli()
