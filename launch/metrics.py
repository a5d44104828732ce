"""Metrics and profiling of a run, as progress callbacks: TensorBoard scalars and a profiler window.

:class:`MetricsWriter` writes TensorBoard scalars (tensorboardX, optional:
``pip install tensorboardX`` or ``pip install 'sharded_scan[metrics]'``) from process 0;
:class:`ProfileWindow` traces a window of steps with ``jax.profiler`` on every process;
:func:`combine` (from :mod:`sharded_scan.progress`) chains them with the launcher's
``ProgressLog`` and closes them all when its ``with`` block ends, also when the run fails.
Building them checks their arguments and that tensorboardX is installed, and touches
neither the file system nor JAX, so they may be built with the flags, before
``jax.distributed`` starts and before the "already done" check (which works on a read-only
workdir); entering them (``with``) checks that their directory is writable (one
``UsageError`` line) and, for ``ProfileWindow(1, B)``, starts the trace.

Wiring into ``launch/main.py`` (flags ``--tensorboard`` and ``--profile_steps=A:B``)::

    from launch.metrics import MetricsWriter, ProfileWindow, combine, parse_steps

    # at flag time (one "error:" line and exit 2 on a bad value, before any compute):
    steps = parse_steps(_PROFILE_STEPS.value) if _PROFILE_STEPS.value else None   # (first, last)
    # in run_job:
    progress = combine(
        ProgressLog(config.log_every_seconds),
        MetricsWriter(str(root / "tensorboard"), row_bytes=row_bytes(source)) if tensorboard else None,
        ProfileWindow(*steps, str(root / "profile")) if steps else None,
    )
    # run_in_workdir enters it around the run only (not when the job is already done): it checks
    # the directories, and flushes the event file and stops the trace, also when the run fails
    run_in_workdir(combiner, source, workdir, run_options(config, progress=progress, ...), ...)

``tensorboard --logdir WORKDIR/tensorboard`` shows the scalars (tags in :data:`TAGS`, indexed
by steps over all runs of the job, so a resumed run continues the curves), and
``tensorboard --logdir WORKDIR/profile`` (with the ``tensorboard-plugin-profile`` /
``xprof`` plugin) the trace.
"""

from __future__ import annotations

import importlib.util
import logging
import numbers
import os
import time
from typing import Any

import jax

from sharded_scan.errors import UsageError
from sharded_scan.progress import Callbacks, combine
from sharded_scan.storage import check_writable

__all__ = [
    "TAGS", "Callbacks", "MetricsWriter", "ProfileWindow", "combine", "parse_steps",
    "tensorboardx_installed",
]

_log = logging.getLogger(__name__)

TENSORBOARDX_HINT = "pip install tensorboardX (or pip install 'sharded_scan[metrics]')"
# The scalars MetricsWriter writes.
ROWS_PER_SECOND, BYTES_PER_SECOND = "rows_per_second", "bytes_per_second"
STEP_SECONDS, CHECKPOINT_SECONDS, PROGRESS = "step_seconds", "checkpoint_seconds", "progress"
TAGS = (ROWS_PER_SECOND, BYTES_PER_SECOND, STEP_SECONDS, CHECKPOINT_SECONDS, PROGRESS)


def tensorboardx_installed() -> bool:
    """Whether :class:`MetricsWriter` can write here (tensorboardX importable)."""
    return importlib.util.find_spec("tensorboardX") is not None


