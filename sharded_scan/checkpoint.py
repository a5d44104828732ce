"""Checkpoints of a running reduction: per-shard partials, the cursor, the job and the reader's state.

A checkpoint is one orbax step directory under ``options.directory`` named by the
cursor (the next row of the stream to fold), holding three items:

- ``partials``: the accumulator pytree with its leading shard axis, saved sharded
  (every process writes its own shards); under :attr:`CheckpointOptions.compact` the
  partials merged into one state instead, each leaf flat and split over every device
  (every device writes 1/N of one state);
- ``meta``: JSON (:func:`~sharded_scan.checkpoint_digests.checkpoint_meta`, the one schema) with
  ``cursor``, ``steps`` (steps done over all runs), ``shards`` and ``axes`` (how the partials are
  laid out), ``devices``, ``processes``, the ``fingerprint``, a digest of every partial and of the
  source states, and a digest of the meta itself;
- ``source``: every process's ``source.state_at(cursor)``, so a sequential source (an
  iterator with ``get_state``/``set_state``) resumes exactly where the checkpoint was.

The fingerprint names the job: the combiner and its parameters (and the code of a user's
functions), the data (kind, row count, row spec), the requested micro-batch, the
accumulator's leaf dtypes and shapes, and the size and modification time of every file
read (with ``verify_data="digest"`` also the SHA-256 of its bytes). It leaves out the mesh,
so a checkpoint resumes on another mesh.
Checkpoints are written only between steps, so every row is folded exactly once. A
restore checks every digest before it uses a checkpoint: one that fails (a flipped
byte, a truncated file, a killed save, digest fields removed, an HMAC that does not
verify under the operator's key) is set aside into ``damaged/`` and the one before is used.
The digests are checksums against accidents; only the optional key
(:attr:`CheckpointOptions.hmac_key`, or :data:`KEY_ENV`) stops someone who can write the
directory from forging a checkpoint that passes them. One job at a time holds the
directory (:class:`~sharded_scan.lease.Lease`).

In parts: the orbax store (:mod:`sharded_scan.checkpoint_store`), the digests and signature
(:mod:`sharded_scan.checkpoint_digests`), the set-aside of damaged saves
(:mod:`sharded_scan.checkpoint_damage`); here the options, the save policy, the lease and the
job's wording. :meth:`Checkpointer.open` opens one job's checkpoints (the lease taken, damaged
saves set aside, orbax opened) and returns a :class:`CheckpointSession`:
:meth:`~CheckpointSession.restore_latest`, :meth:`~CheckpointSession.poll`,
:attr:`~CheckpointSession.policy` (a :class:`SavePolicy`), :meth:`~CheckpointSession.save` and
:meth:`~CheckpointSession.close`, in any order.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from sharded_scan.checkpoint_damage import aside_target, damaged_steps, move_aside
from sharded_scan.checkpoint_digests import checkpoint_meta, meta_problem, partials_problem
from sharded_scan.checkpoint_store import Damaged, SavedPartials, Store, committed_steps, room_needed, same_shape
from sharded_scan.digest import array_digests, json_digest, keyed_digest
from sharded_scan.distributed import all_processes, barrier, gather_json
from sharded_scan.errors import UsageError
from sharded_scan.identity import files_difference, job_difference, job_digest, with_contents
from sharded_scan.lease import Lease
from sharded_scan.paths import as_path, where
from sharded_scan.storage import check_room, check_writable, storage_error, storage_reason

PyTree = Any
_log = logging.getLogger(__name__)

KEY_ENV = "SHARDED_SCAN_CHECKPOINT_KEY"  # the operator's HMAC key, when CheckpointOptions names none
VERIFY_DATA = ("stamps", "digest")


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """Where and how often :func:`sharded_scan.run` checkpoints.

    ``checkpoint=`` takes it, or a directory (these options' defaults there), or None (no
    checkpoints), the same in :func:`sharded_scan.run` and :func:`sharded_scan.run_in_workdir`;
    a workdir keeps its checkpoints in ``WORKDIR/checkpoints``, so there it names no directory.

    Attributes:
      directory: the checkpoint directory (shared by every process): a local path
        (``str``, ``pathlib.Path``, ``epath.Path``) or a URL such as ``gs://bucket/dir``
        (where orbax, through etils.epath, can write it). Running the same job again with
        it resumes from its latest checkpoint. One job at a time may use it (a lease in
        ``directory/lock.json``; advisory on a remote store). None (the default): the
        workdir's ``checkpoints/`` under :func:`sharded_scan.run_in_workdir`; ``run`` needs one.
      every_steps: save after this many steps; None for no step-based saves.
      every_seconds: save when this many seconds passed since the last save; None for
        no time-based saves.
      keep: how many of the latest checkpoints to keep.
      per_job: at most about this many step-based saves over the whole job: saves are at
        least ``total_steps / per_job`` steps apart, whatever ``every_steps`` says
        (None: no such limit).
      ignore_changed_data: resume even though a file the job reads changed (size or
        modification time; its bytes under ``verify_data="digest"``) since the checkpoint
        was written, and serve a finished job's result although its files changed since.
      force_unlock: take the directory even when the lease says another process holds
        it (only when you know that process is gone); a workdir's lock (which covers its
        checkpoints) is taken by ``run_in_workdir(..., force_unlock=True)`` instead.
      verify_data: how the job tells that a file it reads is the one a checkpoint (or a
        finished job's result) was made from. ``"stamps"`` (default): its size and
        modification time, one ``stat`` a file; a file rewritten with the same size and its
        time put back passes. ``"digest"``: the SHA-256 of its bytes (a copy that lost its
        time is then the same file, a same-size rewrite is not), which costs one
        more read of every input file, in full, by every process, before the job starts
        (and before a finished job answers "already done"): about the time of one pass over
        the data at the disk's or network's rate (SHA-256 itself runs near 1-2 GB/s a core).
        Every format is hashed whole (``.npy``, npy shards, Parquet/Arrow, CSV, a local zarr
        directory; a zarr array at a URL: its metadata files): a Parquet footer's statistics
        would be cheaper but miss values swapped within a row group.
      hmac_key: a secret (bytes or str) that signs every checkpoint's meta (HMAC-SHA256 of
        its digest); a checkpoint whose HMAC is missing or does not verify is set aside and
        never loaded. None: the environment variable ``SHARDED_SCAN_CHECKPOINT_KEY`` if set,
        else no signing. The key is never written anywhere (nor shown in this repr); every
        process of a job needs the same one.
      compact: each save writes ONE state, not one a logical shard: the partials merged by
        the run's own merge (its tree), each leaf flattened and split over every device of
        the mesh, so every device (process) writes 1/N of it in parallel and a save is about
        one state in total, whatever the shard count (per-shard saves: S states). The
        resume puts the merged state in logical shard 0 and identities in the others, on
        any device count, and still counts every row exactly once; but the rows before the
        save are merged in another order than an uninterrupted run merges them, so a result
        after a resume agrees with it to float rounding, not bitwise (integer counts stay
        exact; a sketch's answers within its error bound). Each save also runs a merge (as
        long as the final one; a sum's ``psum`` as a reduce-scatter, each device receiving
        only its 1/N). False (default):
        per-shard saves, bitwise resume, for small shard counts. A checkpoint of either kind
        resumes whatever this option says.
    """

    directory: str | os.PathLike | None = None
    every_steps: int | None = None
    every_seconds: float | None = 600.0
    keep: int = 2
    per_job: int | None = None
    ignore_changed_data: bool = False
    force_unlock: bool = False
    verify_data: str = "stamps"
    hmac_key: bytes | str | None = dataclasses.field(default=None, repr=False, compare=False)
    compact: bool = False

    def __post_init__(self):
        if self.directory is not None and (not isinstance(self.directory, (str, os.PathLike))
                                           or not str(self.directory)):
            raise UsageError(f"checkpoint directory must be a path or None, got {self.directory!r}.")
        if self.directory is not None:
            as_path(self.directory)  # a URL epath cannot open is one line now
        for name in ("every_steps", "every_seconds", "keep", "per_job"):
            value = getattr(self, name)
            if value is None and name != "keep":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer)) or value <= 0:
                raise UsageError(f"checkpoint {name} must be a positive number or None, got {value!r}.")
        for name in ("ignore_changed_data", "force_unlock", "compact"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise UsageError(f"checkpoint {name} must be True or False, got {getattr(self, name)!r}.")
        if self.verify_data not in VERIFY_DATA:
            raise UsageError(f"checkpoint verify_data must be 'stamps' or 'digest', got {self.verify_data!r}.")
        if self.hmac_key is not None and (not isinstance(self.hmac_key, (bytes, str)) or not self.hmac_key):
            raise UsageError("checkpoint hmac_key must be a non-empty bytes or str secret, or None.")

    def key(self) -> bytes | None:
        """The HMAC key: ``hmac_key``, else the environment's ``SHARDED_SCAN_CHECKPOINT_KEY``, else None."""
        key = self.hmac_key if self.hmac_key is not None else os.environ.get(KEY_ENV) or None
        return key.encode() if isinstance(key, str) else key


