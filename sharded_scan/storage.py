"""Storage faults as one line: which errors are the storage's, what they mean, what to do.

A checkpoint save, a set-aside or the result's write can meet a full disk, a file
system remounted read-only, a missing permission or a quota. :func:`storage_reason`
recognises such an error however it arrived (an ``OSError`` with its ``errno``, or
tensorstore's and orbax's wrapped text) and :func:`storage_error` turns it into a
:class:`~sharded_scan.errors.StorageError` whose one line says what to do.
:func:`check_room` looks before a save starts, so the common case never reaches
orbax's half-written temporary directories. Both checks look at a local file system
(through :mod:`sharded_scan.fs`, where tests inject faults); a remote directory
(``gs://...``) is not checked: its store reports its own errors when orbax writes, and
those are worded the same way where they name a known fault.
"""

from __future__ import annotations

import errno
import os

from sharded_scan import fs
from sharded_scan.errors import StorageError, UsageError
from sharded_scan.paths import is_url

MIB = 1 << 20

# errno -> (the phrase in the message, what the operator does about it)
REASONS = {
    errno.ENOSPC: ("no space left on device", "free space"),
    errno.EDQUOT: ("disk quota exceeded", "free space or raise the quota"),
    errno.EROFS: ("read-only file system", "remount it read-write"),
    errno.EACCES: ("permission denied", "give this user write permission"),
    errno.EPERM: ("operation not permitted", "give this user write permission"),
}
# How the same errors read once tensorstore or orbax has wrapped them in a ValueError.
_TEXT = {
    "no space left on device": errno.ENOSPC,
    "resource_exhausted": errno.ENOSPC,
    "disk quota exceeded": errno.EDQUOT,
    "read-only file system": errno.EROFS,
    "permission denied": errno.EACCES,
    "permission_denied": errno.EACCES,
    "operation not permitted": errno.EPERM,
}


def storage_reason(error: BaseException) -> int | None:
    """The errno of a storage fault behind ``error`` (its causes and context too), or None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, StorageError):
            return error.errno
        if isinstance(error, OSError) and error.errno in REASONS:
            return error.errno
        text = str(error).lower()
        for words, code in _TEXT.items():
            if words in text:
                return code
        error = error.__cause__ or error.__context__
    return None


def storage_error(what: str, code: int, intact: str, needed: int | None = None) -> StorageError:
    """A one-line StorageError: ``could not WHAT: REASON (N MiB needed); INTACT; FIX and rerun``.

    Args:
      what: what could not be written, e.g. ``"save the checkpoint at row 4096 in /w"``.
      code: the errno (one of :data:`REASONS`).
      intact: what is still there, e.g. ``"the previous checkpoint at row 2048 is intact"``.
      needed: bytes the write needed, named for a full disk or quota.
    """
    phrase, fix = REASONS.get(code, (os.strerror(code).lower(), "fix the storage"))
    size = f" ({max(needed / MIB, 0.1):.1f} MiB needed)" if needed and code in (errno.ENOSPC, errno.EDQUOT) else ""
    return StorageError(code, f"could not {what}: {phrase}{size}; {intact}; {fix} and rerun the same command")


def free_bytes(directory: str) -> int | None:
    """Bytes an unprivileged write may still use under ``directory`` (None when unknown)."""
    try:
        stats = fs.ops().statvfs(directory)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def read_only(directory: str) -> bool:
    """Whether the file system holding ``directory`` is mounted read-only."""
    try:
        return bool(fs.ops().statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check_room(directory: str, needed: int) -> int | None:
    """The errno that would stop writing ``needed`` bytes under ``directory`` now, or None.

    Looks at the mount (read-only), the permission and the free space; a quota or
    another writer can still fail the write itself. None for a remote directory (not checked).
    """
    if is_url(directory):
        return None
    if read_only(directory):
        return errno.EROFS
    if not fs.ops().access(directory, os.W_OK | os.X_OK):
        return errno.EACCES
    free = free_bytes(directory)
    if free is not None and free < needed:
        return errno.ENOSPC
    return None


def check_writable(directory: str) -> None:
    """Raises UsageError unless ``directory`` exists or can be created, and is writable.

    A remote directory is not checked (its store refuses a write itself).
    """
    if is_url(directory):
        return
    path = directory
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    if not os.path.isdir(path) or not fs.ops().access(path, os.W_OK | os.X_OK) or read_only(path):
        why = "on a read-only file system" if os.path.isdir(path) and read_only(path) else "not writable"
        raise UsageError(f"{directory} is not a writable directory ({path} is {why}); pick another path.")
