"""Checkpoints of a running reduction: per-shard partials, the cursor, the job and the reader's state.

A checkpoint is one orbax step directory under ``options.directory`` named by the
cursor (the next row of the stream to fold), holding three items:

- ``partials``: the accumulator pytree with its leading shard axis, saved sharded
  (every process writes its own shards); under :attr:`CheckpointOptions.compact` the
  partials merged into one state instead, each leaf flat and split over every device
  (every device writes 1/N of one state);
- ``meta``: JSON (:func:`checkpoint_meta`, the one schema) with ``cursor``, ``steps``
  (steps done over all runs), ``shards`` and ``axes`` (how the partials are laid out),
  ``devices``, ``processes``, the ``fingerprint``, a digest of every partial and of the
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
The directory is a local path or a URL (``gs://...``): every look at it goes through
:mod:`etils.epath`, like orbax's own (:mod:`sharded_scan.paths`). orbax is used through its
public API; the local file-system calls made here (a set-aside's move) go through
:mod:`sharded_scan.fs`, where tests inject faults.
:class:`Checkpointer` owns the protocol: :meth:`~Checkpointer.restore_latest`,
:meth:`~Checkpointer.poll`, :attr:`~Checkpointer.policy` (a :class:`SavePolicy`),
:meth:`~Checkpointer.save` and :meth:`~Checkpointer.close`.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import os
import re
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from sharded_scan import fs
from sharded_scan.digest import array_digests, json_digest, keyed_digest, same_digest
from sharded_scan.distributed import all_processes, barrier, gather_json
from sharded_scan.errors import UsageError
from sharded_scan.identity import files_difference, job_difference, job_digest, with_contents
from sharded_scan.lease import Lease
from sharded_scan.paths import as_path, file_size, is_url, where
from sharded_scan.storage import check_room, check_writable, storage_error, storage_reason

PyTree = Any
_log = logging.getLogger(__name__)

PARTIALS, META, SOURCE = "partials", "meta", "source"
DAMAGED = "damaged"  # damaged checkpoints are moved here, never loaded
# The file orbax writes into every step directory last, on any file system. orbax's own
# `is_checkpoint_finalized` checks it on an object store only (a local step counts once renamed),
# so a local step that lost it (a copy or a remote move cut short) would pass: we check it ourselves.
COMMIT_MARKER = ocp.path.atomicity.COMMIT_SUCCESS_FILE
FORMAT = 2  # meta with digests
METADATA_BYTES = 128 << 10  # room a save needs besides its arrays (orbax's metadata, our JSON)
DIGESTS = ("digest", "partials_digests", "source_digest")  # a meta without any of them is refused
KEY_ENV = "SHARDED_SCAN_CHECKPOINT_KEY"  # the operator's HMAC key, when CheckpointOptions names none
VERIFY_DATA = ("stamps", "digest")


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """Where and how often :func:`sharded_scan.run` checkpoints.

    Attributes:
      directory: the checkpoint directory (shared by every process): a local path
        (``str``, ``pathlib.Path``, ``epath.Path``) or a URL such as ``gs://bucket/dir``
        (where orbax, through etils.epath, can write it). Running the same job again with
        it resumes from its latest checkpoint. One job at a time may use it (a lease in
        ``directory/lock.json``; advisory on a remote store).
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
        it (only when you know that process is gone).
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

    directory: str | os.PathLike
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
        if not isinstance(self.directory, (str, os.PathLike)) or not str(self.directory):
            raise UsageError(f"checkpoint directory must be a path, got {self.directory!r}.")
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


def _to_flat_dict(tree: PyTree) -> dict[str, Any]:
    # Leaves by position: restores do not depend on how orbax stores NamedTuples.
    return {str(i): leaf for i, leaf in enumerate(jax.tree.leaves(tree))}


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
    """What :meth:`Checkpointer.restore_latest` found."""

    partials: PyTree
    cursor: int           # the next row to fold
    steps: int            # steps done over all earlier runs
    source_state: dict    # this process's ``source.state_at(cursor)`` at the save
    meta: dict            # the checkpoint's metadata (``checkpoint_meta``)