class SavePolicy:
    """When to save: after ``every_steps`` steps and/or ``every_seconds`` since the last save.

    Like CLU's ``PeriodicAction`` and orbax's save-decision policies. :meth:`late` is
    each process's own clock; the engine agrees on it with the other processes (any
    process late: all save) and passes the answer to :meth:`due`, so every process
    saves at the same step.
    """

    def __init__(self, every_steps: int | None, every_seconds: float | None, per_job: int | None = None):
        self.every_steps, self.every_seconds, self.per_job = every_steps, every_seconds, per_job
        self._last_step, self._last_time = 0, time.monotonic()

    def plan(self, total_steps: int) -> None:
        """Spaces step-based saves at least ``total_steps / per_job`` apart (the job's size)."""
        if self.per_job is not None and self.every_steps is not None:
            self.every_steps = max(self.every_steps, math.ceil(total_steps / self.per_job))

    def late(self) -> bool:
        """Whether ``every_seconds`` passed since the last save, on this process's clock."""
        return self.every_seconds is not None and time.monotonic() - self._last_time >= self.every_seconds

    def due(self, steps: int, late: bool) -> bool:
        """Whether a save is due after ``steps`` steps (over all runs); ``late`` as agreed."""
        return late or (self.every_steps is not None and steps - self._last_step >= self.every_steps)

    def saved(self, steps: int) -> None:
        """Restarts both clocks after a save at ``steps``."""
        self._last_step, self._last_time = steps, time.monotonic()


