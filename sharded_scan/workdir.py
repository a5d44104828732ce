"""A job in a workdir: one call runs it there, or says it is already done.

:func:`run_in_workdir` is what ``python -m launch.main`` runs, and what a script that
wants the same files calls::

    result, summary = sharded_scan.run_in_workdir(sharded_scan.Gram(), X, "/tmp/gram")

It writes ``WORKDIR/result.npz`` (the result's named arrays), the files ``outputs`` renders
from the result (the launcher's ``result.json``, ``result.csv``, ``describe.json``) and, last,
``WORKDIR/summary.json`` (what the run did, the job's digest,
:func:`~sharded_scan.identity.job_digest`, the stamps of the files it read and the SHA-256 of
every output), with checkpoints in ``WORKDIR/checkpoints``. Running the same job again resumes
from the latest checkpoint or, when every output is there as the summary's digests say, returns
the result ("already done"; this reads only, so it works on a read-only workdir too); an output
missing or damaged (a crash between the writes too) makes the job not done: the rerun writes
them all again from the final checkpoint. When a file it read changed since, it says which
instead. One job at a time holds the workdir: one lease, ``WORKDIR/lock.json``, held while the
job runs and writes, which also covers its checkpoints. :func:`exits` ends a process with the
CLI's exit statuses (:func:`exit_status`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from sharded_scan import compile_cache
from sharded_scan.checkpoint import Checkpointer, CheckpointOptions, not_an_option, take_lease
from sharded_scan.combiners.passes import reads_several_times
from sharded_scan.combiners.results import json_text, json_value
from sharded_scan.digest import stream_digest
from sharded_scan.distributed import Preempted, Terminated, gather_json
from sharded_scan.engine import RunReport, agree_on_job, run_program, run_with_report
from sharded_scan.errors import StorageError, UsageError
from sharded_scan.group_keys import grouped_source
from sharded_scan.identity import files_difference, job_digest
from sharded_scan.options import RunOptions
from sharded_scan.paths import as_path, is_url, where
from sharded_scan.program import build_program
from sharded_scan.sources import Source
from sharded_scan.storage import check_writable, storage_error, storage_reason
from sharded_scan.watchdog import EXIT_PEER_LOST, EXIT_STORAGE, RESUME_HINT, abort, is_peer_lost

_log = logging.getLogger(__name__)

RESULT, SUMMARY, CHECKPOINTS = "result.npz", "summary.json", "checkpoints"
RESULT_DIGEST, OUTPUT_DIGESTS = "result_sha256", "outputs_sha256"  # summary.json's digests of the outputs
Render = Callable[[Any], "str | bytes | None"]  # an output's content from the result; None: this result has none
EXIT_DONE = 0          # done, or preempted / interrupted with a checkpoint saved (rerun to resume)
EXIT_ERROR = 1         # an unexpected error (its traceback)
EXIT_USAGE = 2         # a usage error: one line, nothing computed or written; also another job holding the workdir
EXIT_INTERRUPTED = 130  # Ctrl-C before the run could save (128 + SIGINT)
EXIT_TERMINATED = 143   # SIGTERM while a run without checkpoints folded: nothing saved (128 + SIGTERM)


def run_in_workdir(
    combiner: Any, data: Any, workdir: str | os.PathLike, options: RunOptions | None = None, *,
    checkpoint: CheckpointOptions | None = CheckpointOptions(), force_unlock: bool = False,  # noqa: B008 - frozen
    record: Mapping[str, Any] | None = None, outputs: Mapping[str, Render] | None = None, **overrides: Any,
) -> tuple[Any, dict[str, Any]]:
    """Runs ``combiner`` over ``data`` in ``workdir``, or returns the result already there.

    Args:
      combiner, data, options, overrides: as :func:`sharded_scan.run` (no ``checkpoint``
        option: the workdir keeps the checkpoints). A ``progress`` that is a context
        manager (:func:`sharded_scan.progress.combine`) is entered around the run only,
        not when the job is already done.
      workdir: a local path or a URL (``gs://...``).
      checkpoint: as in :func:`sharded_scan.run`: :class:`~sharded_scan.CheckpointOptions`
        (default: its defaults), which here name no directory (the workdir's ``checkpoints/``),
        e.g. ``CheckpointOptions(every_steps=50)``; None: no checkpoints (a rerun starts afresh).
      force_unlock: take the workdir even though its lock file names a running job
        (only when you know that job is gone); the CLI's ``--force_unlock``. The workdir's lock
        covers its checkpoints: ``CheckpointOptions(force_unlock=True)`` is for ``run``'s
        checkpoint directories, and refused here.
      record: more fields for ``summary.json`` (the launcher's config).
      outputs: more files beside ``result.npz``, ``{name: render}``: ``render(result)``
        gives a file's text or bytes, None where the result has none (the launcher's
        ``result.json``, ``result.csv`` and ``describe.json``: ``launch.outputs.result_files``).
        Each is rendered before any write, written before ``summary.json`` and covered by its
        ``outputs_sha256``; a job is done only when every one of them is there as written.

    Returns:
      ``(result, summary)``: the result and what ``summary.json`` holds; an already
      done job's summary has ``"already_done": True``.

    Raises:
      UsageError: bad arguments, data or options, another job holding the workdir, a
        checkpoint of another job or of changed data, a finished job whose data changed
        since (unless ``ignore_changed_data``); before any compute or write.
      StorageError: a checkpoint or the outputs could not be written (one line).
      sharded_scan.Preempted: SIGTERM or SIGINT arrived and a checkpoint was saved.
    """
    root, workdir = as_path(workdir), where(workdir)  # an unknown URL scheme is one line here
    first_step, cached_before = _FirstStep(), compile_cache.counts()
    options = RunOptions.make(options, **overrides)
    user_progress, options = options.progress, first_step.watching(options)
    if options.checkpoint is not None:
        raise UsageError(f"a workdir keeps its checkpoints in {CHECKPOINTS}/: pass run_in_workdir(checkpoint="
                         "sharded_scan.CheckpointOptions(...)) naming no directory, or checkpoint=None, not "
                         "RunOptions(checkpoint=...).")
    checkpointer = _checkpointer(str(root / CHECKPOINTS), checkpoint)
    # The report's seconds and compile_seconds from here: building the program traces its step (the memory estimate).
    started, compiled = time.perf_counter(), compile_cache.compile_seconds()
    combiner, source = grouped_source(combiner, data)  # as_source(data); a GroupBy's keys by value found first
    program = build_program(combiner, source, dataclasses.replace(options, checkpoint=checkpointer))
    if checkpointer is not None:  # verify_data="digest": the files' digests, read once for both uses
        program = dataclasses.replace(program, fingerprint=checkpointer.identity(program.fingerprint))
    job = job_digest(program.fingerprint)
    agree_on_job(program, workdir)  # every process the same job and workdir, before any read or write there
    outputs = dict(outputs or {})
    done = gather_json(finished(workdir, program.fingerprint, outputs))[0]
    if done is not None and "data_changed" in done:
        _refuse_changed(root, done["data_changed"], checkpointer)
    if done is not None:
        _log.info("already done: %s holds this job's result (%s rows); nothing to do (a new workdir runs it again)%s.",
                  root / RESULT, done.get("rows"), nonfinite_words(done.get("nonfinite_values", 0), options.nan_policy))
        return load_result(workdir), {**done, "already_done": True}
    check_writable(workdir)
    lease = take_lease(workdir, job, force_unlock)
    try:
        with _entered(user_progress):
            if reads_several_times(combiner):  # e.g. Quantiles(exact=True)
                result, report = run_with_report(combiner, source, program.options)  # pass by pass
            else:
                result, report = run_program(program, source, started, compiled)
        cache = warm_start(first_step.seconds, cached_before)
        summary = {**summary_of(report, source), **cache, **(record or {}), "job": job,
                   "files": program.fingerprint["files"]}
        if jax.process_index() == 0:
            intact = (f"the finished job's checkpoint in {root / CHECKPOINTS} is intact" if checkpointer is not None
                      else "nothing else was changed (checkpoints are off: a rerun starts afresh)")
            summary = write_outputs(workdir, result, summary, intact, outputs)
            _log.info("done: %s on %d devices; %s; wrote %s%s", timing_words(summary), summary["devices"],
                      cache_words(cache), root / RESULT,
                      nonfinite_words(summary["nonfinite_values"], program.options.nan_policy))
    finally:
        if lease is not None:
            lease.release()
    return result, summary


class _FirstStep:
    """A progress callback noting when the first step of the run ended, from its creation."""

    def __init__(self):
        self._started, self.seconds = time.perf_counter(), None

    def __call__(self, p: Any) -> None:
        if self.seconds is None:
            self.seconds = time.perf_counter() - self._started

    def watching(self, options: RunOptions) -> RunOptions:
        """``options`` whose progress calls this first, then the caller's."""
        mine = options.progress if isinstance(options.progress, tuple) else (options.progress,)
        return dataclasses.replace(options, progress=(self, *(p for p in mine if p is not None)))


def warm_start(first_step_seconds: float | None, before: compile_cache.CacheCounts) -> dict:
    """``summary.json``'s fields on the start: seconds from the call to the first step's end (None: no step ran),
    and the programs the run compiled through the persistent compilation cache and loaded from it."""
    now = compile_cache.counts()
    looked_up, from_cache = now.looked_up - before.looked_up, now.from_cache - before.from_cache
    return {
        "first_step_seconds": first_step_seconds,
        "compilation_cache": {"directory": compile_cache.in_use(), "programs": looked_up,
                              "from_cache": from_cache},
        "compiled_from_cache": looked_up > 0 and from_cache == looked_up,
    }


def cache_words(fields: dict) -> str:
    """The compilation cache, for the log: ``5 of 5 programs from the compilation cache``."""
    cache = fields["compilation_cache"]
    return (f"{cache['from_cache']} of {cache['programs']} programs from the compilation cache"
            if cache["directory"] else "no compilation cache")


def timing_words(summary: dict) -> str:
    """The ``done:`` line's times: ``10000 rows in 2.31 s (compiling 1.90 s, reading and computing 0.41 s:
    24,390 rows/s)`` (rows/s of the rows this run read, over the reading and computing)."""
    rate = f"{summary['rows_per_second']:,.0f}" if summary["rows_per_second"] else "no"
    return (f"{summary['rows']} rows in {summary['seconds']:.2f} s (compiling {summary['compile_seconds']:.2f} s, "
            f"reading and computing {summary['compute_seconds']:.2f} s: {rate} rows/s)")


def _refuse_changed(root: Any, changed: str, checkpointer: Checkpointer | None) -> None:
    """One line for a finished job whose data changed since, unless ``ignore_changed_data`` (then a warning).

    Raises:
      UsageError: the workdir holds this job's result over the data as it was.
    """
    if checkpointer is not None and checkpointer.options.ignore_changed_data:
        _log.warning("the data changed since %s was computed (%s): serving it as already done, since "
                     "ignore_changed_data is set.", root / RESULT, changed)
        return
    raise UsageError(
        f"{root} holds this job's result, computed before the data changed: {changed}; to reduce the new data, "
        f"use a new workdir (or delete {RESULT}, {SUMMARY} and {CHECKPOINTS}/ here); if the rows are the same (a "
        "copy that lost its times), rerun with --config.checkpoint.ignore_changed_data=true "
        "(run_in_workdir(checkpoint=sharded_scan.CheckpointOptions(ignore_changed_data=True)))."
    )


@contextlib.contextmanager
def _entered(progress: Any) -> Iterator[None]:
    """Enters the caller's progress callbacks when they are a context manager, and closes them
    (flushes an event file, stops a trace) also when the run fails; then a failure to close
    them (a full disk under a TensorBoard writer) is logged, never raised over the run's own."""
    if not hasattr(progress, "__exit__"):
        yield
        return
    progress.__enter__()
    try:
        yield
    except BaseException as e:
        try:
            progress.__exit__(type(e), e, e.__traceback__)
        except Exception as closing:  # noqa: BLE001 - the run's error is the one to report
            _log.warning("while stopping the progress callbacks: %s", closing)
        raise
    progress.__exit__(None, None, None)


def _checkpointer(directory: str, checkpoint: Any) -> Checkpointer | None:
    """The workdir's checkpointer (in ``directory``, under the workdir's lease), or None.

    Raises:
      UsageError: ``checkpoint`` is not None or :class:`CheckpointOptions` (the old True, False or dict of
        fields: their new spelling), or it names another directory.
    """
    if checkpoint is None:
        return None
    if not isinstance(checkpoint, (CheckpointOptions, str, os.PathLike)):
        raise not_an_option(checkpoint, "None or sharded_scan.CheckpointOptions(...) naming no directory (the "
                            "workdir's checkpoints/)", "sharded_scan.CheckpointOptions()", "CheckpointOptions(")
    if isinstance(checkpoint, CheckpointOptions) and checkpoint.force_unlock:
        raise UsageError("a workdir's lock covers its checkpoints: pass run_in_workdir(..., force_unlock=True) "
                         "(--force_unlock), not CheckpointOptions(force_unlock=True), which is for run()'s "
                         "checkpoint directories.")
    named = checkpoint if not isinstance(checkpoint, CheckpointOptions) else checkpoint.directory
    if named is not None and where(named) != where(directory):
        raise UsageError(f"a workdir keeps its checkpoints in {directory}: pass checkpoint=sharded_scan."
                         f"CheckpointOptions(...) naming no directory, or None for none; got the directory {named}.")
    options = checkpoint if isinstance(checkpoint, CheckpointOptions) else CheckpointOptions()
    return Checkpointer(dataclasses.replace(options, directory=directory), leased=True)


def row_bytes(source: Source) -> int:
    """Bytes of one row of ``source``."""
    return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(source.spec))


def summary_of(report: RunReport, source: Source) -> dict[str, Any]:
    """What ``summary.json`` says about one run (the job's digest and the caller's record are added)."""
    compute = max(report.seconds - report.compile_seconds, 0.0)
    seconds = max(compute, 1e-9)  # the rates: over the reading and computing, compiling left out
    return {
        "rows": report.rows,
        "rows_this_run": report.rows_this_run,
        "seconds": report.seconds,
        "compile_seconds": report.compile_seconds,
        "compute_seconds": compute,
        "rows_per_second": report.rows_this_run / seconds,
        "bytes_per_second": report.rows_this_run * row_bytes(source) / seconds,
        "steps": report.steps,
        "devices": report.devices,
        "processes": report.processes,
        "mesh": report.mesh,
        "resumed_from_step": report.resumed_from_step,
        "resumed_from_cursor": report.resumed_from_cursor,
        "checkpoints_written": report.checkpoints_written,
        "merge_bytes": report.merge_bytes,
        "passes": report.passes,
        "nonfinite_values": report.nonfinite_values,
    }


def nonfinite_words(count: int, nan_policy: str) -> str:
    """The ``done:`` line's end when ``count`` accumulator values turned NaN or inf: what the result holds, and
    which ``nan_policy`` to use instead (nothing when none did)."""
    if not count:
        return ""
    if nan_policy != "propagate":  # every row folded was finite
        return f"; the result may hold NaN or inf: {count} accumulator values overflowed on finite rows"
    return (f"; the result holds NaN (or inf) from rows holding NaN or Inf ({count} accumulator values; or an "
            "overflow): nan_policy='omit' (--config.nan_policy=omit) skips such rows, 'raise' "
            "(--config.nan_policy=raise) stops at the first and tells an overflow")


def named_arrays(result: Any) -> dict[str, np.ndarray]:
    """The result's arrays by name: NamedTuple fields, dict keys, or ``result``."""
    if isinstance(result, np.ndarray | np.generic | str):  # a str: e.g. GroupByResult.by, the keys' column
        return {"result": np.asarray(result)}
    if hasattr(result, "_asdict"):
        items = result._asdict().items()
    elif isinstance(result, dict):
        items = result.items()
    elif isinstance(result, tuple | list):  # e.g. one result per part of (X, y): "0.count", "1.count"
        items = enumerate(result)
    else:
        leaves = jax.tree_util.tree_leaves_with_path(result)
        items = [(jax.tree_util.keystr(path).strip("[]'.") or "result", leaf) for path, leaf in leaves]
    out: dict[str, np.ndarray] = {}
    for name, value in items:
        inner = named_arrays(value)
        for key, array in inner.items():
            out[str(name) if key == "result" else f"{name}.{key}"] = array
    return out


def write_outputs(workdir: str, result: Any, summary: dict[str, Any], intact: str,
                  outputs: Mapping[str, Render] | None = None) -> dict[str, Any]:
    """Writes result.npz, each of ``outputs`` and, last, summary.json, each atomically (temp file, then
    rename; any epath workdir).

    Every output is rendered before the first write (a render that fails leaves the workdir as it was);
    summary.json, written last, holds each one's digest: ``result_sha256`` of result.npz, and in
    ``outputs_sha256`` each of ``outputs`` by name (None: the result has none, and a file of that name
    left by another job is removed). A crash between the writes leaves a job that is not done
    (:func:`finished`), whose rerun writes them all again. JSON in the one spelling of
    :func:`~sharded_scan.combiners.results.json_text` (NaN null, the infinities ``"inf"``/``"-inf"``).

    Returns the summary as written.

    Raises:
      StorageError: the workdir refused a write; ``intact`` says what is still there.
    """
    arrays = named_arrays(result)
    texts = {name: render(result) for name, render in (outputs or {}).items()}
    texts = {name: text.encode() if isinstance(text, str) else text for name, text in texts.items()}
    root, name = as_path(workdir), RESULT  # name: the file being written
    try:
        root.mkdir(parents=True, exist_ok=True)
        write_atomically(workdir, RESULT, lambda f: np.savez(f, **without_objects(arrays)))
        digests = {}
        for name, data in texts.items():
            if data is None:  # another job's file of the name, if any: not this result's
                with contextlib.suppress(FileNotFoundError):
                    (root / name).unlink()
            else:
                write_atomically(workdir, name, lambda f, data=data: f.write(data))
            digests[name] = None if data is None else hashlib.sha256(data).hexdigest()
        summary = json_value({**summary, RESULT_DIGEST: result_digest(workdir), OUTPUT_DIGESTS: digests})
        name = SUMMARY
        write_atomically(workdir, SUMMARY, lambda f: f.write(json_text(summary, indent=2, default=repr).encode()))
    except OSError as e:
        code = storage_reason(e)
        if code is None:
            raise
        needed = sum(a.nbytes for a in arrays.values()) + sum(len(t or b"") for t in texts.values()) + (64 << 10)
        raise storage_error(f"write {root / name}", code, intact, needed) from None
    return summary


STRING_LENGTHS = ".string_lengths"  # the companion of an array of Python strings in result.npz


def without_objects(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``arrays`` as ``np.savez`` writes them with no pickle: an object array of strings (a ``TopK`` of a string
    column's values) as numpy unicode, which drops trailing NULs, and its strings' lengths beside it
    (``NAME.string_lengths``), from which :func:`load_result` gives back the very strings."""
    out = {}
    for name, array in arrays.items():
        if array.dtype == object and all(isinstance(v, str) for v in array.flat):
            out[name + STRING_LENGTHS] = np.vectorize(len, otypes=[np.int64])(array) if array.size else \
                np.zeros(array.shape, np.int64)
            array = array.astype(str)
        out[name] = array
    return out


def with_objects(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What :func:`without_objects` was given: each array of strings with its trailing NULs, as Python strings."""
    out = {}
    for name, array in arrays.items():
        if name.endswith(STRING_LENGTHS) and name[: -len(STRING_LENGTHS)] in arrays:
            continue
        lengths = arrays.get(name + STRING_LENGTHS)
        if lengths is not None:
            strings = [s + "\0" * (int(n) - len(s)) for s, n in zip(array.flat, lengths.flat, strict=True)]
            array = np.array(strings + [None], dtype=object)[:-1].reshape(array.shape)
        out[name] = array
    return out


def result_digest(workdir: str) -> str:
    """SHA-256 of ``workdir/result.npz``'s bytes (None: it is not there)."""
    return file_digest(as_path(workdir) / RESULT)


def write_atomically(workdir: str, name: str, write: Callable[[Any], Any]) -> None:
    """Writes the file ``name`` of ``workdir`` by ``write(f)`` into a fresh temp file, then a rename.

    Locally the temp file is created anew (``O_CREAT | O_EXCL``: never an existing file or a
    symbolic link someone left there, mode 0644 whatever the umask) and the rename replaces
    a link at ``name`` itself, never its target. On an object store there are no links.
    """
    root = as_path(workdir)
    if is_url(workdir):
        tmp = root / f"{name}.tmp"
        try:
            with tmp.open("wb") as f:
                write(f)
            tmp.replace(root / name)
        finally:
            if tmp.exists():
                tmp.unlink()
        return
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=os.fspath(root))
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, os.path.join(os.fspath(root), name))
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def finished(workdir: str, fingerprint: dict[str, Any], outputs: Mapping[str, Any] = ()) -> dict[str, Any] | None:
    """The summary of the job of ``fingerprint`` when the workdir holds its result and every output,
    else None (reads only: the stamps ``summary.json`` recorded against the fingerprint's, which holds
    digests of the files' bytes too under ``verify_data="digest"``; each output's bytes against its digest).

    ``outputs`` names the files the caller writes beside result.npz (:func:`run_in_workdir`'s): a summary
    that does not cover one (written without it, or by an older version) is not done either.
    The result of the same job over data that changed since (the recorded ``files`` put in the
    fingerprint give the recorded job) comes back with ``data_changed``: which file, as a phrase.
    """
    root = as_path(workdir)
    try:
        summary = json.loads((root / SUMMARY).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or not (root / RESULT).is_file():
        return None
    changed = None
    if summary.get("job") != job_digest(fingerprint):
        if "files" not in summary or summary.get("job") != job_digest({**fingerprint, "files": summary["files"]}):
            return None  # another job (or a summary of an older version, without files)
        changed = files_difference(summary, fingerprint)
    digests = {RESULT: summary.get(RESULT_DIGEST)}
    digests.update(summary.get(OUTPUT_DIGESTS) if isinstance(summary.get(OUTPUT_DIGESTS), dict) else {})
    for name in outputs:
        if name not in digests:
            _log.warning("%s has no digest of %s (written without it): running the job again, from its final "
                         "checkpoint where there is one, to write it.", root / SUMMARY, name)
            return None
    for name, digest in digests.items():
        found = None if digest is None else file_digest(root / name)
        if found != digest:
            _log.warning("%s %s: running the job again, from its final checkpoint where there is one, to write it.",
                         root / name, "is missing" if found is None else
                         f"is not the file {root / SUMMARY} was written with (replaced or damaged)")
            return None
    return summary if changed is None else {**summary, "data_changed": changed}


def file_digest(path: Any) -> str | None:
    """SHA-256 of the bytes of the file ``path`` (local or epath), None when it is not there."""
    try:
        with path.open("rb") as f:
            return stream_digest(f)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


def load_result(workdir: str) -> dict[str, np.ndarray]:
    """The arrays of ``workdir/result.npz`` by name."""
    with (as_path(workdir) / RESULT).open("rb") as f, np.load(f) as arrays:
        return with_objects({k: arrays[k] for k in arrays.files})


def one_line(e: BaseException) -> str:
    """An exception's message (and its cause's) folded into one line."""
    parts = [str(e)] + ([str(e.__cause__)] if e.__cause__ is not None else [])
    lines = [line.strip() for part in parts for line in part.splitlines() if line.strip()]
    if any(line.startswith("Traceback") for line in lines):  # keep the heading and the error itself
        lines = [lines[0], lines[-1]] if not lines[0].startswith("Traceback") else [lines[-1]]
    return " ".join(dict.fromkeys(lines)) or type(e).__name__


def exit_status(error: BaseException | None) -> int:
    """The CLI's exit status for a job that ended with ``error`` (None: it finished).

    0 done or preempted (a checkpoint was saved, or SIGTERM before the first step), 2 a
    usage error, 4 a lost peer (a multi-process job), 5 a storage fault, 130 Ctrl-C before
    the run could save, 143 SIGTERM while a run without checkpoints folded, 1 anything else.
    (3, a stalled job: the step watchdog ends the process itself,
    :data:`sharded_scan.watchdog.EXIT_STALLED`.)
    """
    if error is None or isinstance(error, Preempted):
        return EXIT_DONE
    if isinstance(error, Terminated):  # SIGTERM before the first step: 0; with checkpoints off, mid-run: 143
        return EXIT_DONE if error.saved else EXIT_TERMINATED
    if isinstance(error, UsageError):
        return EXIT_USAGE
    if isinstance(error, StorageError):
        return EXIT_STORAGE
    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(error, Exception) and jax.process_count() > 1 and is_peer_lost(error):
        return EXIT_PEER_LOST
    return EXIT_ERROR


@contextlib.contextmanager
def exits() -> Iterator[None]:
    """Ends the process as the CLI does when the block raises: :func:`exit_status`, one line.

    A preemption prints its line on stdout (status 0); a usage error one ``error:`` line
    on stderr. A storage fault, a lost peer or a Ctrl-C print one ``error:`` line and end
    the process at once (no interpreter shutdown, where orbax's threads or
    ``jax.distributed``'s barrier would add tracebacks or wait for the dead peer).
    Anything else propagates (its traceback, status 1).
    """
    try:
        yield
    except KeyboardInterrupt:
        abort(f"interrupted before the run could save; {RESUME_HINT}.", EXIT_INTERRUPTED)
    except Terminated as e:  # every process raised it together, unless nothing was saved
        if not e.saved:
            abort(str(e), EXIT_TERMINATED)
        print(str(e), flush=True)
        sys.exit(EXIT_DONE)
    except Exception as e:
        status = exit_status(e)
        if status == EXIT_ERROR:
            raise
        if status == EXIT_DONE:
            print(str(e), flush=True)
        elif status == EXIT_USAGE and jax.process_count() == 1:
            print(f"error: {e}", file=sys.stderr, flush=True)
        elif status == EXIT_USAGE:  # the peers are told (and end too, where they met no such error)
            abort(str(e), status)
        elif status == EXIT_STORAGE:
            abort(str(e) if jax.process_count() == 1 else f"process {jax.process_index()}: {e}", status)
        else:
            abort(f"process {jax.process_index()} of {jax.process_count()} lost a peer ({one_line(e)[:160]}); "
                  f"{RESUME_HINT}.", status)
        sys.exit(status)
