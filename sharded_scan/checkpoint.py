"""Checkpoints of a running reduction: per-shard partials, the cursor, the job and the reader's state.

A checkpoint is one orbax step directory under ``options.directory`` named by the
cursor (the next row of the stream to fold), holding three items:

- ``partials``: the accumulator pytree with its leading shard axis, saved sharded
  (every process writes its own shards);
- ``meta``: JSON (:func:`checkpoint_meta`, the one schema) with ``cursor``, ``steps``
  (steps done over all runs), ``shards`` and ``axes`` (how the partials are laid out),
  ``devices``, ``processes`` and the ``fingerprint``;
- ``source``: every process's ``source.state_at(cursor)``, so a sequential source (an
  iterator with ``get_state``/``set_state``) resumes exactly where the checkpoint was.

The fingerprint names the job: the combiner and its parameters, the data (kind, row
count, row spec), the requested micro-batch and the accumulator's leaf dtypes and
shapes. It leaves out the mesh, so a checkpoint resumes on another mesh.
Checkpoints are written only between steps, so every row is folded exactly once.
:class:`Checkpointer` owns the protocol: :meth:`~Checkpointer.restore_latest`,
:meth:`~Checkpointer.due` (a :class:`SavePolicy`) and :meth:`~Checkpointer.save`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from sharded_scan.errors import UsageError

PyTree = Any
_log = logging.getLogger(__name__)

PARTIALS, META, SOURCE = "partials", "meta", "source"
DAMAGED = "damaged"  # damaged checkpoints are moved here, never loaded
# What orbax (0.12) writes into a step directory before it counts as complete.
COMMIT_MARKER, STEP_METADATA = "commit_success.txt", "_CHECKPOINT_METADATA"


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """Where and how often :func:`sharded_scan.run` checkpoints.

    Attributes:
      directory: the checkpoint directory (shared by every process). Running the same
        job again with it resumes from its latest checkpoint.
      every_steps: save after this many steps; None for no step-based saves.
      every_seconds: save when this many seconds passed since the last save; None for
        no time-based saves.
      keep: how many of the latest checkpoints to keep.
    """

    directory: str
    every_steps: int | None = None
    every_seconds: float | None = 600.0
    keep: int = 2

    def __post_init__(self):
        if not isinstance(self.directory, (str, os.PathLike)) or not str(self.directory):
            raise UsageError(f"checkpoint directory must be a path, got {self.directory!r}.")
        for name in ("every_steps", "every_seconds", "keep"):
            value = getattr(self, name)
            if value is None and name != "keep":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer)) or value <= 0:
                raise UsageError(f"checkpoint {name} must be a positive number or None, got {value!r}.")


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
        return out if out or not prefix else {prefix: {}}
    return {prefix: tree}


def fingerprint_difference(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """The first field where two fingerprints differ, as a phrase; None when equal."""
    old, new = _flat(saved), _flat(current)
    sections = list(dict.fromkeys([*current, *saved]))  # combiner, data, microbatch, accumulator
    keys = list(dict.fromkeys([*new, *old]))
    for key in sorted(keys, key=lambda k: sections.index(k.split(".")[0])):
        if old.get(key, "<absent>") != new.get(key, "<absent>"):
            return f"{key} is {old.get(key, '<absent>')!r} there but {new.get(key, '<absent>')!r} here"
    return None


def _to_flat_dict(tree: PyTree) -> dict[str, Any]:
    # Leaves by position: restores do not depend on how orbax stores NamedTuples.
    return {str(i): leaf for i, leaf in enumerate(jax.tree.leaves(tree))}


class SavePolicy:
    """When to save: after ``every_steps`` steps and/or ``every_seconds`` since the last save.

    Like CLU's ``PeriodicAction`` and orbax's save-decision policies. The time rule is
    decided by process 0 and broadcast, so every process saves at the same step.
    """

    def __init__(self, every_steps: int | None, every_seconds: float | None):
        self.every_steps, self.every_seconds = every_steps, every_seconds
        self._last_step, self._last_time = 0, time.monotonic()

    def due(self, steps: int) -> bool:
        """Whether a save is due after ``steps`` steps (counted over all runs of the job)."""
        if self.every_steps is not None and steps - self._last_step >= self.every_steps:
            return True
        if self.every_seconds is None:
            return False
        late = time.monotonic() - self._last_time >= self.every_seconds
        if jax.process_count() > 1:
            late = bool(multihost_utils.broadcast_one_to_all(np.int32(late)))
        return late

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


def checkpoint_meta(cursor: int, steps: int, fingerprint: dict[str, Any], shape: dict[str, Any]) -> dict[str, Any]:
    """The ``meta`` item of a checkpoint: the one schema, written by :meth:`Checkpointer.save`.

    ``shape`` is how the partials are laid out (``{"shards": S, "axes": {...}}``: shard
    count and the mesh's non-``data`` axes); devices and processes are informational.
    """
    return {
        "cursor": int(cursor),
        "steps": int(steps),
        "fingerprint": fingerprint,
        "shards": int(shape["shards"]),
        "axes": dict(shape["axes"]),
        "devices": jax.device_count(),
        "processes": jax.process_count(),
    }


def same_shape(meta: dict[str, Any], shape: dict[str, Any]) -> bool:
    """Whether a checkpoint's partials are laid out as ``shape`` (restorable in place)."""
    return int(meta["shards"]) == int(shape["shards"]) and dict(meta.get("axes", {})) == dict(shape["axes"])


class Checkpointer:
    """Saves and restores the running state of one job in ``options.directory``.

    A checkpoint holds the partials (sharded: each process writes its own shards), the
    ``meta`` JSON (:func:`checkpoint_meta`) and every process's source state. Every
    process of a job builds one and calls its methods in the same order (orbax
    synchronises them): :meth:`restore_latest` once, then :meth:`due` / :meth:`save`
    between steps, then :meth:`close`. Saves are asynchronous: :meth:`save` returns once
    the partials are copied off the devices.
    """

    def __init__(self, options: CheckpointOptions):
        self.options = options
        self.directory = os.path.abspath(os.fspath(options.directory))
        check_writable(self.directory)
        self.set_aside: list[str] = []
        for name, problem in damaged_steps(self.directory):
            self._set_aside(name, problem)
        _barrier("sharded_scan_checkpoint_scan")
        self._manager = self._open()
        self.policy = SavePolicy(options.every_steps, options.every_seconds)
        self.written = 0
        self._job: tuple[dict[str, Any], dict[str, Any]] | None = None

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
        relayout: Callable[[list[np.ndarray], dict[str, Any]], PyTree],
        shape: dict[str, Any],
    ) -> Restored | None:
        """The newest usable checkpoint of this job, or None; also names the job for :meth:`save`.

        Damaged checkpoints are set aside with a warning (all processes agree) and the
        one before is tried. One laid out as ``shape`` is restored in place into
        ``like``'s shardings (bitwise the state it saved); any other is read as host
        arrays and handed to ``relayout(leaves, meta)``.

        Args:
          like: the partials' ``jax.ShapeDtypeStruct`` leaves, with shardings.
          fingerprint: what names this job; a checkpoint with another one is refused.
          relayout: folds and places partials written with another shape.
          shape: this run's layout of the partials (shard count, non-``data`` axes).

        Raises:
          UsageError: the latest checkpoint belongs to another job (never skipped).
        """
        self._job = (fingerprint, shape)
        while (cursor := self._manager.latest_step()) is not None:
            meta = self._read_meta(cursor)
            self._check_job(meta, fingerprint)
            restored, problem = None, None
            try:
                if same_shape(meta, shape):
                    partials = self._restore_in_place(cursor, like)
                else:
                    partials = relayout(self._restore_host(cursor), meta)
                restored = Restored(partials, int(meta["cursor"]), int(meta["steps"]), self._source_state(cursor),
                                    meta)
            except UsageError:
                raise
            except Exception as e:  # noqa: BLE001 - any read failure means a damaged checkpoint
                problem = " ".join(str(e).split())[:200] or type(e).__name__
            if _all_processes(problem is None):
                _log.info(
                    "resuming from the checkpoint at row %d (step %d, written by %d shards on %d devices) in %s",
                    restored.cursor, restored.steps, meta["shards"], meta.get("devices", 0), self.directory,
                )
                return restored
            self._manager.close()
            self._set_aside(str(cursor), problem or "another process could not read it")
            _barrier(f"sharded_scan_checkpoint_set_aside_{cursor}")
            self._manager = self._open()
        return None

    def save(self, cursor: int, steps: int, partials: PyTree, source_state: dict[str, Any] | None = None) -> None:
        """Starts an async save of ``partials`` as the checkpoint at ``cursor`` (after ``steps`` steps).

        ``source_state`` is this process's ``source.state_at(cursor)``; every process's is
        kept. Call :meth:`restore_latest` first: it names the job.
        """
        if self._job is None:
            raise RuntimeError("Checkpointer.save before restore_latest: the job is not named yet.")
        fingerprint, shape = self._job
        args = ocp.args.Composite(**{
            PARTIALS: ocp.args.PyTreeSave(_to_flat_dict(partials)),
            META: ocp.args.JsonSave(checkpoint_meta(cursor, steps, fingerprint, shape)),
            SOURCE: ocp.args.JsonSave({"processes": _gather_json(source_state or {})}),
        })
        self._manager.save(int(cursor), args=args, force=True)
        self.written += 1
        self.policy.saved(steps)

    def due(self, steps: int) -> bool:
        """Whether a save is due after ``steps`` steps (all processes get the same answer)."""
        return self.policy.due(steps)

    def _read_meta(self, cursor: int) -> dict[str, Any]:
        return self._manager.restore(cursor, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]

    def _check_job(self, meta: dict[str, Any], fingerprint: dict[str, Any]) -> None:
        diff = fingerprint_difference(meta.get("fingerprint", {}), fingerprint)
        if diff is not None:
            raise UsageError(
                f"the checkpoint at {self.directory} (cursor {meta.get('cursor')}) belongs to a different job: "
                f"{diff}; rerun with the original settings, or use a new workdir / checkpoint directory."
            )

    def _restore_in_place(self, cursor: int, like: PyTree) -> PyTree:
        """The partials restored into ``like``'s shardings, after checking the stored dtypes and shapes
        (orbax would cast a dtype silently)."""
        stored = self._manager.item_metadata(cursor)[PARTIALS]
        stored = dict(getattr(stored, "tree", stored) or {})
        want = _to_flat_dict(like)
        for key, leaf in want.items():
            got = stored.get(key)
            if got is None or tuple(got.shape) != tuple(leaf.shape) or np.dtype(got.dtype) != leaf.dtype:
                found = "missing" if got is None else f"{np.dtype(got.dtype).name}{list(got.shape)[1:]}"
                raise UsageError(
                    f"the checkpoint at {self.directory} (cursor {cursor}) belongs to a different job: accumulator "
                    f"leaf {key} is {found} there but {np.dtype(leaf.dtype).name}{list(leaf.shape)[1:]} here; "
                    "rerun with the original settings, or use a new workdir / checkpoint directory."
                )
        restore_args = {k: ocp.ArrayRestoreArgs(sharding=leaf.sharding) for k, leaf in want.items()}
        args = ocp.args.Composite(**{PARTIALS: ocp.args.PyTreeRestore(restore_args=restore_args)})
        flat = self._manager.restore(cursor, args=args)[PARTIALS]
        return jax.tree.structure(like).unflatten([flat[k] for k in want])

    def _restore_host(self, cursor: int) -> list[np.ndarray]:
        """Every saved leaf, whole, as host numpy on every process, in leaf order."""
        stored = self._manager.item_metadata(cursor)[PARTIALS]
        keys = sorted(dict(getattr(stored, "tree", stored) or {}), key=int)
        restore_args = {k: ocp.RestoreArgs(restore_type=np.ndarray) for k in keys}
        args = ocp.args.Composite(**{PARTIALS: ocp.args.PyTreeRestore(restore_args=restore_args)})
        flat = self._manager.restore(cursor, args=args)[PARTIALS]
        return [np.asarray(flat[k]) for k in keys]

    def _source_state(self, cursor: int) -> dict[str, Any]:
        """This process's source state saved at ``cursor`` (``{}`` for checkpoints without one)."""
        if not os.path.isdir(os.path.join(self.directory, str(cursor), SOURCE)):
            return {}
        saved = self._manager.restore(cursor, args=ocp.args.Composite(**{SOURCE: ocp.args.JsonRestore()}))[SOURCE]
        states = list((saved or {}).get("processes", []))
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
        """Moves step directory ``name`` into ``damaged/`` (process 0) with a warning."""
        target = os.path.join(self.directory, DAMAGED, f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
        _log.warning(
            "skipping the damaged checkpoint %s in %s (%s); moved it to %s and using the one before it.",
            name, self.directory, problem, target,
        )
        self.set_aside.append(name)
        if jax.process_index() == 0:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.replace(os.path.join(self.directory, name), target)

    def abandon(self) -> None:
        """Drops the manager without waiting for saves in flight (a peer is gone; they cannot finish).

        Their temporary directories are removed when the job starts again.
        """
        self._manager = None

    def close(self) -> None:
        """Waits for pending saves and releases orbax's resources (idempotent)."""
        if self._manager is not None:
            self._manager.close()
            self._manager = None


def _gather_json(value: Any) -> list[Any]:
    """``value`` (JSON) of every process, in process order, on every process."""
    if jax.process_count() == 1:
        return [value]
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.int32(len(data)))).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: len(data)] = data
    everyone = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
    return [json.loads(bytes(everyone[i, : lengths[i]]).decode()) for i in range(len(lengths))]