class Restored(NamedTuple):
    """What :meth:`CheckpointSession.restore_latest` found."""

    partials: PyTree
    cursor: int           # the next row to fold
    steps: int            # steps done over all earlier runs
    source_state: dict    # this process's ``source.state_at(cursor)`` at the save
    meta: dict            # the checkpoint's metadata (``checkpoint_meta``)


def take_lease(directory: str, job: str, force: bool) -> Lease | None:
    """Process 0 takes ``directory`` for the job of digest ``job``; every process gets its answer.

    Returns:
      The held lease on process 0 (release it when the job ends), None on the others.

    Raises:
      UsageError: another job holds the directory, or its lock file cannot be written.
    """
    lease, problem = None, None
    if jax.process_index() == 0:
        lease = Lease(directory, job, force)
        try:
            lease.acquire()
        except UsageError as e:
            lease, problem = None, str(e)
        except OSError as e:
            code = storage_reason(e)
            if code is None:
                raise
            lease, problem = None, str(storage_error(f"take the lease on {directory}", code, "nothing was changed"))
    problem = gather_json(problem)[0]
    if problem is not None:
        raise UsageError(problem)
    return lease


class CheckpointJob(NamedTuple):
    """The job whose checkpoints :meth:`Checkpointer.open` opens: what a restore and a save need of it."""

    like: PyTree                  # the partials' jax.ShapeDtypeStruct leaves, with shardings
    fingerprint: dict[str, Any]   # what names the job; a checkpoint with another one is refused
    shape: dict[str, Any]         # this run's layout of the partials (shard count, non-``data`` axes)
    relayout: Callable[[SavedPartials, dict[str, Any]], PyTree]  # folds and places partials of another shape
    # What a save under CheckpointOptions.compact writes: the partials merged, as flat leaves split
    # over the devices, and their ``shape`` for the meta.
    compact: Callable[[PyTree], tuple[list[jax.Array], dict[str, Any]]]