def checkpoint_meta(
    cursor: int, steps: int, fingerprint: dict[str, Any], shape: dict[str, Any],
    partials_digests: list[str], source_digest: str, key: bytes | None = None,
) -> dict[str, Any]:
    """The ``meta`` item of a checkpoint: the one schema, written by :meth:`Checkpointer.save`.

    ``shape`` is how the partials are laid out (``{"shards": S, "axes": {...}}``: shard
    count and the mesh's non-``data`` axes; a compact save's ``{"shards": 1, "axes": {...},
    "compact": N}``: one merged state, each leaf flat, padded to a multiple of the N devices
    that wrote it); devices and processes are informational.
    ``digest`` covers every other field, and with a ``key``, ``hmac`` signs ``digest``
    (:func:`meta_problem` checks both).
    """
    meta = {
        "format": FORMAT,
        "cursor": int(cursor),
        "steps": int(steps),
        "fingerprint": fingerprint,
        "shards": int(shape["shards"]),
        "axes": dict(shape["axes"]),
        **({"compact": int(shape["compact"])} if shape.get("compact") else {}),
        "devices": jax.device_count(),
        "processes": jax.process_count(),
        "partials_digests": list(partials_digests),
        "source_digest": source_digest,
    }
    meta["digest"] = json_digest(meta)
    return meta if key is None else {**meta, "hmac": keyed_digest(key, meta["digest"])}


def meta_problem(meta: Any, key: bytes | None = None) -> str | None:
    """Why a checkpoint's ``meta`` cannot be trusted (a phrase), or None.

    Its digest fields must be there (a meta without them would turn the checks off) and match;
    with a ``key``, its ``hmac`` must verify (a checkpoint forged by someone without the key).
    """
    if not isinstance(meta, dict) or not {"cursor", "steps", "shards", "fingerprint"} <= set(meta):
        return "meta lacks cursor, steps, shards or fingerprint"
    missing = [name for name in DIGESTS if not isinstance(meta.get(name), list if name == "partials_digests" else str)]
    if missing:
        return f"its meta lacks the digest field{'s' * (len(missing) > 1)} {', '.join(missing)} (removed, or damaged)"
    if json_digest({k: v for k, v in meta.items() if k not in ("digest", "hmac")}) != meta["digest"]:
        return "its meta does not match its digest"
    if key is not None and not isinstance(meta.get("hmac"), str):
        return "its meta has no HMAC although a checkpoint key is set (written without the key, or the HMAC removed)"
    if key is not None and not same_digest(meta["hmac"], keyed_digest(key, meta["digest"])):
        return "its meta's HMAC does not verify under the checkpoint key (written with another key, or forged)"
    return None


def same_shape(meta: dict[str, Any], shape: dict[str, Any]) -> bool:
    """Whether a checkpoint's partials are laid out as ``shape`` (restorable in place; a compact one never is)."""
    return (int(meta["shards"]) == int(shape["shards"]) and dict(meta.get("axes", {})) == dict(shape["axes"])
            and not meta.get("compact"))


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


class Damaged(Exception):  # noqa: N818 - a finding, handled where it is raised
    """A checkpoint's bytes are not what was saved; the message is the problem."""


