"""The few local file-system calls checkpointing makes itself, behind one seam for fault injection.

orbax writes and lists the checkpoints through its own code. What sharded_scan does on a
local file system itself goes through :func:`ops`: setting a damaged checkpoint aside
(``makedirs``, then one atomic ``replace``) and looking for room before a save or a write
(``statvfs``, ``access``). A test or ``bench/faults.py`` injects a fault with
:func:`replaced`, never by patching ``os`` or a module's globals::

    def refuse(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied", src)

    with fs.replaced(replace=refuse):
        ss.run(...)  # the set-aside meets EACCES
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator


@dataclasses.dataclass(frozen=True)
class Operations:
    """The operations, named as in :mod:`os` and called like them."""

    makedirs: Callable[..., None] = os.makedirs
    replace: Callable[[str | os.PathLike, str | os.PathLike], None] = os.replace
    statvfs: Callable[[str | os.PathLike], os.statvfs_result] = os.statvfs
    access: Callable[[str | os.PathLike, int], bool] = os.access


_current = Operations()


def ops() -> Operations:
    """The operations in force: :mod:`os`'s, unless a block of :func:`replaced` runs."""
    return _current


@contextlib.contextmanager
def replaced(**operations: Callable) -> Iterator[Operations]:
    """Within the block, the named operations (fields of :class:`Operations`) are the given callables.

    Args:
      **operations: e.g. ``replace=refuse``; an unknown name is a TypeError.

    Yields:
      The operations in force inside the block.
    """
    global _current
    saved = _current
    _current = dataclasses.replace(saved, **operations)
    try:
        yield _current
    finally:
        _current = saved
