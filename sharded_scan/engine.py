"""The engine: runs a job's program over its source, checkpointing between steps.

:func:`run_with_report` builds the :class:`~sharded_scan.program.Program` (everything
checked before any compute), restores the latest checkpoint or starts from identity
partials, folds every step while the next ones are read and placed ahead
(:mod:`sharded_scan.prefetch`), saves when the checkpointer's policy says so or on
SIGTERM, merges once and finalizes on the host.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import logging
import os
import time
from typing import Any, NamedTuple

import jax
import numpy as np

from sharded_scan import codegen, compile_cache
from sharded_scan.checkpoint import (
    Checkpointer,
    CheckpointJob,
    CheckpointSession,
    Restored,
    as_checkpointer,
)
from sharded_scan.combiners.base import Combiner
from sharded_scan.combiners.passes import reads_several_times
from sharded_scan.combiners.sketches.topk_strings import read_once, with_strings
from sharded_scan.combiners.wrappers.policies import NonFiniteError, innermost, step_guard
from sharded_scan.compiled import Program, host_identity
from sharded_scan.distributed import Preempted, PreemptionWatch, agree, any_process, finishing
from sharded_scan.dtypes import x64_scope
from sharded_scan.errors import StorageError, UsageError
from sharded_scan.group_keys import grouped_source
from sharded_scan.merging import MergeRoute
from sharded_scan.options import RunOptions
from sharded_scan.prefetch import device_batches
from sharded_scan.program import build_program
from sharded_scan.progress import reporter
from sharded_scan.relayout import compact, relayout
from sharded_scan.sharding import to_host
from sharded_scan.sources import Source, as_source
from sharded_scan.sources.compose import part_of
from sharded_scan.watchdog import Watchdog, is_peer_lost

PyTree = Any
_log = logging.getLogger(__name__)


class Progress(NamedTuple):
    """What the engine reports after each step (the fields after ``seconds`` have defaults)."""

    step: int          # steps done in this run (counting from the resumed one)
    total_steps: int
    rows_done: int     # cursor: rows folded so far, including those of a resumed checkpoint
    num_rows: int
    seconds: float     # since the run started
    steps_before: int = 0                    # steps of earlier runs (a resumed checkpoint's); + step: over all runs
    step_seconds: float | None = None        # this step: waiting for its rows and folding them (not the callbacks
                                             # or saves between steps; the first step's includes compiling)
    checkpoint_step: int | None = None       # steps over all runs at this run's latest save; None before one
    checkpoint_seconds: float | None = None  # how long that save held the run (the write ends in the background)


class RunReport(NamedTuple):
    """What a run did, for logs and ``summary.json``."""

    rows: int                  # rows of the dataset (all folded once the run finishes)
    rows_this_run: int         # rows folded by this run (less when it resumed)
    seconds: float             # wall time of this run, restore to result (compile_seconds included)
    steps: int                 # steps run by this run
    resumed_from_cursor: int | None  # the checkpoint's cursor when the run resumed
    resumed_from_step: int | None    # steps done before the resume (over all earlier runs)
    checkpoints_written: int
    merge_bytes: int           # bytes of one shard's accumulator pytree: what the final merge moves per shard
    devices: int
    processes: int
    mesh: dict[str, int]
    passes: int = 1            # passes over the data (more than one for a MultiPass reduction)
    nonfinite_values: int = 0  # values of the merged accumulator NaN or inf where its identity is finite
    compile_seconds: float = 0.0  # of seconds: tracing, lowering and compiling programs (or loading them from the
                                  # persistent compilation cache) from the call's start, building the program included
                                  # (its checks and memory estimate trace), in any thread; the rest is reading,
                                  # computing and saving


def run(combiner: Combiner, data: Any, options: RunOptions | None = None, **overrides: Any) -> Any:
    """Reduces ``data`` with ``combiner`` over every device of the mesh.

    Args:
      combiner: the reduction, e.g. ``sharded_scan.Gram()``.
      data: a numpy array, a pytree of arrays with one leading row dimension such as
        ``(X, y)``, or a :class:`sharded_scan.sources.Source`.
      options: a :class:`sharded_scan.RunOptions`; None for the defaults.
      **overrides: any field of :class:`sharded_scan.RunOptions` (``mesh``,
        ``microbatch``, ``steps_per_call``, ``prefetch``, ``logical_shards``,
        ``nan_policy``, ``compensated``, ``precision``, ``checkpoint``, ``progress``,
        ``step_timeout``), which documents each.

    Returns:
      ``combiner.finalize`` of the merged accumulator: host numpy, the same on every
      process.

    Raises:
      UsageError: bad data, mesh or options, another job holding the checkpoint
        directory, a checkpoint of another job or of changed data, before any compute.
      Preempted: SIGTERM or SIGINT arrived; a checkpoint was saved and rerunning
        resumes from it.
      StorageError: a checkpoint could not be written or set aside (no space,
        read-only, no permission); the one before is intact.
    """
    return run_with_report(combiner, data, options, **overrides)[0]


def run_with_report(
    combiner: Combiner, data: Any, options: RunOptions | None = None, **overrides: Any
) -> tuple[Any, RunReport]:
    """Like :func:`run`, also returning a :class:`RunReport` of what the run did.

    A reduction that reads the data several times (a
    :class:`~sharded_scan.combiners.passes.MultiPass`, e.g. ``Quantiles(exact=True)``) runs pass
    by pass, each an ordinary run with the same options; pass ``i`` checkpoints in the
    subdirectory ``pass{i}`` of the checkpoint directory, so a killed job run again returns the
    finished passes' results from their final checkpoints at once and resumes the pass it was
    in. Its report sums the passes' rows, steps, seconds and checkpoints (``rows_this_run``
    counts every row read over all passes) and gives their number in ``passes``.
    """
    options = RunOptions.make(options, **overrides)
    if reads_several_times(combiner):
        return _run_passes(combiner, data, options)
    # a bad checkpoint= is one line before anything is built; the checked one is what the run then uses
    options = dataclasses.replace(options, checkpoint=as_checkpointer(options.checkpoint))
    started, compiled = time.perf_counter(), compile_cache.compile_seconds()
    combiner, source = grouped_source(combiner, data)  # as_source(data); a GroupBy's keys by value found first
    return run_program(build_program(combiner, source, options), source, started, compiled)


def run_program(
    program: Program, source: Source, started: float | None = None, compiled: float | None = None
) -> tuple[Any, RunReport]:
    """Runs a built ``program`` over ``source`` (what :func:`run_with_report` does once it is built),
    64-bit data under :func:`~sharded_scan.dtypes.x64_scope` (restore, reads, steps, merge, finalize).

    ``started`` (``time.perf_counter()``) and ``compiled`` (:func:`~sharded_scan.compile_cache.compile_seconds`)
    at the run's start, for the report's ``seconds`` and ``compile_seconds``; None: now.

    Raises:
      UsageError, StorageError, Preempted: as :func:`run`.
    """
    with x64_scope(program.spec):
        return _run_program(program, source, started, compiled)


def _run_program(
    program: Program, source: Source, started: float | None, compiled: float | None
) -> tuple[Any, RunReport]:
    started = time.perf_counter() if started is None else started
    compiled = compile_cache.compile_seconds() if compiled is None else compiled
    ckpt = as_checkpointer(program.options.checkpoint)
    with Watchdog(program.options.step_timeout) as dog, PreemptionWatch(enabled=ckpt is not None) as watch:
        agree_on_job(program, stop=watch.signal_name is not None)  # stop: a SIGTERM since the watch began
        session = None if ckpt is None else ckpt.open(checkpoint_job(program))  # the lease, damage set aside
        try:
            start = _start(program, session)
            partials, steps = fold_all(program, source, start, session, dog, started, watch)
        except BaseException as e:
            if session is not None and jax.process_count() > 1 and is_peer_lost(e):
                session.abandon()  # a save in flight would wait for the dead peer until the heartbeat aborts us
            elif session is not None:
                _close_quietly(session, e)  # the first error is the one to report
            raise
        if session is not None:
            session.close()  # waits for the saves in flight; a failed one raises StorageError
    finishing("past the last step: " + ("merging" if ckpt is None else f"the finished job's checkpoint in "
                                        f"{ckpt.directory} is saved; merging and writing the result"))
    merged = merged_on_host(program, partials)
    nonfinite = check_overflow(program, merged)
    result = with_column_names(finalize(program, merged), part_of(source, program.job.data_part))
    layout = program.layout
    report = RunReport(
        rows=layout.num_rows,
        rows_this_run=layout.num_rows - start.cursor,
        seconds=time.perf_counter() - started,
        steps=steps,
        resumed_from_cursor=start.cursor if start.meta else None,
        resumed_from_step=start.steps if start.meta else None,
        checkpoints_written=0 if session is None else session.written,
        merge_bytes=sum(int(x.nbytes) for x in jax.tree.leaves(partials)) // layout.num_shards,
        devices=program.mesh.size,
        processes=jax.process_count(),
        mesh=dict(program.mesh.shape),
        nonfinite_values=nonfinite,
        compile_seconds=compile_cache.compile_seconds() - compiled,
    )
    return result, report


def merged_on_host(program: Program, partials: PyTree) -> PyTree:
    """The merged accumulator on the host: ``program.merge`` of the partials; a lone shard of a pairwise route
    (one device, one process: a small job's) is that shard as it is, read without a program to index it."""
    alone = program.layout.num_shards == 1 and program.mesh.size == 1 and jax.process_count() == 1
    if alone and program.merge_route == MergeRoute.PROCESS_TREE:  # the tree of one shard merges nothing
        return jax.tree.map(lambda x: np.asarray(x[0]), to_host(partials))  # a 0-d array, as to_host gives
    return to_host(program.merge(partials))


# The checkpoint options that decide when the processes save together (and what they resume).
SAVE_TERMS = ("every_steps", "every_seconds", "keep", "per_job", "ignore_changed_data", "compact")


def job_terms(program: Program, workdir: str | None = None) -> dict[str, Any]:
    """What every process of a job must run alike: the fingerprint (combiner, data, micro-batch,
    accumulator, code, file stamps), the layout, the options that shape the steps and saves, the
    workdir and the checkpoint directory (JSON)."""
    layout, options = program.layout, program.options
    ckpt = as_checkpointer(options.checkpoint)
    terms = {
        **program.fingerprint,
        "num_rows": layout.num_rows,
        "steps_per_call": layout.steps_per_call,
        "shards": layout.num_shards,
        "steps": layout.num_steps(),
        "mesh": dict(program.mesh.shape),
        "precision": options.precision,
        "workdir": workdir,
        "checkpoint": None if ckpt is None else {
            "directory": ckpt.directory, **{name: getattr(ckpt.options, name) for name in SAVE_TERMS}},
    }
    return json.loads(json.dumps(terms, default=repr))


def agree_on_job(program: Program, workdir: str | None = None, stop: bool = False) -> None:
    """Refuses to start unless every process runs the same job (:func:`job_terms`); nothing with one process.

    Before anything that would hang or abort on a difference (other micro-batches wait for
    each other's collectives, other row counts end in a gloo abort, other directories in
    another lease). Also where every process stops together on a SIGTERM caught before
    the first step (``stop``, or one :func:`~sharded_scan.distributed.stop_on_sigterm` deferred).

    Raises:
      UsageError: on every process, naming the field and the processes that differ.
      sharded_scan.distributed.Terminated: some process caught a SIGTERM (on every process).
    """
    agree(job_terms(program, workdir), "the job",
          "start every process with the same flags, reading the same files (a copy keeps its modification time "
          "with cp -p or rsync -a)", stop)


def _run_passes(reduction: Combiner, data: Any, options: RunOptions) -> tuple[Any, RunReport]:
    """Runs a reduction that reads the data several times, pass by pass (:func:`run_with_report`)."""
    ckpt = as_checkpointer(options.checkpoint)  # a bad checkpoint option is refused before any compute
    source = as_source(data)  # once: each pass reads it from row 0
    check_rereadable(source)
    started = time.perf_counter()
    plan = reduction.passes()
    reports: list[RunReport] = []
    try:
        combiner = next(plan)
        while True:
            checkpoint = pass_checkpoint(ckpt, len(reports) + 1)
            result, report = run_with_report(combiner, source, dataclasses.replace(options, checkpoint=checkpoint))
            reports.append(report)
            combiner = plan.send(result)
    except StopIteration as done:
        answer = with_column_names(done.value, source)
    last, first = reports[-1], reports[0]
    return answer, last._replace(
        rows_this_run=sum(r.rows_this_run for r in reports),
        seconds=time.perf_counter() - started,
        steps=sum(r.steps for r in reports),
        resumed_from_cursor=first.resumed_from_cursor,
        resumed_from_step=first.resumed_from_step,
        checkpoints_written=sum(r.checkpoints_written for r in reports),
        merge_bytes=max(r.merge_bytes for r in reports),
        passes=len(reports),
        nonfinite_values=sum(r.nonfinite_values for r in reports),
        compile_seconds=sum(r.compile_seconds for r in reports),
    )


def pass_checkpoint(ckpt: Checkpointer | None, index: int) -> Checkpointer | None:
    """The checkpointer of pass ``index`` (from 1): its own subdirectory ``pass{index}``, under the same lease."""
    if ckpt is None:
        return None
    return Checkpointer(dataclasses.replace(ckpt.options, directory=os.path.join(ckpt.directory, f"pass{index}")),
                        leased=ckpt.leased)


def check_rereadable(source: Source) -> None:
    """Refuses data that can be read only once (an IteratorSource over a one-shot iterator)."""
    if not source.rereadable:
        raise UsageError(
            "this reduction reads the data more than once, and the IteratorSource wraps a one-shot iterator; "
            "pass an array, a file source, or an iterable that starts over on each iter() or has get_state/set_state."
        )


def _close_quietly(session: CheckpointSession, error: BaseException) -> None:
    try:
        session.close()
    except Exception as e:  # noqa: BLE001 - ``error`` is already on its way out
        if e is not error:
            _log.warning("while stopping: %s", e)


def checkpoint_job(program: Program) -> CheckpointJob:
    """What the checkpointer needs of ``program``'s job: its partials, fingerprint and layout, its relayout
    of partials written on another layout, and what a compact save writes."""
    return CheckpointJob(program.like, program.fingerprint, program.shape_meta, functools.partial(relayout, program),
                         functools.partial(compact, program))


def _start(program: Program, session: CheckpointSession | None) -> Restored:
    """The latest checkpoint of the job, or identity partials at row 0 (``meta`` empty)."""
    if session is not None:
        restored = session.restore_latest()
        if restored is not None:
            return restored
    return Restored(program.init(), 0, 0, {}, {})


class _Health:
    """The ``nan_policy="raise"`` count of a step, read one step late so the devices never wait."""

    def __init__(self, combiner: Combiner):
        self.guard = step_guard(combiner)
        self._pending: tuple[Any, int, int] | None = None

    def after_step(self, partials: PyTree, first_row: int, num_rows: int) -> None:
        self.check()
        if self.guard is not None:
            self._pending = (self.guard.health(partials), first_row, num_rows)

    def check(self) -> None:
        if self._pending is not None:
            value, first_row, num_rows = self._pending
            self._pending = None
            self.guard.check_health(to_host(value), first_row, num_rows)


def fold_all(
    program: Program, source: Source, start: Restored, ckpt: CheckpointSession | None, dog: Watchdog,
    started: float, watch: PreemptionWatch | None = None,
) -> tuple[PyTree, int]:
    """Folds every step from ``start.cursor`` on; saves between steps; stops on SIGTERM/SIGINT.

    After every step but the last, all processes agree (one small collective when
    there are several) on whether any of them caught a signal, is late for a
    time-based save or saw a save fail, so they all act at the same step.

    Returns:
      ``(partials, steps)``: the partials after the last row, and the steps this run ran.

    Raises:
      Preempted: after saving a checkpoint at the step boundary all processes agreed on.
      StorageError: a save failed (the checkpoint before it is intact).
    """
    layout = program.layout
    partials, steps = start.partials, 0
    saved: tuple[int, float] | None = None  # (steps over all runs, seconds) of this run's latest save
    total = layout.num_steps(start.cursor)
    health = _Health(program.combiner)
    if ckpt is not None:
        ckpt.policy.plan(layout.num_steps())

    def save(done: int) -> None:
        nonlocal saved, between
        health.check()  # never save rows a "raise" policy refuses
        began = time.perf_counter()
        ckpt.save(done, start.steps + steps, partials, source.state_at(done))
        between = time.perf_counter()
        saved = (start.steps + steps, between - began)

    batches = device_batches(source, layout, program.mesh, start.cursor, program.options.prefetch, start.source_state)
    with contextlib.closing(batches), reporter(program.options.progress, start.cursor, layout.num_rows) as report:
        between = time.perf_counter()  # the end of what the engine did after the step before
        for i, item in enumerate(batches):
            partials = program.step(partials, item.batch, item.num_valid)
            health.after_step(partials, item.cursor, item.num_valid)
            jax.block_until_ready(partials)  # one step in flight: prefetch alone bounds memory
            steps, done = i + 1, item.cursor + item.num_valid
            dog.beat(f"after row {done} of {layout.num_rows}")
            if report is not None:
                now = time.perf_counter()
                report(Progress(steps, total, done, layout.num_rows, now - started, start.steps, now - between,
                                *(saved or (None, None))))
                between = time.perf_counter()
            if ckpt is None or done >= layout.num_rows:
                continue
            signalled = watch is not None and watch.signal_name is not None
            stop, late, failed = any_process(signalled, ckpt.policy.late(), ckpt.poll())
            if failed:
                ckpt.raise_failure()
                raise StorageError(errno.EIO, f"another process of the job could not save the checkpoint in "
                                   f"{ckpt.directory} (its log says why); rerun the same command when it is fixed")
            if stop:
                save(done)
                raise Preempted(done, layout.num_rows, ckpt.directory, (watch and watch.signal_name) or "SIGTERM")
            if ckpt.policy.due(start.steps + steps, late):
                save(done)
    health.check()
    if ckpt is not None and steps:  # the finished state: rerunning returns the result at once
        save(layout.num_rows)
    return partials, steps


def _has_columns(result: Any) -> bool:
    return "columns" in getattr(result, "_fields", ())


def _names(names: Any) -> np.ndarray:
    """``names`` (a name or a list of them) as a 1-D object array of Python ``str``, every one exactly."""
    names = [names] if isinstance(names, str) else list(np.ravel(np.asarray(names, dtype=object)))
    return np.array([str(n) for n in names], dtype=object)


def with_column_names(result: Any, source: Source) -> Any:
    """``result`` with ``columns`` set, when it has that field: the names of X's columns (the
    source's first leaf) as an object array of Python ``str`` when the source names them (numpy's
    fixed-width unicode would drop a name's trailing NULs: ``"x\\0"`` and ``"x"`` would read alike), else
    their positions ``np.arange(d)`` (as pandas numbers unnamed columns), so every field is an array.
    A pytree of such results shaped like the data (``Describe``'s) names each by its leaf; a
    ``GroupBy`` result, each key's inner result."""
    if hasattr(result, "per_key"):
        source = read_once(result.result, source)  # a GroupBy's TopK of strings: the data read once for every key
        return result.per_key(lambda inner: with_column_names(inner, source))
    if not _has_columns(result):
        leaves, tree = jax.tree.flatten(result, is_leaf=_has_columns)
        if not leaves or not all(map(_has_columns, leaves)) or tree != jax.tree.structure(source.spec):
            return result
        names = [None] * len(leaves) if source.column_names is None else tree.flatten_up_to(source.column_names)
        return tree.unflatten([
            r._replace(columns=np.arange(s.shape[0] if s.shape else 1) if n is None else _names(n))
            for r, n, s in zip(leaves, names, tree.flatten_up_to(source.spec), strict=True)
        ])
    names = jax.tree.leaves(source.column_names, is_leaf=lambda x: isinstance(x, (list, str)))
    if names and isinstance(names[0], (list, str)):  # a name alone: rows of one value, one column
        names = [names[0]] if isinstance(names[0], str) else names[0]
        return with_strings(result._replace(columns=_names(names)), names, source)
    shape = jax.tree.leaves(source.spec)[0].shape
    return result._replace(columns=np.arange(shape[0] if shape else 1))


def finalize(program: Program, merged: PyTree) -> Any:
    """``program.finalize(merged)``; a linear solve that fails on the data is one line, not a traceback.

    The line tells what it knows: an accumulator still finite (too few rows), one that
    overflowed on finite rows (``nan_policy`` ``"omit"`` or ``"raise"`` let only finite rows
    in), or, under ``"propagate"``, either NaN/inf rows or an overflow.

    Raises:
      UsageError: the combiner's solve failed; the merged state is saved, so nothing is lost.
    """
    try:
        return program.finalize(merged)
    except np.linalg.LinAlgError as e:
        inner = type(innermost(program.job)).__name__
        start = f"{inner} could not finish on this data ({e}; rows: {program.layout.num_rows})"
        count = nonfinite_values(program, merged)
        if not count:
            raise UsageError(f"{start}: too few rows, or rows the solve cannot use; check the data.") from None
        accumulator, fix = overflow_words(merged)
        if program.options.nan_policy != "propagate":  # the NaN/inf rows were skipped: every row folded was finite
            raise UsageError(f"{start}: {count} accumulator values are inf or NaN, yet every row it folded is finite: "
                             f"the rows overflowed {accumulator}; {fix}.") from None
        raise UsageError(f"{start}: {count} accumulator values are inf or NaN: rows hold NaN/inf (nan_policy='omit' "
                         f"skips them), or finite rows overflowed {accumulator}: {fix}; nan_policy='raise' tells "
                         "which.") from None


def nonfinite_values(program: Program, merged: PyTree) -> int:
    """How many values of the merged accumulator are NaN or infinite where its identity is finite."""
    bad = [np.asarray(x) for x in jax.tree.leaves(merged)]
    bad = [int(np.sum(~np.isfinite(x))) if np.issubdtype(x.dtype, np.inexact) else 0 for x in bad]
    if not any(bad):
        return 0
    identity = jax.tree.leaves(identity_on_host(program.combiner, program.spec))
    return sum(
        int(np.sum(~np.isfinite(np.asarray(x)) & np.isfinite(np.asarray(i))))
        for x, i, b in zip(jax.tree.leaves(merged), identity, bad, strict=True) if b
    )


def identity_on_host(combiner: Combiner, spec: PyTree) -> PyTree:
    """``combiner.init(spec)`` as host numpy: :func:`~sharded_scan.compiled.host_identity`, else one jitted program
    a job (memoized); run eagerly, each of its ``jax.numpy`` calls compiled a program of its own."""
    host = host_identity(combiner, spec)
    return jax.device_get(_compile_identity(combiner, spec)()) if host is None else host


@compile_cache.cached
def _compile_identity(combiner: Combiner, spec: PyTree):
    return jax.jit(lambda: combiner.init(spec), compiler_options=codegen.jit_options(
        codegen.host_options(jax.default_backend())))


def overflow_words(merged: PyTree) -> tuple[str, str]:
    """The accumulator's narrowest float type and its limit, and what to do when rows overflow it."""
    floats = [np.asarray(x).dtype for x in jax.tree.leaves(merged) if np.issubdtype(np.asarray(x).dtype, np.floating)]
    dtype = min(floats or [np.dtype(np.float64)], key=lambda t: np.finfo(t).max)
    wider = np.finfo(dtype).max < np.finfo(np.float64).max
    return (f"the {dtype.name} accumulator (it holds at most {np.finfo(dtype).max:.1e})",
            "scale the data down" + (", or use float64 data with jax_enable_x64 (--config.x64=True)" if wider else ""))


def check_overflow(program: Program, merged: PyTree) -> int:
    """Reports accumulator values that are NaN or infinite where the identity is finite, and returns their count.

    Under ``nan_policy="raise"`` every row was finite (or the run stopped), so such a
    value is an overflow (float32 holds at most 3.4e38): it raises. Otherwise it warns.

    Raises:
      NonFiniteError: under ``nan_policy="raise"``.
    """
    count = nonfinite_values(program, merged)
    if not count:
        return 0
    policy = program.options.nan_policy
    if policy == "raise":
        overflowed = (f"the accumulator overflowed: {count} of its values are inf or NaN although every row is "
                      "finite (float32 holds at most 3.4e38); scale the data down, or")
        raise NonFiniteError(f"{overflowed} pass it as float64 (x.astype(np.float64)), which is reduced in float64.",
                             cli=f"{overflowed} read it as float64 (--config.data.dtype=float64).")
    cause = "rows holding NaN/Inf (nan_policy='propagate') or an overflow" if policy == "propagate" else "an overflow"
    _log.warning("the result may be wrong: %d accumulator values are inf or NaN, from %s; nan_policy='raise' "
                 "tells which.", count, cause)
    return count