class Checkpointer:
    """Where and how one job checkpoints, before it is opened: :meth:`open` opens its checkpoints.

    Args:
      options: where and how often.
      leased: the caller holds a lease on the directory or on one above it
        (:func:`sharded_scan.workdir.run_in_workdir` holds its workdir's): take no second one.
    """

    def __init__(self, options: CheckpointOptions, leased: bool = False):
        self.options = options
        self.directory = where(options.directory)  # absolute if local; a URL as given
        self.leased = leased

    def identity(self, fingerprint: dict[str, Any]) -> dict[str, Any]:
        """The fingerprint a checkpoint of the job of ``fingerprint`` must match: with
        ``verify_data="digest"`` every file's SHA-256 added (:func:`~sharded_scan.identity.with_contents`:
        one read of every input file; none when ``fingerprint`` holds them already)."""
        return with_contents(fingerprint) if self.options.verify_data == "digest" else fingerprint

    def open(self, job: CheckpointJob) -> CheckpointSession:
        """Opens ``job``'s checkpoints: every process checks that they hold the same key, takes the
        directory's lease (process 0; not when ``leased``), sets damaged checkpoints aside (one
        agreement) and opens orbax. Every process of the job calls it, then the session's methods
        in the same order (orbax synchronises them).

        Raises:
          UsageError: another job holds the directory, or the processes hold different keys.
          StorageError: the directory is not writable, or a damaged checkpoint cannot be set aside.
        """
        return CheckpointSession(self, job)


