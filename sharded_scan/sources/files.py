"""Sources on disk: ``.npy`` files, directories of ``.npy`` shards, and zarr arrays.

Every source takes a ``str``, a :class:`pathlib.Path` or an :class:`etils.epath.Path`:
a local path, or a URL (``gs://...``) read through etils.epath (``.npy``) or
tensorstore (zarr) where the store's file system is installed.
"""

from __future__ import annotations

import glob
import math
import mmap
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from sharded_scan.dtypes import check_numeric
from sharded_scan.errors import UsageError
from sharded_scan.paths import as_path, is_url, remote_stamp, where
from sharded_scan.sources.base import (
    ALIGN,
    PyTree,
    Source,
    aligned_empty,
    changed_while_read,
    file_stamp,
    padded,
    row_spec,
)


def natural_key(path: str) -> list:
    """Sorts ``part-2`` before ``part-10``: digit runs compare as numbers."""
    return [int(piece) if piece.isdigit() else piece for piece in re.split(r"(\d+)", path)]


class _NpyFile:
    """One ``.npy`` file: its header, and row ranges read into private memory (or mapped).

    Every read first checks that the file still has the size and modification time it
    had when the source was built, and reads with ``pread``: a file changed or cut
    short (or deleted) while the job runs is one :class:`UsageError` line. With ``zero_copy`` the
    rows are handed on as a view of a memory map instead (no copy; the devices read the
    page cache), and a file truncated while a view is in use ends the process with a
    bus error.

    A remote file (a URL) is read through :mod:`etils.epath`: ``open``, ``seek`` and
    ``read`` a row range, after a ``stat`` that checks its size and modification time
    (to the second); it cannot be memory-mapped.
    """

    def __init__(self, path: str, zero_copy: bool = False):
        self.zero_copy = bool(zero_copy)
        self.remote = is_url(path)
        if self.remote and self.zero_copy:
            raise UsageError(f"zero_copy maps local files only, and {path!r} is remote; drop zero_copy.")
        self._file = as_path(path) if self.remote else None
        try:
            exists = self._file.is_file() if self.remote else os.path.isfile(path)
        except ImportError as e:  # the store's file system (gcsfs, s3fs, ...) is not installed
            raise UsageError(f"cannot read {path!r}: {' '.join(str(e).split())}") from None
        if not exists:
            raise UsageError(f"no such .npy file: {path!r}; check the path.")
        try:
            with self._file.open("rb") if self.remote else open(path, "rb") as f:
                version = np.lib.format.read_magic(f)
                fmt = np.lib.format
                header = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
                shape, fortran, dtype = header(f)
                self.offset = f.tell()
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot read {path!r} as a .npy file ({e}); check the file.") from None
        if dtype.hasobject:
            raise UsageError(f"{path!r} holds Python objects; save a numeric array instead.")
        check_numeric(dtype, f"the .npy file {path!r}")
        if len(shape) == 0:
            raise UsageError(f"{path!r} holds a scalar; a .npy source needs a leading row dimension.")
        self.fortran = bool(fortran) and len(shape) > 1 and math.prod(shape[1:]) > 1
        row_bytes = dtype.itemsize * math.prod(shape[1:])
        self.stat = self._file.stat() if self.remote else os.stat(path)
        if self._size(self.stat) < self.offset + row_bytes * shape[0]:
            raise UsageError(f"{path!r} is shorter than its header says ({shape}); the file is truncated.")
        self.path, self.shape, self.dtype, self.row_bytes = path, tuple(shape), dtype, row_bytes

    def _size(self, stat: Any) -> int:
        return int(stat.length or 0) if self.remote else stat.st_size

    def _stamp(self, stat: Any) -> str:
        return remote_stamp(stat) if self.remote else file_stamp(stat)

    @property
    def stamp(self) -> str:
        return self._stamp(self.stat)

    def read(self, start: int, stop: int, pad_to: int | None = None) -> np.ndarray:
        """Rows ``start..stop``; with ``pad_to``, followed by zero rows up to ``pad_to`` in all, read
        straight into the longer array (a local C-order file; the other kinds pad a copy)."""
        if stop <= start or self.row_bytes == 0:
            out = aligned_empty((max(stop - start, pad_to or 0),) + self.shape[1:], self.dtype)
            out[...] = 0
            return out
        if pad_to is not None and (self.fortran or self.remote or self.zero_copy):
            return padded(self.read(start, stop), pad_to)
        begin, shape = self.offset + start * self.row_bytes, (stop - start,) + self.shape[1:]
        if self.fortran:
            return self._read_columns(start, stop)
        if self.remote:
            return self._read_remote(begin, shape, start, stop)
        with self._opened(start, stop) as f:
            self._check_unchanged(os.fstat(f.fileno()), start, stop)
            if self.zero_copy:
                return _mapped_rows(f, begin, shape, self.dtype)
            out = aligned_empty((pad_to or shape[0],) + shape[1:], self.dtype)
            out[shape[0]:] = 0
            wanted = memoryview(out).cast("B")[: math.prod(shape) * self.dtype.itemsize]
            got = os.preadv(f.fileno(), [wanted], begin)
        if got != len(wanted):
            self._check_unchanged(self._stat_now(start, stop), start, stop)
            raise UsageError(f"{self.path!r} ended early: rows {start}..{stop - 1} need bytes up to "
                             f"{begin + len(wanted)}; check the file.")
        return out

    def _read_columns(self, start: int, stop: int) -> np.ndarray:
        """Rows of a Fortran-order file (``np.save`` of a transposed or pandas array): each column
        is stored whole, so rows ``start..stop`` are one ranged read per column, then laid out
        in rows (a copy, also under ``zero_copy``)."""
        rows, size = stop - start, self.dtype.itemsize
        columns = aligned_empty((math.prod(self.shape[1:]), rows), self.dtype)
        begins = [self.offset + (c * self.shape[0] + start) * size for c in range(len(columns))]
        if self.remote:
            for column, begin in zip(columns, begins, strict=True):
                column[:] = self._read_remote(begin, (rows,), start, stop)
        else:
            with self._opened(start, stop) as f:  # one open and check, one ranged read a column
                self._check_unchanged(os.fstat(f.fileno()), start, stop)
                for column, begin in zip(columns, begins, strict=True):
                    if os.preadv(f.fileno(), [memoryview(column).cast("B")], begin) != column.nbytes:
                        self._check_unchanged(self._stat_now(start, stop), start, stop)
                        raise UsageError(f"{self.path!r} ended early reading rows {start}..{stop - 1}; check the file.")
        block = np.ndarray((rows,) + self.shape[1:], self.dtype, buffer=columns, order="F")
        out = aligned_empty(block.shape, self.dtype)
        out[...] = block
        return out

    def _read_remote(self, begin: int, shape: tuple[int, ...], start: int, stop: int) -> np.ndarray:
        """Rows of a remote file: its stat checked, then one ranged read into aligned memory."""
        self._check_unchanged(self._stat_now(start, stop), start, stop)
        rows = aligned_empty(shape, self.dtype)
        view, got = memoryview(rows).cast("B"), 0
        with self._opened(start, stop) as f:
            f.seek(begin)
            while got < len(view) and (n := f.readinto(view[got:])):
                got += n
        if got != rows.nbytes:
            self._check_unchanged(self._stat_now(start, stop), start, stop)
            raise UsageError(f"{self.path!r} ended early: rows {start}..{stop - 1} need bytes up to "
                             f"{begin + rows.nbytes}; check the file.")
        return rows

    def _opened(self, start: int, stop: int) -> Any:
        """The file opened to read rows ``start..stop``; one line when it is gone."""
        try:
            return self._file.open("rb") if self.remote else open(self.path, "rb")
        except FileNotFoundError:
            raise changed_while_read(self.path, start, stop, self.stamp, None) from None

    def _stat_now(self, start: int, stop: int) -> Any:
        """The file's stat now (by name: a file replaced by a rename shows); one line when it is gone."""
        try:
            return self._file.stat() if self.remote else os.stat(self.path)
        except FileNotFoundError:
            raise changed_while_read(self.path, start, stop, self.stamp, None) from None

    def _check_unchanged(self, now: Any, start: int, stop: int) -> None:
        if self.remote:
            changed = (now.length, now.mtime) != (self.stat.length, self.stat.mtime)
        else:
            changed = (now.st_size, now.st_mtime_ns, now.st_ino) != (
                self.stat.st_size, self.stat.st_mtime_ns, self.stat.st_ino)
        if changed:
            raise changed_while_read(self.path, start, stop, self.stamp, self._stamp(now))