class SavedPartials:
    """A checkpoint's partials before they are read: the stored leaves' shapes, and :meth:`read`.

    What :meth:`Checkpointer.restore_latest` hands ``relayout`` for a checkpoint it cannot
    restore in place, so that the relayout chooses how they are read.

    Attributes:
      shapes: one ``jax.ShapeDtypeStruct`` a stored leaf, in leaf order (orbax's metadata).
    """

    def __init__(self, manager: ocp.CheckpointManager, cursor: int, meta: dict[str, Any]):
        stored = manager.item_metadata(cursor)[PARTIALS]
        stored = dict(getattr(stored, "tree", stored) or {})
        self._manager, self._cursor, self._meta = manager, cursor, meta
        self._keys = sorted(stored, key=int)
        self.shapes = [jax.ShapeDtypeStruct(tuple(stored[k].shape), np.dtype(stored[k].dtype)) for k in self._keys]

    def read(self, shardings: list[jax.sharding.Sharding] | None = None) -> list[Any]:
        """Every stored leaf, its digest checked: with ``shardings`` (one a leaf) as global arrays of
        which each process reads only its own devices' share; without, whole, as host numpy on every
        process.

        Raises:
          Damaged: a leaf does not match its digest.
        """
        if shardings is None:
            restore_args = {k: ocp.RestoreArgs(restore_type=np.ndarray) for k in self._keys}
        else:
            restore_args = {k: ocp.ArrayRestoreArgs(sharding=s) for k, s in zip(self._keys, shardings, strict=True)}
        args = ocp.args.Composite(**{PARTIALS: ocp.args.PyTreeRestore(restore_args=restore_args)})
        flat = self._manager.restore(self._cursor, args=args)[PARTIALS]
        leaves = [flat[k] if shardings is not None else np.asarray(flat[k]) for k in self._keys]
        problem = _leaf_problem(array_digests(leaves), self._meta)  # every process: one reduction over all
        if problem is not None:
            raise Damaged(problem)
        return leaves


