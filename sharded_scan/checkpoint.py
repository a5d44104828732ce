"""Checkpoints of a running reduction: per-shard partials, the cursor and a fingerprint.

A checkpoint is one orbax step directory under ``options.directory`` named by the
cursor (the next row of the stream to fold), holding two items:

- ``partials``: the accumulator pytree with its leading shard axis, saved sharded
  (every process writes its own shards);
- ``meta``: JSON with ``cursor``, ``steps`` (steps done over all runs), ``shards``,
  ``devices``, ``processes`` and the ``fingerprint``.

The fingerprint names the job: the combiner and its parameters, the data (kind, row
count, row spec), the requested micro-batch and the accumulator's leaf dtypes and
shapes. It leaves out the device count, so a checkpoint resumes on another mesh.
Checkpoints are written only between steps, so every row is folded exactly once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from sharded_scan.errors import UsageError

PyTree = Any
_log = logging.getLogger(__name__)

PARTIALS, META = "partials", "meta"
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


def accumulator_spec(combiner: Any, spec: PyTree) -> list[str]:
    """The accumulator's leaves as ``"path: dtype[shape]"`` for ONE shard."""
    shapes = jax.eval_shape(combiner.init, spec)
    return [
        f"{jax.tree_util.keystr(path)}: {np.dtype(leaf.dtype).name}{list(leaf.shape)}"
        for path, leaf in jax.tree_util.tree_leaves_with_path(shapes)
    ]


def fingerprint(combiner: Any, source: Any, microbatch: int) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: combiner, data, micro-batch, accumulator."""
    raw = {
        "combiner": combiner.fingerprint(),
        "data": source.describe(),
        "microbatch": int(microbatch),
        "accumulator": accumulator_spec(combiner, source.spec),
    }
    return json.loads(json.dumps(raw, default=repr))  # tuples -> lists, as JSON gives them back


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


class Checkpointer:
    """Saves and restores the running state of one job in ``options.directory``.

    Every process of a multi-process job builds one and calls every method in the same
    order (orbax synchronises them). Saves are asynchronous: :meth:`save` returns once
    the partials are copied off the devices; :meth:`wait` blocks until they are on disk.
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
        self.written = 0
        self._last_step, self._last_time = 0, time.monotonic()

    def _open(self) -> ocp.CheckpointManager:
        return ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=int(self.options.keep), create=True, cleanup_tmp_directories=True
            ),
            item_handlers={PARTIALS: ocp.PyTreeCheckpointHandler(), META: ocp.JsonCheckpointHandler()},
        )

    def latest(self) -> int | None:
        """The cursor of the latest complete checkpoint, or None."""
        return self._manager.latest_step()

    def candidates(self) -> Iterator[int]:
        """Cursors to resume from, newest first; each one :meth:`try_restore` set aside drops out."""
        while (cursor := self.latest()) is not None:
            yield cursor

    def try_restore(self, cursor: int, restore: Callable[[], PyTree]) -> PyTree | None:
        """``restore()``, or None after setting the checkpoint at ``cursor`` aside as damaged.

        A UsageError (a checkpoint of another job) passes through: that is never skipped.

        Every process gets the same answer: when one of them failed to read its part,
        all of them set it aside and go on to the previous checkpoint.
        """
        try:
            restored, problem = restore(), None
        except UsageError:
            raise
        except Exception as e:  # noqa: BLE001 - any read failure means a damaged checkpoint
            restored, problem = None, " ".join(str(e).split())[:200] or type(e).__name__
        if not _all_processes(problem is None):
            self._manager.close()
            self._set_aside(str(cursor), problem or "another process could not read it")
            _barrier(f"sharded_scan_checkpoint_set_aside_{cursor}")
            self._manager = self._open()
            return None
        return restored

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

    def read_meta(self, cursor: int) -> dict[str, Any]:
        """The ``meta`` item of the checkpoint at ``cursor``."""
        return self._manager.restore(cursor, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]

    def verify(self, meta: dict[str, Any], current: dict[str, Any], like: PyTree) -> None:
        """Raises UsageError unless the checkpoint was written by the same job.

        Compares the fingerprints, then the saved arrays' dtypes and shapes with ``like``
        (orbax would cast a dtype silently).
        """
        where = f"the checkpoint at {self.directory} (cursor {meta.get('cursor')})"
        diff = fingerprint_difference(meta.get("fingerprint", {}), current)
        if diff is None:
            stored = self._manager.item_metadata(meta["cursor"])[PARTIALS]
            stored = dict(getattr(stored, "tree", stored) or {})
            want = _to_flat_dict(like)
            for key, leaf in want.items():
                got = stored.get(key)
                got_shape = None if got is None else tuple(got.shape)[1:]
                if got is None or got_shape != tuple(leaf.shape)[1:] or np.dtype(got.dtype) != leaf.dtype:
                    found = "missing" if got is None else f"{np.dtype(got.dtype).name}{list(got_shape)}"
                    diff = f"accumulator leaf {key} is {found} there but {leaf.dtype.name}{list(leaf.shape[1:])} here"
                    break
        if diff is not None:
            raise UsageError(
                f"{where} belongs to a different job: {diff}; rerun with the original settings, "
                "or use a new workdir / checkpoint directory."
            )

    def restore_partials(self, cursor: int, like: PyTree, sharding: Any = None) -> PyTree:
        """Restores the partials saved at ``cursor``, shaped like ``like``.

        Args:
          cursor: the checkpoint's cursor.
          like: a pytree with the structure and leaf dtypes of the accumulators.
          sharding: restore sharded jax.Arrays with this sharding (the saved leading axis
            must equal the current one); None restores full host numpy arrays on every
            process (to fold them when the shard count changed).
        """
        if sharding is None:
            restore_args = {k: ocp.RestoreArgs(restore_type=np.ndarray) for k in _to_flat_dict(like)}
        else:
            restore_args = {k: ocp.ArrayRestoreArgs(sharding=sharding) for k in _to_flat_dict(like)}
        args = ocp.args.Composite(**{PARTIALS: ocp.args.PyTreeRestore(restore_args=restore_args)})
        flat = self._manager.restore(cursor, args=args)[PARTIALS]
        treedef = jax.tree.structure(like)
        return treedef.unflatten([flat[str(i)] for i in range(treedef.num_leaves)])

    def due(self, steps: int) -> bool:
        """Whether a save is due after ``steps`` steps (all processes get the same answer).

        The time rule is decided by process 0 and broadcast, so every process saves at the
        same step.
        """
        every_steps, every_seconds = self.options.every_steps, self.options.every_seconds
        if every_steps is not None and steps - self._last_step >= every_steps:
            return True
        if every_seconds is None:
            return False
        late = time.monotonic() - self._last_time >= every_seconds
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            late = bool(multihost_utils.broadcast_one_to_all(np.int32(late)))
        return late

    def save(self, cursor: int, steps: int, partials: PyTree, meta: dict[str, Any]) -> None:
        """Starts an async save of ``partials`` with ``meta`` as the checkpoint at ``cursor``."""
        meta = {**meta, "cursor": int(cursor), "steps": int(steps)}
        args = ocp.args.Composite(
            **{PARTIALS: ocp.args.PyTreeSave(_to_flat_dict(partials)), META: ocp.args.JsonSave(meta)}
        )
        self._manager.save(int(cursor), args=args, force=True)
        self.written += 1
        self._last_step, self._last_time = steps, time.monotonic()

    def wait(self) -> None:
        """Blocks until every started save is on disk."""
        self._manager.wait_until_finished()

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
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

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