def _mapped_rows(f: Any, begin: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Rows of an open file as a read-only view of a memory map of just them, faulted in now.

    No copy: on CPU devices placing the view is zero-copy too, so the devices read the
    page cache directly. The map lives as long as the view (and what is placed from it);
    ``MAP_POPULATE`` makes the reader thread, not the compute, pay the page faults.
    Rows that do not start on an ``ALIGN`` boundary are copied out of a map of just them
    into aligned memory (resident memory stays one chunk).
    """
    if begin % ALIGN:
        mapped = np.memmap(f, dtype, "r", begin, shape)
        rows = aligned_empty(mapped.shape, dtype)
        rows[...] = mapped
        del mapped
        return rows
    nbytes = math.prod(shape) * dtype.itemsize
    page_start = begin - begin % mmap.ALLOCATIONGRANULARITY
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    mapped = mmap.mmap(f.fileno(), begin - page_start + nbytes, flags=flags, prot=mmap.PROT_READ, offset=page_start)
    return np.frombuffer(mapped, dtype, math.prod(shape), begin - page_start).reshape(shape)


class NpySource(Source):
    """One ``.npy`` file, read by row range; never loaded whole.

    Args:
      path: the file: a local path, or a URL (``gs://...``) read through etils.epath.
      zero_copy: hand rows on as views of a memory map instead of reading them into
        private memory: no copy (faster on CPU devices), but a file truncated while the
        job runs then ends it with a bus error instead of one line. Local files only.
    """

    def __init__(self, path: str | os.PathLike, zero_copy: bool = False):
        self._file = _NpyFile(os.fspath(path), zero_copy)

    @property
    def path(self) -> str:
        return self._file.path

    @property
    def num_rows(self) -> int:
        return self._file.shape[0]

    @property
    def spec(self) -> PyTree:
        return row_spec(self._file.shape, self._file.dtype)

    def read(self, start: int, stop: int, pad_to: int | None = None) -> np.ndarray:
        self._check_range(start, stop)
        return self._file.read(start, stop, pad_to)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "path": where(self.path)}

    def stamps(self) -> dict[str, str]:
        return {where(self.path): self._file.stamp}


class NpyShardsSource(Source):
    """Several ``.npy`` shards read as one row-concatenated array.

    Args:
      shards: a directory (its ``*.npy`` files), a glob pattern, or a list of paths,
        local or URLs (globbed through etils.epath). Directory and glob matches are
        taken in natural order: ``part-2`` before ``part-10`` (digit runs compare as
        numbers); a list keeps its order.
      zero_copy: as :class:`NpySource`.
    """

    def __init__(self, shards: str | os.PathLike | Sequence[str | os.PathLike], zero_copy: bool = False):
        if isinstance(shards, (str, os.PathLike)):
            named = os.fspath(shards)
            paths = sorted(_shard_paths(named), key=natural_key)
        else:
            named, paths = "the list", [os.fspath(p) for p in shards]
        if not paths:
            raise UsageError(f"no .npy shards found in {named!r}; give a directory, a glob or a list of .npy files.")
        self._files = [_NpyFile(p, zero_copy) for p in paths]
        first = self._files[0]
        for f in self._files[1:]:
            if f.shape[1:] != first.shape[1:] or f.dtype != first.dtype:
                raise UsageError(
                    f"shard {f.path!r} has rows {f.dtype}{list(f.shape[1:])} but {first.path!r} has "
                    f"{first.dtype}{list(first.shape[1:])}; every shard needs the same features and dtype."
                )
        self._starts = np.cumsum([0] + [f.shape[0] for f in self._files])

    @property
    def paths(self) -> list[str]:
        return [f.path for f in self._files]

    @property
    def num_rows(self) -> int:
        return int(self._starts[-1])

    @property
    def spec(self) -> PyTree:
        return row_spec(self._files[0].shape, self._files[0].dtype)

    def read(self, start: int, stop: int, pad_to: int | None = None) -> np.ndarray:
        self._check_range(start, stop)
        first = self._files[0]
        out = aligned_empty((pad_to or stop - start,) + first.shape[1:], first.dtype)
        out[stop - start :] = 0
        for i, f in enumerate(self._files):
            lo, hi = max(start, self._starts[i]), min(stop, self._starts[i + 1])
            if lo < hi:
                out[lo - start : hi - start] = f.read(lo - self._starts[i], hi - self._starts[i])
        return out

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "paths": [where(p) for p in self.paths]}

    def stamps(self) -> dict[str, str]:
        return {where(f.path): f.stamp for f in self._files}


def _shard_paths(shards: str) -> list[str]:
    """The ``*.npy`` files of a directory, or a glob's matches (a plain path matches itself)."""
    if not is_url(shards):
        return glob.glob(os.path.join(glob.escape(shards), "*.npy") if os.path.isdir(shards) else shards)
    try:
        root = as_path(shards)
        if root.is_dir():
            return [str(p) for p in root.glob("*.npy")]
        parts = shards.split("/")  # scheme:, "", bucket, ...: a wildcard is looked for after the bucket
        magic = next((i for i, part in enumerate(parts) if i > 2 and re.search(r"[*?[]", part)), None)
        if magic is None:
            return [shards] if root.exists() else []
        return [str(p) for p in as_path("/".join(parts[:magic])).glob("/".join(parts[magic:]))]
    except ImportError as e:  # the store's file system (gcsfs, s3fs, ...) is not installed
        raise UsageError(f"cannot read {shards!r}: {' '.join(str(e).split())}") from None


class ZarrSource(Source):
    """A zarr array (v2 or v3) read through tensorstore.

    Args:
      path: a local directory (``str``, ``pathlib.Path``, ``epath.Path``), or a URL
        tensorstore's kvstore understands (``file://``, ``gs://``, ``s3://``, ...).
      driver: ``"zarr"`` (v2), ``"zarr3"``, or ``None`` to detect it.
      fill_missing: read a chunk that is not stored as the array's fill value. Off by
        default: a missing chunk is then one :class:`UsageError` line naming it, never
        silently zeros (zarr writers skip chunks that hold only the fill value unless told
        to write empty chunks; pass True for such arrays).
    """

    def __init__(self, path: str | os.PathLike, driver: str | None = None, fill_missing: bool = False):
        import tensorstore as ts

        path = os.fspath(path)
        local = "://" not in path
        if local and not os.path.isdir(path):
            raise UsageError(f"no such zarr directory: {path!r}; check the path.")
        kvstore = {"driver": "file", "path": os.path.abspath(path)} if local else path
        if driver is None and local:
            driver = "zarr3" if os.path.exists(os.path.join(path, "zarr.json")) else "zarr"
        errors = []
        for candidate in [driver] if driver else ["zarr3", "zarr"]:
            try:
                spec = {"driver": candidate, "kvstore": kvstore, "fill_missing_data_reads": bool(fill_missing)}
                self._store = ts.open(spec, open=True, read=True).result()
                break
            except ValueError as e:
                errors.append(str(e).splitlines()[0])
        else:
            raise UsageError(f"cannot open {path!r} as a zarr array ({'; '.join(errors)}).")
        self._path, self._driver, self._fill_missing = path, driver, bool(fill_missing)
        self._dtype = np.dtype(self._store.dtype.numpy_dtype)
        check_numeric(self._dtype, f"the zarr array {path!r}")
        if self._store.rank == 0:
            raise UsageError(f"{path!r} holds a scalar; a zarr source needs a leading row dimension.")

    @property
    def num_rows(self) -> int:
        return int(self._store.shape[0])

    @property
    def spec(self) -> PyTree:
        return row_spec(self._store.shape, self._dtype)

    def read(self, start: int, stop: int) -> np.ndarray:
        self._check_range(start, stop)
        try:
            return np.asarray(self._store[start:stop].read().result())
        except ValueError as e:
            if "NOT_FOUND" not in str(e) or "missing" not in str(e):
                raise
            chunk = str(e).split("NOT_FOUND:", 1)[1].strip()
            raise UsageError(
                f"the zarr array {self._path!r} lacks a chunk that rows {start}..{stop - 1} need ({chunk}); "
                "restore it, or pass ZarrSource(path, fill_missing=True) (--config.data.zarr_fill_missing=true) to "
                f"read missing chunks as the fill value {self._store.fill_value}."
            ) from None

    def describe(self) -> dict[str, Any]:
        here = self._path if "://" in self._path else os.path.abspath(self._path)
        return {**super().describe(), "path": here, "fill_missing": self._fill_missing}

    def stamps(self) -> dict[str, str]:
        """The array's metadata file and its directory (cheap: a chunk rewritten in place,
        deep in a nested zarr3 layout, does not show). At a URL, the metadata file's size
        and time through etils.epath (none where epath cannot open the URL)."""
        if "://" in self._path:
            return self._remote_stamps()
        root = os.path.abspath(self._path)
        found = [os.path.join(root, n) for n in (".zarray", "zarr.json", "c") if os.path.exists(os.path.join(root, n))]
        return {p: file_stamp(os.stat(p)) for p in [root, *found]}

    def _remote_stamps(self) -> dict[str, str]:
        if not is_url(self._path):
            return {}  # a file:// URL: as before, not stamped (a checkpoint's fingerprint stays the same)
        try:
            root = as_path(self._path)
            found = [root / n for n in (".zarray", "zarr.json")]
            return {str(p): remote_stamp(p.stat()) for p in found if p.exists()}
        except (UsageError, ImportError, NotImplementedError):  # tensorstore reads it, epath cannot
            return {}
