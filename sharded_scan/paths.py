"""Local paths and URLs alike: every path the library reads or writes goes through here.

A local path (``str``, :class:`pathlib.Path` or :class:`etils.epath.Path`) is used as
the operating system names it, made absolute where a message, a fingerprint or orbax
names it. A URL (``gs://``, ``s3://``, ``az://``, ``hf://``) goes through
:mod:`etils.epath`, as orbax's does, and works where its file system is installed
(``gcsfs``, ``s3fs``, ...); it is never made absolute. ``file://`` URLs are local paths.
"""

from __future__ import annotations

import os
import time
from typing import Any

from etils import epath

from sharded_scan.errors import UsageError


def is_url(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a remote store (``scheme://...``) rather than a local file."""
    text = os.fspath(path)
    return "://" in text and not text.startswith("file://")


def where(path: str | os.PathLike) -> str:
    """``path`` as messages and fingerprints name it: absolute if local, a URL as given."""
    text = os.fspath(path)
    if text.startswith("file://"):
        text = text[len("file://"):]
    return text if is_url(text) else os.path.abspath(text)


def as_path(path: str | os.PathLike) -> epath.Path:
    """``path`` (see :func:`where`) as an :class:`etils.epath.Path`.

    Raises:
      UsageError: a URL whose scheme etils.epath does not know.
    """
    text = where(path)
    try:
        return epath.Path(text)
    except KeyError:
        raise UsageError(f"{text!r}: etils.epath cannot open {text.split('://')[0]}:// paths (it knows gs://, s3://, "
                         "az://, hf://); give a local path or one of those.") from None


def file_size(path: epath.Path) -> int:
    """A file's size in bytes."""
    if not is_url(path):
        return os.path.getsize(path)  # not epath's stat: it also looks the owner up, which can fail in a container
    return int(path.stat().length or 0)


def remote_stamp(stat: Any) -> str:
    """A remote file's size and modification time (to the second), as the fingerprint holds them."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stat.mtime or 0))
    return f"{int(stat.length or 0)} bytes, modified {when}"
