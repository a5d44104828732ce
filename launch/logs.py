"""What the launcher logs: progress lines (:class:`ProgressLog`), and less of the libraries' chatter."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import jax
from absl import logging as absl_logging

from sharded_scan.engine import Progress


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


def set_up_logging() -> None:
    """INFO logs through absl, without orbax's chatter, tensorstore's closed-loop noise and JAX's "no TPU"."""
    sys.unraisablehook = _quiet_unraisable(sys.unraisablehook)
    absl_logging.set_verbosity(absl_logging.INFO)
    absl_logging.get_absl_handler().addFilter(_QuietLibraries())
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no TPU backend" noise
    logging.getLogger("jax._src.compilation_cache").setLevel(logging.WARNING)  # "Resetting cache" when it is set
