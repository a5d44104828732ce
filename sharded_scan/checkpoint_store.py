"""The checkpoint store: orbax's step directories under one directory, read and written through its public API.

A checkpoint is one orbax step directory named by the cursor (the next row of the stream to
fold), holding three items: ``partials`` (the accumulator pytree with its leading shard axis,
saved sharded, its leaves by position; a compact save's merged state, each leaf flat and split
over every device), ``meta`` (JSON: :func:`~sharded_scan.checkpoint_digests.checkpoint_meta`) and
``source`` (every process's source state). :class:`Store` opens one directory's orbax
``CheckpointManager`` and does what the checkpointer asks of it (read a step's meta, partials and
source states, save one, wait for it, close); :class:`SavedPartials` is a checkpoint's partials
before they are read. What the store finds wrong with a step it raises as :class:`Damaged`. The
directory is a local path or a URL: every look at it goes through :mod:`etils.epath`, like orbax's own.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

import jax
import numpy as np
from etils import epath

from sharded_scan.checkpoint_digests import leaf_problem
from sharded_scan.digest import array_digests
from sharded_scan.paths import as_path, file_size

PyTree = Any


class _Orbax:
    """``orbax.checkpoint``, imported at its first use: a job without checkpoints never pays for it
    (about 0.3 s of a process's start)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(importlib.import_module("orbax.checkpoint"), name)


ocp = _Orbax()
PARTIALS, META, SOURCE = "partials", "meta", "source"
# The file orbax writes into every step directory last, on any file system. orbax's own
# `is_checkpoint_finalized` checks it on an object store only (a local step counts once renamed),
# so a local step that lost it (a copy or a remote move cut short) would pass: we check it ourselves.
COMMIT_MARKER = "commit_success.txt"  # ocp.path.atomicity.COMMIT_SUCCESS_FILE (a test checks they agree)
METADATA_BYTES = 128 << 10  # room a save needs besides its arrays (orbax's metadata, our JSON)


def to_flat_dict(tree: PyTree) -> dict[str, Any]:
    # Leaves by position: restores do not depend on how orbax stores NamedTuples.
    return {str(i): leaf for i, leaf in enumerate(jax.tree.leaves(tree))}


class Damaged(Exception):  # noqa: N818 - a finding, handled where it is raised
    """A checkpoint's bytes are not what was saved; the message is the problem."""


def same_shape(meta: dict[str, Any], shape: dict[str, Any]) -> bool:
    """Whether a checkpoint's partials are laid out as ``shape`` (restorable in place; a compact one never is)."""
    return (int(meta["shards"]) == int(shape["shards"]) and dict(meta.get("axes", {})) == dict(shape["axes"])
            and not meta.get("compact"))


class SavedPartials:
    """A checkpoint's partials before they are read: the stored leaves' shapes, and :meth:`read`.

    What :meth:`~sharded_scan.checkpoint.CheckpointSession.restore_latest` hands ``relayout`` for a
    checkpoint it cannot restore in place, so that the relayout chooses how they are read.

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
        problem = leaf_problem(array_digests(leaves), self._meta)  # every process: one reduction over all
        if problem is not None:
            raise Damaged(problem)
        return leaves


def disk_bytes(directory: epath.Path) -> int:
    """Bytes of the files under ``directory`` (remote: one listing a directory, one stat a file)."""
    return sum(disk_bytes(p) if p.is_dir() else file_size(p) for p in directory.iterdir())


def step_names(directory: epath.Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if re.fullmatch(r"\d+", p.name))


def committed_steps(directory: epath.Path) -> list[int]:
    """The step names under ``directory`` with orbax's commit marker, oldest first.

    Read from the directory, not the manager's ``all_steps()``: a save drops the steps it
    will delete from that list when it starts, so after a failed save it would miss a
    checkpoint still intact on disk.
    """
    return [n for n in step_names(directory) if (directory / str(n) / COMMIT_MARKER).is_file()]


class Store:
    """One directory's orbax ``CheckpointManager``, opened on construction (it creates the directory).

    Args:
      directory: the checkpoint directory (absolute if local; a URL as given).
      keep: how many of the latest checkpoints orbax keeps.
    """

    def __init__(self, directory: str, keep: int):
        self.directory, self.root = directory, as_path(directory)
        self._manager = ocp.CheckpointManager(
            directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=int(keep), create=True, cleanup_tmp_directories=True),
            item_handlers={
                PARTIALS: ocp.PyTreeCheckpointHandler(),
                META: ocp.JsonCheckpointHandler(),
                SOURCE: ocp.JsonCheckpointHandler(),
            },
        )

    def latest_step(self) -> int | None:
        """The newest step orbax lists, or None."""
        return self._manager.latest_step()

    def read_meta(self, cursor: int) -> dict[str, Any]:
        return self._manager.restore(cursor, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]

    def restore_in_place(self, cursor: int, like: PyTree) -> PyTree:
        """The partials restored into ``like``'s shardings, after checking the stored dtypes and shapes
        (orbax would cast a dtype silently; the fingerprint matched, so a mismatch is damage)."""
        stored = self._manager.item_metadata(cursor)[PARTIALS]
        stored = dict(getattr(stored, "tree", stored) or {})
        want = to_flat_dict(like)
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

    def saved_partials(self, cursor: int, meta: dict[str, Any]) -> SavedPartials:
        """The partials at ``cursor``, unread (for a relayout)."""
        return SavedPartials(self._manager, cursor, meta)

    def source_states(self, cursor: int) -> list[Any]:
        """Every process's source state saved at ``cursor``, as saved (the digest is the caller's to check)."""
        if not (self.root / str(cursor) / SOURCE).is_dir():
            raise Damaged("its source item is missing")
        saved = self._manager.restore(cursor, args=ocp.args.Composite(**{SOURCE: ocp.args.JsonRestore()}))[SOURCE]
        return list((saved or {}).get("processes", []))

    def save(self, cursor: int, partials: PyTree, meta: dict[str, Any], states: list[Any]) -> None:
        """Starts orbax's async save of the checkpoint at ``cursor`` (its errors raised as orbax raises them)."""
        args = ocp.args.Composite(**{
            PARTIALS: ocp.args.PyTreeSave(to_flat_dict(partials)),
            META: ocp.args.JsonSave(meta),
            SOURCE: ocp.args.JsonSave({"processes": states}),
        })
        self._manager.save(int(cursor), args=args, force=True)

    def saving(self) -> bool:
        """Whether a save is still being written."""
        return self._manager.is_saving_in_progress()

    def wait(self) -> None:
        """Waits for the save in flight; raises its failure.

        orbax's finalize thread takes the background write's error (so the manager's
        ``check_for_errors()`` no longer sees it) and ``wait_until_finished()`` raises it.
        """
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Releases orbax's resources (a failed save's error, recorded by :meth:`wait`, is not raised again)."""
        try:
            self._manager.close()
        except Exception:  # noqa: BLE001 - a failed save was recorded by wait; close once more
            self._manager.close()


def room_needed(root: epath.Path, partials: PyTree) -> int:
    """Bytes the next save of ``partials`` under ``root`` needs: a quarter more than the last checkpoint
    took on disk (orbax compresses), or, before there is one, the partials' raw bytes."""
    done = committed_steps(root)
    if done:
        return int(1.25 * disk_bytes(root / str(done[-1]))) + METADATA_BYTES
    return sum(int(x.size) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(partials)) + METADATA_BYTES