def _read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def step_damage(step_dir: str) -> str | None:
    """Why ``step_dir`` is not a complete checkpoint of ours (a phrase), or None.

    Checks what can be checked without reading the arrays: orbax's commit marker and
    step metadata, our ``meta`` item (JSON with a cursor and a fingerprint) and the
    partials' tree metadata. A truncated array shows up only when it is read
    (:meth:`Checkpointer.try_restore`).
    """
    needed = [COMMIT_MARKER, STEP_METADATA, os.path.join(META, "metadata"), os.path.join(PARTIALS, "_METADATA")]
    for name in needed:
        if not os.path.isfile(os.path.join(step_dir, name)):
            return f"{name} is missing"
    try:
        meta = _read_json(os.path.join(step_dir, META, "metadata"))
        _read_json(os.path.join(step_dir, STEP_METADATA))
        _read_json(os.path.join(step_dir, PARTIALS, "_METADATA"))
    except (OSError, ValueError) as e:
        return f"unreadable metadata: {' '.join(str(e).split())[:120]}"
    if not isinstance(meta, dict) or not {"cursor", "steps", "shards", "fingerprint"} <= set(meta):
        return "meta lacks cursor, steps, shards or fingerprint"
    if str(meta["cursor"]) != os.path.basename(step_dir):
        return f"meta says cursor {meta['cursor']}"
    return None


def damaged_steps(directory: str) -> list[tuple[str, str]]:
    """``(name, problem)`` for each step directory under ``directory`` that is damaged."""
    if not os.path.isdir(directory):
        return []
    names = sorted((n for n in os.listdir(directory) if re.fullmatch(r"\d+", n)), key=int)
    found = [(n, step_damage(os.path.join(directory, n))) for n in names]
    return [(n, problem) for n, problem in found if problem is not None]


def _all_processes(ok: bool) -> bool:
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def check_writable(directory: str) -> None:
    """Raises UsageError unless ``directory`` exists or can be created, and is writable."""
    path = directory
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"{directory} is not a writable directory ({path} is not writable); pick another path.")


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
    return Checkpointer(checkpoint)