class Checkpointer:
    """Saves and restores the running state of one job in ``options.directory``.

    A checkpoint holds the partials (sharded: each process writes its own shards), the
    ``meta`` JSON (:func:`checkpoint_meta`) and every process's source state. Every
    process of a job builds one and calls its methods in the same order (orbax
    synchronises them): :meth:`restore_latest` once (it takes the directory's lease,
    sets damaged checkpoints aside and opens orbax), then :meth:`poll`, :meth:`save`
    between steps, then :meth:`close`. Saves are asynchronous: :meth:`save` returns once
    the partials are copied off the devices; a save that fails in the background is
    found by :meth:`poll` or :meth:`close`. Storage faults raise a one-line
    :class:`~sharded_scan.errors.StorageError`.

    Args:
      options: where and how often.
      leased: the caller holds a lease on the directory or on one above it
        (:func:`sharded_scan.workdir.run_in_workdir` holds its workdir's): take no second one.
    """

    def __init__(self, options: CheckpointOptions, leased: bool = False):
        self.options = options
        self.directory = where(options.directory)  # absolute if local; a URL as given
        self._root = as_path(self.directory)
        self.leased = leased
        self.set_aside: list[str] = []
        self.policy = SavePolicy(options.every_steps, options.every_seconds, options.per_job)
        self.written = 0
        self._manager: ocp.CheckpointManager | None = None
        self._lease: Lease | None = None
        self._job: tuple[dict[str, Any], dict[str, Any]] | None = None
        self._compact: Callable[[PyTree], tuple[list[jax.Array], dict[str, Any]]] | None = None
        self._pending: tuple[int, int] | None = None  # (cursor, bytes) of the save in flight
        self._failure: BaseException | None = None
        self._key = options.key()  # read once; never written anywhere

    def identity(self, fingerprint: dict[str, Any]) -> dict[str, Any]:
        """The fingerprint a checkpoint of the job of ``fingerprint`` must match: with
        ``verify_data="digest"`` every file's SHA-256 added (:func:`~sharded_scan.identity.with_contents`:
        one read of every input file; none when ``fingerprint`` holds them already)."""
        return with_contents(fingerprint) if self.options.verify_data == "digest" else fingerprint

    def _open(self) -> ocp.CheckpointManager:
        return ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=int(self.options.keep), create=True, cleanup_tmp_directories=True
            ),
            item_handlers={
                PARTIALS: ocp.PyTreeCheckpointHandler(),
                META: ocp.JsonCheckpointHandler(),
                SOURCE: ocp.JsonCheckpointHandler(),
            },
        )

    def restore_latest(
        self,
        like: PyTree,
        fingerprint: dict[str, Any],
        relayout: Callable[[SavedPartials, dict[str, Any]], PyTree],
        shape: dict[str, Any],
        compact: Callable[[PyTree], tuple[list[jax.Array], dict[str, Any]]] | None = None,
    ) -> Restored | None:
        """The newest usable checkpoint of this job, or None; also names the job for :meth:`save`.

        Takes the directory's lease first (one job at a time; not when ``leased``). A checkpoint whose
        digests do not match its bytes, or that cannot be read, is set aside with a
        warning (all processes agree) and the one before is tried. One laid out as
        ``shape`` is restored in place into ``like``'s shardings (bitwise the state it
        saved); any other (another shard count or mesh axes, or a compact save) is handed to
        ``relayout(saved, meta)`` as :class:`SavedPartials`, whose read checks the digests.

        Args:
          like: the partials' ``jax.ShapeDtypeStruct`` leaves, with shardings.
          fingerprint: what names this job; a checkpoint with another one is refused.
          relayout: folds and places partials written with another shape.
          shape: this run's layout of the partials (shard count, non-``data`` axes).
          compact: what a save under :attr:`CheckpointOptions.compact` writes: the partials
            merged, as flat leaves split over the devices, and their ``shape`` for the meta.

        Raises:
          UsageError: another job holds the directory, the latest checkpoint belongs to
            another job, or its data changed (never skipped).
          StorageError: a damaged checkpoint cannot be set aside.
        """
        fingerprint = self.identity(fingerprint)
        self._job, self._compact = (fingerprint, shape), compact
        signed = gather_json(None if self._key is None else keyed_digest(self._key, "sharded_scan checkpoint key"))
        if len(set(signed)) > 1:
            raise UsageError(f"the processes of this job hold different checkpoint keys ({KEY_ENV} or "
                             "CheckpointOptions(hmac_key=...)); give every process the same one.")
        check_writable(self.directory)
        if not self.leased:
            self._lease = take_lease(self.directory, job_digest(fingerprint), self.options.force_unlock)
        for name, problem in damaged_steps(self.directory, self._key):
            self._set_aside(name, problem)
        barrier("sharded_scan_checkpoint_scan")
        self._manager = self._open()
        while (cursor := self._manager.latest_step()) is not None:
            restored, problem = None, None
            try:
                restored, verified = self._read(cursor, like, fingerprint, relayout, shape)
            except UsageError:
                raise
            except Exception as e:  # noqa: BLE001 - any read failure means a damaged checkpoint
                problem = " ".join(str(e).split())[:200] or type(e).__name__
            if all_processes(problem is None):
                problem = None if verified else self._digest_problem(restored.partials, restored.meta)
                if problem is None:
                    _log.info(
                        "resuming from the checkpoint at row %d (step %d, written by %d shards on %d devices) in %s",
                        restored.cursor, restored.steps, restored.meta["shards"], restored.meta.get("devices", 0),
                        self.directory,
                    )
                    return restored
            self._manager.close()
            self._set_aside(str(cursor), problem or "another process could not read it")
            barrier(f"sharded_scan_checkpoint_set_aside_{cursor}")
            self._manager = self._open()
        return None

    def _read(self, cursor, like, fingerprint, relayout, shape) -> tuple[Restored, bool]:
        """The checkpoint at ``cursor`` and whether its partials' digests were checked already."""
        meta = self._read_meta(cursor)
        problem = meta_problem(meta, self._key)
        if problem is not None:
            raise Damaged(problem)
        self._check_job(meta, fingerprint)
        if same_shape(meta, shape):
            partials, verified = self._restore_in_place(cursor, like), False
        else:
            partials, verified = relayout(SavedPartials(self._manager, cursor, meta), meta), True
        state = self._source_state(cursor, meta)
        return Restored(partials, int(meta["cursor"]), int(meta["steps"]), state, meta), verified

    @staticmethod
    def _digest_problem(partials: PyTree, meta: dict[str, Any]) -> str | None:
        return _leaf_problem(array_digests(partials), meta)  # one reduction over every process's shards

    def save(self, cursor: int, steps: int, partials: PyTree, source_state: dict[str, Any] | None = None) -> None:
        """Starts an async save of ``partials`` as the checkpoint at ``cursor`` (after ``steps`` steps).

        ``source_state`` is this process's ``source.state_at(cursor)``; every process's is
        kept. Call :meth:`restore_latest` first: it names the job. Under
        :attr:`CheckpointOptions.compact` the partials are merged first (one state written).

        Raises:
          StorageError: the directory has no room, is read-only or refuses the write
            (checked first, on every process), or an earlier save failed.
        """
        if self._job is None or self._manager is None:
            raise RuntimeError("Checkpointer.save before restore_latest: the job is not named yet.")
        self.raise_failure()
        fingerprint, shape = self._job
        if self.options.compact:
            if self._compact is None:
                raise RuntimeError("Checkpointer.save: compact saves need restore_latest(..., compact=...).")
            partials, shape = self._compact(partials)
        states = gather_json(source_state or {})
        digests = array_digests(partials)
        meta = checkpoint_meta(cursor, steps, fingerprint, shape, digests, json_digest(states), self._key)
        needed = self._room_needed(partials)
        code = next((c for c in gather_json(check_room(self.directory, needed)) if c is not None), None)
        if code is not None:
            raise storage_error(f"save the checkpoint at row {cursor} in {self.directory}", code,
                                self._intact(cursor), needed)
        args = ocp.args.Composite(**{
            PARTIALS: ocp.args.PyTreeSave(_to_flat_dict(partials)),
            META: ocp.args.JsonSave(meta),
            SOURCE: ocp.args.JsonSave({"processes": states}),
        })
        try:
            self._manager.save(int(cursor), args=args, force=True)
        except Exception as e:
            code = storage_reason(e)
            if code is None:
                raise
            raise storage_error(f"save the checkpoint at row {cursor} in {self.directory}", code,
                                self._intact(cursor), needed) from None
        self._pending = (int(cursor), needed)
        self.written += 1
        self.policy.saved(steps)

    def _room_needed(self, partials: PyTree) -> int:
        """Bytes the next save needs: a quarter more than the last checkpoint took on disk
        (orbax compresses), or, before there is one, the partials' raw bytes."""
        done = _committed_steps(self._root)
        if done:
            return int(1.25 * _disk_bytes(self._root / str(done[-1]))) + METADATA_BYTES
        return sum(int(x.size) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(partials)) + METADATA_BYTES

    def poll(self) -> bool:
        """Whether a save has failed (looks at the save in flight without waiting for it)."""
        if self._failure is None and self._pending is not None and not self._manager.is_saving_in_progress():
            self._wait()  # the save has ended: its failure, if any, comes out of wait_until_finished now
        return self._failure is not None

    def raise_failure(self) -> None:
        """Raises the failure :meth:`poll` found (a StorageError for a storage fault)."""
        if self._failure is None and self._pending is not None:
            self._wait()
        if self._failure is not None:
            raise self._failure

    def _wait(self) -> None:
        """Waits for the save in flight; records how it failed, if it did.

        orbax's finalize thread takes the background write's error (so the manager's
        ``check_for_errors()`` no longer sees it) and ``wait_until_finished()`` raises it.
        """
        try:
            self._manager.wait_until_finished()
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
        done = [n for n in _committed_steps(self._root) if n != failed]
        if not done:
            return "no checkpoint was written before it, so a rerun starts from row 0"
        return f"the previous checkpoint at row {max(done)} is intact"

    def _read_meta(self, cursor: int) -> dict[str, Any]:
        return self._manager.restore(cursor, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]

    def _check_job(self, meta: dict[str, Any], fingerprint: dict[str, Any]) -> None:
        """Refuses a checkpoint of another job, or of data that changed since (unless told to ignore it)."""
        saved = dict(meta.get("fingerprint", {}))
        diff = job_difference(saved, fingerprint)
        if diff is not None:
            raise UsageError(
                f"the checkpoint at {self.directory} (cursor {meta.get('cursor')}) belongs to a different job: "
                f"{diff}; rerun with the original settings, or use a new workdir / checkpoint directory."
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

    def _restore_in_place(self, cursor: int, like: PyTree) -> PyTree:
        """The partials restored into ``like``'s shardings, after checking the stored dtypes and shapes
        (orbax would cast a dtype silently; the fingerprint matched, so a mismatch is damage)."""
        stored = self._manager.item_metadata(cursor)[PARTIALS]
        stored = dict(getattr(stored, "tree", stored) or {})
        want = _to_flat_dict(like)
        for key, leaf in want.items():
            got = stored.get(key)
            if got is None or tuple(got.shape) != tuple(leaf.shape) or np.dtype(got.dtype) != leaf.dtype:
                found = "missing" if got is None else f"{np.dtype(got.dtype).name}{list(got.shape)}"
                raise Damaged(f"its partials' metadata says leaf {key} is {found}, not "
                              f"{np.dtype(leaf.dtype).name}{list(leaf.shape)}")
        restore_args = {k: ocp.ArrayRestoreArgs(sharding=leaf.sharding) for k, leaf in want.items()}
        args = ocp.args.Composite(**{PARTIALS: ocp.args.PyTreeRestore(restore_args=restore_args)})
        flat = self._manager.restore(cursor, args=args)[PARTIALS]
        return jax.tree.structure(like).unflatten([flat[k] for k in want])

    def _source_state(self, cursor: int, meta: dict[str, Any]) -> dict[str, Any]:
        """This process's source state saved at ``cursor`` (``{}`` for checkpoints without one)."""
        if not (self._root / str(cursor) / SOURCE).is_dir():
            raise Damaged("its source item is missing")
        saved = self._manager.restore(cursor, args=ocp.args.Composite(**{SOURCE: ocp.args.JsonRestore()}))[SOURCE]
        states = list((saved or {}).get("processes", []))
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
        target = self._root / DAMAGED / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        _log.warning(
            "skipping the damaged checkpoint %s in %s (%s); moved it to %s and using the one before it.",
            name, self.directory, problem, target,
        )
        self.set_aside.append(name)
        code = None
        if jax.process_index() == 0:
            try:
                if is_url(self.directory):
                    _move_remote(self._root / name, target)
                else:  # one atomic rename
                    fs.ops().makedirs(target.parent, exist_ok=True)
                    fs.ops().replace(os.path.join(self.directory, name), target)
            except OSError as e:
                code = storage_reason(e) or e.errno or errno.EIO
        code = gather_json(code)[0]
        if code is not None:
            raise storage_error(f"set aside the damaged checkpoint {name} in {self.directory} ({problem})", code,
                                "nothing was moved or deleted")

    def abandon(self) -> None:
        """Drops the manager without waiting for saves in flight (a peer is gone; they cannot finish).

        Their temporary directories are removed when the job starts again.
        """
        self._manager = None
        self._release()

    def close(self) -> None:
        """Waits for pending saves, releases orbax's resources and the lease (idempotent).

        Raises:
          StorageError: the last save failed on a storage fault (the one before is intact).
        """
        try:
            if self._manager is not None:
                if self._failure is None and self._pending is not None:
                    self._wait()
                manager, self._manager = self._manager, None
                try:
                    manager.close()
                except Exception:  # noqa: BLE001 - a failed save was recorded by _wait; close once more
                    manager.close()
            if self._failure is not None:
                raise self._failure
        finally:
            self._release()

    def _release(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None


def _leaf_problem(digests: list[str], meta: dict[str, Any]) -> str | None:
    """Whether the partials' digests match the ones saved in ``meta``."""
    saved = meta["partials_digests"]
    bad = [i for i, (a, b) in enumerate(zip(digests, saved, strict=False)) if a != b]
    if bad or len(digests) != len(saved):
        return f"its partials do not match their digests (leaf {bad[0] if bad else len(saved)})"
    return None


def _copy_tree(source: epath.Path, target: epath.Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for child in source.iterdir():
        if child.is_dir():
            _copy_tree(child, target / child.name)
        else:
            child.copy(target / child.name)


def _move_remote(source: epath.Path, target: epath.Path) -> None:
    """Moves a step directory on an object store, which has no rename of a directory: every file
    copied, then the commit marker deleted before the rest (a move cut short leaves the step
    incomplete, so set aside again, never a checkpoint that looks whole)."""
    _copy_tree(source, target)
    (source / COMMIT_MARKER).unlink(missing_ok=True)
    source.rmtree()


def _disk_bytes(directory: epath.Path) -> int:
    """Bytes of the files under ``directory`` (remote: one listing a directory, one stat a file)."""
    return sum(_disk_bytes(p) if p.is_dir() else file_size(p) for p in directory.iterdir())


def _step_names(directory: epath.Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if re.fullmatch(r"\d+", p.name))


def _committed_steps(directory: epath.Path) -> list[int]:
    """The step names under ``directory`` with orbax's commit marker, oldest first.

    Read from the directory, not the manager's ``all_steps()``: a save drops the steps it
    will delete from that list when it starts, so after a failed save it would miss a
    checkpoint still intact on disk.
    """
    return [n for n in _step_names(directory) if (directory / str(n) / COMMIT_MARKER).is_file()]


def step_damage(step_dir: str | os.PathLike, key: bytes | None = None) -> str | None:
    """Why ``step_dir`` is not a complete checkpoint of ours (a phrase), or None.

    Checks what can be checked without reading the arrays: orbax's commit marker and
    step metadata, our ``meta`` item (JSON with a cursor, a fingerprint and every digest
    field, matching its digest; with a ``key``, its HMAC) and the partials' tree metadata.
    A flipped byte in the arrays shows up when they are read and their digests checked
    (:meth:`Checkpointer.restore_latest`).
    """
    step = as_path(step_dir)
    if not (step / COMMIT_MARKER).is_file():
        return f"{COMMIT_MARKER} is missing"
    try:
        ocp.metadata.get_step_metadata(step)
        meta = ocp.JsonCheckpointHandler().restore(step / META)
        # Parsed here: the handler's public metadata() opens every array (tensorstore, remote too).
        json.loads((step / PARTIALS / ocp.path.format_utils.PYTREE_METADATA_FILE).read_text())
    except Exception as e:  # noqa: BLE001 - a file missing or garbled in any way is damage
        return f"unreadable metadata: {' '.join(str(e).split())[:120]}"
    problem = meta_problem(meta, key)
    if problem is not None:
        return problem
    if str(meta["cursor"]) != step.name:
        return f"meta says cursor {meta['cursor']}"
    return None


def damaged_steps(directory: str | os.PathLike, key: bytes | None = None) -> list[tuple[str, str]]:
    """``(name, problem)`` for each step directory under ``directory`` that is damaged (or, with
    a ``key``, not signed by it)."""
    root = as_path(directory)
    found = [(str(n), step_damage(root / str(n), key)) for n in _step_names(root)]
    return [(n, problem) for n, problem in found if problem is not None]


def as_checkpointer(checkpoint: Any) -> Checkpointer | None:
    """Accepts None, a path, :class:`CheckpointOptions` or a :class:`Checkpointer`."""
    if checkpoint is None or isinstance(checkpoint, Checkpointer):
        return checkpoint
    if isinstance(checkpoint, (str, os.PathLike)):
        checkpoint = CheckpointOptions(os.fspath(checkpoint))
    if not isinstance(checkpoint, CheckpointOptions):
        raise UsageError(
            "checkpoint must be None, a directory, CheckpointOptions or a Checkpointer; "
            f"got {type(checkpoint).__name__}."
        )
    check_writable(where(checkpoint.directory))
    return Checkpointer(checkpoint)