def _summary_writer_class() -> Any:
    """tensorboardX's writer, imported where it writes: process 0, at its first step (not every process of a
    job: ~0.15 s of CPU each)."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise UsageError(f"TensorBoard metrics need tensorboardX, not installed here: {TENSORBOARDX_HINT}.") from None
    return SummaryWriter


class MetricsWriter:
    """A progress callback writing TensorBoard scalars under ``logdir``, on process 0 only.

    After every step: ``progress`` (the fraction of rows done); from a run's second step
    on (the first one compiles), ``step_seconds`` (``Progress.step_seconds``: reading and
    folding the step's rows, not the callbacks and saves between steps),
    ``rows_per_second`` and, with ``row_bytes``, ``bytes_per_second`` over that time;
    after a checkpoint save, ``checkpoint_seconds`` (how long the save held the run) at
    the save's step, reported with the next step (the final save is not reported). Steps
    count over all runs of the job (``Progress.steps_before + Progress.step``); TensorBoard
    shows a rerun's steps in place of what earlier runs wrote from its first step on (a
    killed run's steps past the checkpoint it resumed from). Each pass of a multi-pass run
    counts its steps from 1.

    Use it as a context manager (or :meth:`close` it): entering checks that ``logdir`` is
    writable, leaving flushes and closes the event file.

    Args:
      logdir: the TensorBoard log directory (created on the first step).
      row_bytes: bytes of one row of the data, for ``bytes_per_second``; None leaves it out.
      flush_secs: how often the event file is flushed while the run goes on.

    Raises:
      UsageError: tensorboardX is not installed or ``row_bytes`` is not a positive
        integer; ``logdir`` is not writable (when entered).
    """

    def __init__(self, logdir: str | os.PathLike, row_bytes: int | None = None, flush_secs: int = 10):
        if not tensorboardx_installed():
            _summary_writer_class()  # its one line
        if row_bytes is not None and (isinstance(row_bytes, bool) or not isinstance(row_bytes, numbers.Integral)
                                      or row_bytes <= 0):
            raise UsageError(f"row_bytes must be a positive integer or None, got {row_bytes!r}.")
        self.logdir = os.path.abspath(os.fspath(logdir))
        self.row_bytes, self.flush_secs = None if row_bytes is None else int(row_bytes), flush_secs
        self._writer: Any = None
        self._active: bool | None = None  # process 0; known at the first call (after jax.distributed starts)
        self._last: tuple[int, int] | None = None  # (step over all runs, rows_done) of the last call
        self._saved_at: int | None = None

    def __call__(self, p: Any) -> None:
        if self._active is None:
            self._active = jax.process_index() == 0
        if not self._active:
            return
        step = p.steps_before + p.step
        if self._writer is None:
            # TensorBoard then drops what earlier runs wrote from this step on (a killed run, past its checkpoint)
            # A unique suffix: event files are named by the second they open, and a resumed run can
            # open its file in the second the killed run opened its own (it would replace it).
            self._writer = _summary_writer_class()(self.logdir, flush_secs=self.flush_secs, purge_step=step,
                                                   filename_suffix=f".{time.time_ns()}.{os.getpid()}")
        write = self._writer.add_scalar
        write(PROGRESS, p.rows_done / max(p.num_rows, 1), step)
        if p.checkpoint_step is not None and p.checkpoint_step != self._saved_at:
            self._saved_at = p.checkpoint_step
            write(CHECKPOINT_SECONDS, p.checkpoint_seconds, p.checkpoint_step)
        last_step, last_rows = self._last or (None, 0)
        self._last = (step, p.rows_done)
        if p.step == 1 or last_step != step - 1 or p.step_seconds is None:  # a run's first step compiles: no rates
            return
        seconds = max(p.step_seconds, 1e-9)
        write(STEP_SECONDS, seconds, step)
        write(ROWS_PER_SECOND, (p.rows_done - last_rows) / seconds, step)
        if self.row_bytes is not None:
            write(BYTES_PER_SECOND, (p.rows_done - last_rows) * self.row_bytes / seconds, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flushes and closes the event file (nothing when no step was reported); idempotent."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

    def __enter__(self) -> MetricsWriter:
        check_writable(self.logdir)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def parse_steps(text: str) -> tuple[int, int]:
    """``"A:B"`` (or ``"A"``, meaning ``"A:A"``) → ``(A, B)``: the first and last step to profile.

    Steps count as ``Progress.step`` does: the run's first step is 1.

    Raises:
      UsageError: not two whole numbers, a step below 1, or ``A > B`` (one line).
    """
    parts = str(text).split(":")
    try:
        if len(parts) not in (1, 2):
            raise ValueError
        first, last = int(parts[0]), int(parts[-1])
    except ValueError:
        raise UsageError(f"profile steps must be 'A:B', first and last step (e.g. '10:12'), got {text!r}.") from None
    check_window(first, last, repr(str(text)))
    return first, last


def check_window(first: Any, last: Any, what: str | None = None) -> None:
    """Raises a one-line UsageError unless ``1 <= first <= last`` are whole numbers."""
    what = what or f"{first!r}:{last!r}"
    for value in (first, last):
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"profile steps must be whole numbers, got {what}.")
    if first < 1 or last < 1:
        raise UsageError(f"profile steps count from 1 (the run's first step), got {what}.")
    if first > last:
        raise UsageError(f"profile steps {what} end before they start: the first ({first}) must not exceed the "
                         f"last ({last}).")


class ProfileWindow:
    """A progress callback tracing steps ``first`` to ``last`` of a run with ``jax.profiler``.

    The trace starts when step ``first`` begins (after step ``first - 1`` is reported; for
    ``first == 1`` when the window is entered as a context manager, compiling included)
    and stops once step ``last`` is done, or when the window is closed or its ``with``
    block ends (also when the run fails or has fewer steps). Steps count as
    ``Progress.step``: this run's, from 1. One window per object; later passes of a
    multi-pass run are not traced again. Every process traces: ``logdir`` holds
    ``plugins/profile/<time>/<host>.xplane.pb``; with several processes each writes
    into ``logdir/process<i>``.

    Raises:
      UsageError: steps not whole numbers with ``1 <= first <= last``; ``logdir`` not
        writable (when entered).
    """

    def __init__(self, first: int, last: int, logdir: str | os.PathLike):
        check_window(first, last)
        self.first, self.last = first, last
        self.logdir = os.path.abspath(os.fspath(logdir))
        self.trace_dir: str | None = None  # where the trace went, once started
        self._tracing, self._done = False, False

    def __call__(self, p: Any) -> None:
        if not self._tracing and not self._done and self.first - 1 <= p.step < self.last:
            self.start()
        elif self._tracing and p.step >= self.last:
            self.stop()

    def start(self) -> None:
        """Starts the trace now (the callback does it at step ``first``)."""
        if self._tracing or self._done:
            return
        directory = self.logdir
        if jax.process_count() > 1:
            directory = os.path.join(directory, f"process{jax.process_index()}")
        jax.profiler.start_trace(directory)
        self._tracing, self.trace_dir = True, directory
        _log.info("profiling steps %d to %d into %s", self.first, self.last, directory)

    def stop(self) -> None:
        """Stops the trace and writes it, if it runs; the window is then done."""
        self._done = True
        if self._tracing:
            self._tracing = False
            jax.profiler.stop_trace()
            _log.info("wrote the profile of steps %d to %d to %s", self.first, self.last, self.trace_dir)

    def close(self) -> None:
        self.stop()

    def __enter__(self) -> ProfileWindow:
        check_writable(self.logdir)
        if self.first == 1:
            self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
