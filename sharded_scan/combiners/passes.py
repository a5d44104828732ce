"""Reductions that read the data more than once, run as a sequence of ordinary runs.

A :class:`MultiPass` reduction describes its passes as a generator: it yields the
combiner of the next pass, receives that pass's result, and finally returns the
answer. :func:`run_passes` runs each yielded combiner with :func:`sharded_scan.run`
and the same options; pass ``i`` checkpoints in its own subdirectory ``pass{i}`` of the
checkpoint directory, so a killed job run again skips the finished passes (their
final checkpoints give their results at once) and resumes the pass it was in. Every
pass combiner's parameters are fixed by the results before it, so the resumed job
asks the same questions.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Generator
from typing import Any

from sharded_scan.errors import UsageError


class MultiPass:
    """Mixin for reductions that need several passes over the data."""

    @property
    def needs_passes(self) -> bool:
        """Whether this instance reads the data more than once (else it is a plain combiner)."""
        return True

    def passes(self) -> Generator[Any, Any, Any]:
        """Yields each pass's combiner, is sent its result, and returns the final result."""
        raise NotImplementedError


def pass_checkpoint(checkpoint: Any, index: int) -> Any:
    """The checkpoint option of pass ``index`` (from 1): its own subdirectory ``pass{index}``."""
    from sharded_scan.checkpoint import CheckpointOptions

    if checkpoint is None:
        return None
    if isinstance(checkpoint, (str, os.PathLike)):
        return os.path.join(os.fspath(checkpoint), f"pass{index}")
    if isinstance(checkpoint, CheckpointOptions):
        return dataclasses.replace(checkpoint, directory=os.path.join(os.fspath(checkpoint.directory), f"pass{index}"))
    raise UsageError(
        "a reduction of several passes checkpoints each pass in its own subdirectory: pass checkpoint= "
        f"a directory or CheckpointOptions, not a {type(checkpoint).__name__}."
    )


def check_rereadable(data: Any) -> None:
    """Refuses data that can be read only once (an IteratorSource over a one-shot iterator)."""
    batches = getattr(data, "_batches", None)
    if batches is not None and iter(batches) is batches:
        raise UsageError(
            "this reduction reads the data more than once, and the IteratorSource wraps a one-shot iterator; "
            "pass an array, a file source, or an iterable that starts over on each iter()."
        )


def run_passes(reduction: Any, data: Any, *, checkpoint: Any = None, **options: Any) -> tuple[Any, Any]:
    """Runs a reduction of one or more passes; returns its result and a :class:`sharded_scan.RunReport`.

    Args:
      reduction: a :class:`MultiPass` (e.g. ``Quantiles(exact=True)``) or a plain combiner
        (one pass, exactly like :func:`sharded_scan.run_with_report`, checkpoint included).
      data: as for :func:`sharded_scan.run`; it is read once per pass.
      checkpoint: None, a directory or :class:`sharded_scan.CheckpointOptions`; pass
        ``i`` uses its subdirectory ``pass{i}``.
      **options: every other option of :func:`sharded_scan.run`, used by every pass.

    Returns:
      ``(result, report)``: the report sums the passes' rows, steps, seconds and
      checkpoints (``rows_this_run`` counts every row read, over all passes).
    """
    from sharded_scan.engine import RunReport, run_with_report

    if not (isinstance(reduction, MultiPass) and reduction.needs_passes):
        return run_with_report(reduction, data, checkpoint=checkpoint, **options)
    check_rereadable(data)
    pass_checkpoint(checkpoint, 1)  # a bad checkpoint option is refused before any compute
    started = time.perf_counter()
    plan = reduction.passes()
    reports = []
    try:
        combiner = next(plan)
        while True:
            result, report = run_with_report(
                combiner, data, checkpoint=pass_checkpoint(checkpoint, len(reports) + 1), **options
            )
            reports.append(report)
            combiner = plan.send(result)
    except StopIteration as done:
        answer = done.value
    last, first = reports[-1], reports[0]
    return answer, RunReport(
        rows=last.rows,
        rows_this_run=sum(r.rows_this_run for r in reports),
        seconds=time.perf_counter() - started,
        steps=sum(r.steps for r in reports),
        resumed_from_cursor=first.resumed_from_cursor,
        resumed_from_step=first.resumed_from_step,
        checkpoints_written=sum(r.checkpoints_written for r in reports),
        merge_bytes=max(r.merge_bytes for r in reports),
        devices=last.devices,
        processes=last.processes,
        mesh=last.mesh,
    )