class CheckpointSession:
    """One job's checkpoints, open: :meth:`restore_latest`, :meth:`poll`, :meth:`save`, then :meth:`close`.

    Made by :meth:`Checkpointer.open`, which names the job, so a save before a restore (or with none)
    writes the job's checkpoint as well. Saves are asynchronous: :meth:`save` returns once the
    partials are copied off the devices; a save that fails in the background is found by
    :meth:`poll` or :meth:`close`. Storage faults raise a one-line
    :class:`~sharded_scan.errors.StorageError`.

    Attributes:
      directory: the checkpoint directory (absolute if local; a URL as given).
      policy: when to save (:class:`SavePolicy`).
      written: saves started by this session.
      set_aside: the names of the step directories it set aside.
    """

    def __init__(self, checkpointer: Checkpointer, job: CheckpointJob):
        self.options, self.directory = checkpointer.options, checkpointer.directory
        self._root = as_path(self.directory)
        self.set_aside: list[str] = []
        self.policy = SavePolicy(self.options.every_steps, self.options.every_seconds, self.options.per_job)
        self.written = 0
        self._job = job._replace(fingerprint=checkpointer.identity(job.fingerprint))
        self._key = self.options.key()  # read once; never written anywhere
        self._store: Store | None = None
        self._lease: Lease | None = None
        self._pending: tuple[int, int] | None = None  # (cursor, bytes) of the save in flight
        self._failure: BaseException | None = None
        try:
            self._open(checkpointer.leased)
        except BaseException:
            self._release()
            raise

    def _open(self, leased: bool) -> None:
        signed = gather_json(None if self._key is None else keyed_digest(self._key, "sharded_scan checkpoint key"))
        if len(set(signed)) > 1:
            raise UsageError(f"the processes of this job hold different checkpoint keys ({KEY_ENV} or "
                             "CheckpointOptions(hmac_key=...)); give every process the same one.")
        check_writable(self.directory)
        if not leased:
            self._lease = take_lease(self.directory, job_digest(self._job.fingerprint), self.options.force_unlock)
        for name, problem in damaged_steps(self.directory, self._key):
            self._set_aside(name, problem)
        barrier("sharded_scan_checkpoint_scan")
        self._store = Store(self.directory, self.options.keep)

    def restore_latest(self) -> Restored | None:
        """The newest usable checkpoint of this job, or None.

        A checkpoint whose digests do not match its bytes, or that cannot be read, is set aside
        with a warning (all processes agree) and the one before is tried. One laid out as the
        job's ``shape`` is restored in place into ``like``'s shardings (bitwise the state it
        saved); any other (another shard count or mesh axes, or a compact save) is handed to the
        job's ``relayout(saved, meta)`` as :class:`~sharded_scan.checkpoint_store.SavedPartials`,
        whose read checks the digests.

        Raises:
          UsageError: the latest checkpoint belongs to another job, or its data changed (never skipped).
          StorageError: a damaged checkpoint cannot be set aside.
        """
        while (cursor := self._live().latest_step()) is not None:
            restored, problem = None, None
            try:
                restored, verified = self._read(cursor)
            except UsageError:
                raise
            except Exception as e:  # noqa: BLE001 - any read failure means a damaged checkpoint
                problem = " ".join(str(e).split())[:200] or type(e).__name__
            if all_processes(problem is None):
                problem = None if verified else partials_problem(restored.partials, restored.meta)
                if problem is None:
                    _log.info(
                        "resuming from the checkpoint at row %d (step %d, written by %d shards on %d devices) in %s",
                        restored.cursor, restored.steps, restored.meta["shards"], restored.meta.get("devices", 0),
                        self.directory,
                    )
                    return restored
            self._store.close()
            self._set_aside(str(cursor), problem or "another process could not read it")
            barrier(f"sharded_scan_checkpoint_set_aside_{cursor}")
            self._store = Store(self.directory, self.options.keep)
        return None

    def _read(self, cursor: int) -> tuple[Restored, bool]:
        """The checkpoint at ``cursor`` and whether its partials' digests were checked already."""
        job = self._job
        meta = self._store.read_meta(cursor)
        problem = meta_problem(meta, self._key)
        if problem is not None:
            raise Damaged(problem)
        self._check_job(meta, job.fingerprint)
        if same_shape(meta, job.shape):
            partials, verified = self._store.restore_in_place(cursor, job.like), False
        else:
            partials, verified = job.relayout(self._store.saved_partials(cursor, meta), meta), True
        state = self._source_state(cursor, meta)
        return Restored(partials, int(meta["cursor"]), int(meta["steps"]), state, meta), verified

    def save(self, cursor: int, steps: int, partials: PyTree, source_state: dict[str, Any] | None = None) -> None:
        """Starts an async save of ``partials`` as the checkpoint at ``cursor`` (after ``steps`` steps).

        ``source_state`` is this process's ``source.state_at(cursor)``; every process's is
        kept. Under :attr:`CheckpointOptions.compact` the partials are merged first (one state written).

        Raises:
          StorageError: the directory has no room, is read-only or refuses the write
            (checked first, on every process), or an earlier save failed.
        """
        self.raise_failure()
        store = self._live()
        shape = self._job.shape
        if self.options.compact:
            partials, shape = self._job.compact(partials)
        states = gather_json(source_state or {})
        digests = array_digests(partials)
        meta = checkpoint_meta(cursor, steps, self._job.fingerprint, shape, digests, json_digest(states), self._key)
        needed = room_needed(self._root, partials)
        code = next((c for c in gather_json(check_room(self.directory, needed)) if c is not None), None)
        if code is not None:
            raise storage_error(f"save the checkpoint at row {cursor} in {self.directory}", code,
                                self._intact(cursor), needed)
        try:
            store.save(cursor, partials, meta, states)
        except Exception as e:
            code = storage_reason(e)
            if code is None:
                raise
            raise storage_error(f"save the checkpoint at row {cursor} in {self.directory}", code,
                                self._intact(cursor), needed) from None
        self._pending = (int(cursor), needed)
        self.written += 1
        self.policy.saved(steps)

    def poll(self) -> bool:
        """Whether a save has failed (looks at the save in flight without waiting for it)."""
        if self._failure is None and self._pending is not None and not self._store.saving():
            self._wait()  # the save has ended: its failure, if any, comes out of wait now
        return self._failure is not None

    def raise_failure(self) -> None:
        """Raises the failure :meth:`poll` found (a StorageError for a storage fault)."""
        if self._failure is None and self._pending is not None:
            self._wait()
        if self._failure is not None:
            raise self._failure

    def _wait(self) -> None:
        """Waits for the save in flight; records how it failed, if it did."""
        try:
            self._store.wait()
        except Exception as e:  # noqa: BLE001 - recorded, raised by raise_failure
            cursor, needed = self._pending
            code = storage_reason(e)
            self._failure = e if code is None else storage_error(
                f"save the checkpoint at row {cursor} in {self.directory}", code, self._intact(cursor), needed
            )
            if code is not None:
                self._failure.__cause__ = None
        self._pending = None

    def _intact(self, failed: int) -> str:
        """What a failed save at ``failed`` leaves: the checkpoint before it, or none."""
        return intact(self._root, failed)

    def _check_job(self, meta: dict[str, Any], fingerprint: dict[str, Any]) -> None:
        """Refuses a checkpoint of another job, or of data that changed since (unless told to ignore it)."""
        saved = dict(meta.get("fingerprint", {}))
        diff = job_difference(saved, fingerprint)
        if diff is not None:
            was = saved.get("microbatch")
            again = (f"resume with microbatch={was} (--config.microbatch={was}; a default micro-batch may change "
                     "between versions)" if diff.startswith("microbatch ") else
                     "rerun with the original settings and sharded_scan version")
            raise UsageError(
                f"the checkpoint at {self.directory} (cursor {meta.get('cursor')}) belongs to a different job: "
                f"{diff}; {again}, or use a new workdir / checkpoint directory."
            )
        changed = files_difference(saved, fingerprint)
        if changed is None:
            return
        if self.options.ignore_changed_data:
            _log.warning("resuming from the checkpoint at row %s although the data changed since (%s): "
                         "ignore_changed_data is set.", meta.get("cursor"), changed)
            return
        raise UsageError(
            f"the data changed since the checkpoint at row {meta.get('cursor')} in {self.directory} was written: "
            f"{changed}; resume anyway with --config.checkpoint.ignore_changed_data=true "
            "(CheckpointOptions(ignore_changed_data=True)), or start afresh in a new workdir / checkpoint directory."
        )

    def _source_state(self, cursor: int, meta: dict[str, Any]) -> dict[str, Any]:
        """This process's source state saved at ``cursor`` (``{}`` for checkpoints without one)."""
        states = self._store.source_states(cursor)
        if json_digest(states) != meta["source_digest"]:
            raise Damaged("its source state does not match its digest")
        if not states or not any(states):
            return {}
        if len(states) == jax.process_count():
            return states[jax.process_index()]
        if all(s == states[0] for s in states):
            return states[0]
        raise UsageError(
            f"the checkpoint at {self.directory} (cursor {cursor}) holds the reader state of {len(states)} "
            f"processes, which differ; resume it with {len(states)} processes."
        )

    def _set_aside(self, name: str, problem: str) -> None:
        """Moves step directory ``name`` into ``damaged/`` (process 0) with a warning.

        Raises:
          StorageError: the move failed (read-only, no permission); nothing was changed.
        """
        target = aside_target(self._root, name)
        _log.warning(
            "skipping the damaged checkpoint %s in %s (%s); moved it to %s and using the one before it.",
            name, self.directory, problem, target,
        )
        self.set_aside.append(name)
        move_aside(self.directory, name, target, problem)

    def abandon(self) -> None:
        """Drops the manager without waiting for saves in flight (a peer is gone; they cannot finish).

        Their temporary directories are removed when the job starts again.
        """
        self._store = None
        self._release()

    def close(self) -> None:
        """Waits for pending saves, releases orbax's resources and the lease (idempotent).

        Raises:
          StorageError: the last save failed on a storage fault (the one before is intact).
        """
        try:
            if self._store is not None:
                if self._failure is None and self._pending is not None:
                    self._wait()
                store, self._store = self._store, None
                store.close()
            if self._failure is not None:
                raise self._failure
        finally:
            self._release()

    def _live(self) -> Store:
        """The open store (a session closed or abandoned has none: a programming error, not a user's)."""
        if self._store is None:
            raise RuntimeError(f"the checkpoint session of {self.directory} is closed; open the job's checkpoints "
                               "again with Checkpointer.open.")
        return self._store

    def _release(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None


def intact(root: Any, failed: int) -> str:
    """What a failed save at ``failed`` under ``root`` leaves: the checkpoint before it, or none."""
    done = [n for n in committed_steps(root) if n != failed]
    if not done:
        return "no checkpoint was written before it, so a rerun starts from row 0"
    return f"the previous checkpoint at row {max(done)} is intact"


def as_checkpointer(checkpoint: Any) -> Checkpointer | None:
    """``checkpoint=`` of :func:`sharded_scan.run`: None, a directory or :class:`CheckpointOptions` naming
    one (a :class:`Checkpointer`, a workdir's, as it is).

    Raises:
      UsageError: anything else (the workdir's old True, False or dict of fields: their new spelling),
        options that name no directory, or a directory that is not writable.
    """
    if checkpoint is None or isinstance(checkpoint, Checkpointer):
        return checkpoint
    if isinstance(checkpoint, (str, os.PathLike)):
        checkpoint = CheckpointOptions(os.fspath(checkpoint))
    if not isinstance(checkpoint, CheckpointOptions):
        raise not_an_option(checkpoint, "None, a directory or sharded_scan.CheckpointOptions(directory, ...)",
                            "'DIR'", "CheckpointOptions('DIR', ")
    if checkpoint.directory is None:
        raise UsageError("checkpoint=CheckpointOptions(...) names no directory, and only run_in_workdir has one of "
                         "its own (WORKDIR/checkpoints): give it one, checkpoint=sharded_scan.CheckpointOptions('DIR', "
                         "...), or use run_in_workdir.")
    check_writable(where(checkpoint.directory))
    return Checkpointer(checkpoint)


def not_an_option(checkpoint: Any, takes: str, true: str, fields: str) -> UsageError:
    """The one line for a ``checkpoint=`` of another type: what it takes, and, for the retired
    spellings (``True``, ``False``, a dict of :class:`CheckpointOptions` fields), the new one
    (``true``: what ``True`` is now; ``fields``: how a call of CheckpointOptions with fields opens)."""
    if isinstance(checkpoint, bool):
        new = f"checkpoint={true}" if checkpoint else "checkpoint=None"
    elif isinstance(checkpoint, Mapping):
        args = ", ".join(f"{k}={v!r}" for k, v in checkpoint.items())
        new = f"checkpoint=sharded_scan.{fields}{args})".replace(", )", ")")
    else:
        return UsageError(f"checkpoint must be {takes}; got {type(checkpoint).__name__}.")
    return UsageError(f"checkpoint must be {takes}, the same in run and run_in_workdir; got {checkpoint!r}: "
                      f"write {new}.")
