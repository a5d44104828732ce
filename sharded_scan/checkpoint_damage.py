"""Setting damaged checkpoints aside: finding the step directories that are not whole, and moving them.

:func:`damaged_steps` checks what can be checked without reading the arrays (orbax's commit marker
and step metadata, the ``meta`` item and its digests or HMAC, the partials' tree metadata);
:func:`move_aside` moves a damaged step into ``damaged/`` (process 0; every process gets the
answer), never deleting one: one atomic rename on a local file system (through :mod:`sharded_scan.fs`,
where tests inject faults), a copy then a delete, commit marker first, on an object store.
"""

from __future__ import annotations

import errno
import json
import os
import time

import jax
from etils import epath

from sharded_scan import fs
from sharded_scan.checkpoint_digests import meta_problem
from sharded_scan.checkpoint_store import COMMIT_MARKER, META, PARTIALS, ocp, step_names
from sharded_scan.distributed import gather_json
from sharded_scan.paths import as_path, is_url
from sharded_scan.storage import storage_error, storage_reason

DAMAGED = "damaged"  # damaged checkpoints are moved here, never loaded


def aside_target(root: epath.Path, name: str) -> epath.Path:
    """Where step directory ``name`` under ``root`` is set aside: ``damaged/NAME-TIME``."""
    return root / DAMAGED / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def move_aside(directory: str, name: str, target: epath.Path, problem: str) -> None:
    """Moves step directory ``name`` of ``directory`` to ``target`` (process 0; every process gets the answer).

    Raises:
      StorageError: the move failed (read-only, no permission); nothing was changed.
    """
    root = as_path(directory)
    code = None
    if jax.process_index() == 0:
        try:
            if is_url(directory):
                _move_remote(root / name, target)
            else:  # one atomic rename
                fs.ops().makedirs(target.parent, exist_ok=True)
                fs.ops().replace(os.path.join(directory, name), target)
        except OSError as e:
            code = storage_reason(e) or e.errno or errno.EIO
    code = gather_json(code)[0]
    if code is not None:
        raise storage_error(f"set aside the damaged checkpoint {name} in {directory} ({problem})", code,
                            "nothing was moved or deleted")


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


def step_damage(step_dir: str | os.PathLike, key: bytes | None = None) -> str | None:
    """Why ``step_dir`` is not a complete checkpoint of ours (a phrase), or None.

    Checks what can be checked without reading the arrays: orbax's commit marker and
    step metadata, our ``meta`` item (JSON with a cursor, a fingerprint and every digest
    field, matching its digest; with a ``key``, its HMAC) and the partials' tree metadata.
    A flipped byte in the arrays shows up when they are read and their digests checked
    (:meth:`~sharded_scan.checkpoint.CheckpointSession.restore_latest`).
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
    found = [(str(n), step_damage(root / str(n), key)) for n in step_names(root)]
    return [(n, problem) for n, problem in found if problem is not None]
