"""The Source protocol: a dataset's rows, readable by range, and how a read is laid out."""

from __future__ import annotations

import abc
import contextlib
import functools
import inspect
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from sharded_scan.errors import UsageError

PyTree = Any

ALIGN = 64  # bytes; the CPU runtime places arrays aligned like this without a copy


def padded(x: np.ndarray, rows: int) -> np.ndarray:
    """``x`` followed by zero rows, ``rows`` rows in all, in an aligned array."""
    out = aligned_empty((rows,) + x.shape[1:], x.dtype)
    out[: len(x)] = x
    out[len(x) :] = 0
    return out


def aligned_empty(shape: Sequence[int], dtype: Any) -> np.ndarray:
    """An uninitialised array whose data starts on an ``ALIGN``-byte boundary.

    Sources return reads in such arrays: on CPU devices placing them is zero-copy, so
    placement does not compete with the devices' compute for memory bandwidth.
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def file_stamp(stat: os.stat_result) -> str:
    """A file's size and modification time (to the nanosecond), as the fingerprint holds them."""
    seconds, nanos = divmod(stat.st_mtime_ns, 10**9)
    return f"{stat.st_size} bytes, modified {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(seconds))}.{nanos:09d}"


def changed_while_read(path: str, start: int, stop: int, was: str, now: str | None) -> UsageError:
    """The one line for a file the job reads that changed (``now``: its stamp) or disappeared
    (``now`` None) while the job read rows ``start..stop`` (``was``: its stamp when the source was built)."""
    if now is None:
        what = f"disappeared while the job read it (at rows {start}..{stop - 1})"
    elif now == was:
        what = f"changed while the job read it (at rows {start}..{stop - 1}): another file of the same size and time"
    else:
        what = f"changed while the job read it (at rows {start}..{stop - 1}): it was {was}, it is {now}"
    return UsageError(
        f"{path!r} {what}; nothing is lost, the checkpoints written so far are intact: put the original back (cp -p "
        "keeps its time; else resume with --config.checkpoint.ignore_changed_data=true) and rerun the same command "
        "to resume, or run the new data in a new workdir."
    )


def _local_state(path: str) -> tuple[tuple, str] | None:
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return (stat.st_size, stat.st_mtime_ns, stat.st_ino), file_stamp(stat)


class FileWatch:
    """The files a source reads as they were when it was built, to tell when one changes mid-run.

    Args:
      paths: the files.
      state: ``path -> (identity, stamp)``, or None for a file that is gone; by default a
        local file's size, modification time and inode (a file replaced by a rename shows
        too), with its :func:`file_stamp`.
    """

    def __init__(self, paths: Sequence[str], state: Callable[[str], tuple[tuple, str] | None] = _local_state):
        self._state = state
        self._was = {p: state(p) for p in paths}

    def problem(self, paths: Sequence[str], start: int, stop: int) -> UsageError | None:
        """:func:`changed_while_read`'s line for the first of ``paths`` that changed or is gone, or None."""
        for path in paths:
            was, now = self._was[path], self._state(path)
            if was is not None and (now is None or now[0] != was[0]):
                return changed_while_read(path, start, stop, was[1], None if now is None else now[1])
        return None

    @contextlib.contextmanager
    def reading(self, paths: Sequence[str], start: int, stop: int) -> Iterator[None]:
        """Around a read of rows ``start..stop`` from ``paths``: a file that changed or vanished
        before or during it is the one line, whether the read failed (a file cut short or
        deleted) or returned rows (a file rewritten with the same layout: rows of both)."""
        try:
            yield
        except Exception:
            problem = self.problem(paths, start, stop)
            if problem is None:
                raise
            raise problem from None
        problem = self.problem(paths, start, stop)
        if problem is not None:
            raise problem


def row_spec(shape: Sequence[int], dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(int(s) for s in shape[1:]), np.dtype(dtype))


class Source(abc.ABC):
    """Rows of a dataset, readable by range.

    A subclass defines ``read(start, stop, pad_to=None)``, or ``read(start, stop)`` alone (as
    sources did before ``pad_to``, and as a subclass that only logs or changes rows may): the
    base then gives that ``read`` its ``pad_to`` by padding a copy of the rows.
    """

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        read = cls.__dict__.get("read")
        if read is not None and not _takes_pad_to(read):
            cls.read = _padding_a_copy(read)

    @property
    @abc.abstractmethod
    def num_rows(self) -> int:
        """The number of rows."""

    @property
    @abc.abstractmethod
    def spec(self) -> PyTree:
        """A pytree of ``jax.ShapeDtypeStruct``: shape and dtype of one row per leaf."""

    @abc.abstractmethod
    def read(self, start: int, stop: int, pad_to: int | None = None) -> PyTree:
        """Returns rows ``[start, stop)`` as a pytree of numpy arrays.

        Args:
          start: the first row.
          stop: the row after the last one; ``read(n, n)`` gives zero rows.
          pad_to: None, or the rows wanted in all (at least ``stop - start``): the rows, then
            zero rows (the last step). A source that allocates its output reads straight into
            the longer arrays; the others get a padded copy from the base (see the class).
        """

    @property
    def resumable(self) -> bool:
        """Whether reading can restart at any cursor (with the state of ``state_at``)."""
        return True

    @property
    def sequential(self) -> bool:
        """Whether reads must go forward only (``start`` never below the last ``stop``)."""
        return False

    def state_at(self, cursor: int) -> dict[str, Any]:
        """What a checkpoint stores, besides ``cursor``, to resume reading at ``cursor``."""
        del cursor
        return {}

    def seek(self, cursor: int, state: dict[str, Any] | None = None) -> None:
        """Prepares the source for reads from row ``cursor`` on.

        Raises:
          UsageError: ``cursor`` is outside ``[0, num_rows]`` or the source cannot resume there.
        """
        del state
        if not 0 <= cursor <= self.num_rows:
            raise UsageError(f"cannot resume at row {cursor}: the data has {self.num_rows} rows.")

    @property
    def column_names(self) -> Any:
        """The names of the row's columns, a pytree like ``spec`` (a list of names for a
        ``(d,)`` leaf, a name for a scalar one), or None when the data has none."""
        return None

    @property
    def string_columns(self) -> tuple[str, ...]:
        """The columns read as :func:`~sharded_scan.hash_strings` int64 ids (string and categorical
        columns), which only a combiner with ``takes_string_ids`` may reduce; () for numbers."""
        return ()

    def strings(self, column: str, ids: Iterable[int]) -> dict[int, dict[str, int]]:
        """``{id: {string: rows}}``: every string of the string column ``column`` whose id is among
        ``ids`` (what ``TopK`` lists) and its rows, the column read from its first row to its last, so
        the same on every process, and two strings sharing an id are both found."""
        del column, ids
        return {}

    def describe(self) -> dict[str, Any]:
        """What identifies the data for a checkpoint fingerprint: kind, rows, row spec."""
        return {
            "source": type(self).__name__,
            "num_rows": self.num_rows,
            "spec": jax.tree.map(lambda s: f"{np.dtype(s.dtype).name}{list(s.shape)}", self.spec),
        }

    def stamps(self) -> dict[str, str]:
        """``{path: file_stamp}`` of every file the source reads (empty for data in memory).

        Part of the job's fingerprint: a rerun whose data changed since its checkpoint is
        refused in one line instead of resumed onto other rows, and a finished job is
        not "already done" any more.
        """
        return {}

    @property
    def rereadable(self) -> bool:
        """Whether the rows can be read again from row 0 once read (False for an iterator that
        can be iterated only once): a reduction of several passes needs it."""
        return True

    def _check_range(self, start: int, stop: int) -> None:
        if not 0 <= start <= stop <= self.num_rows:
            raise ValueError(f"row range [{start}, {stop}) is outside [0, {self.num_rows}).")


def _takes_pad_to(read: Any) -> bool:
    try:
        parameters = inspect.signature(read).parameters.values()
    except (TypeError, ValueError):  # no signature to read: called with pad_to as it is
        return True
    return any(p.name == "pad_to" or p.kind is p.VAR_KEYWORD for p in parameters)


def _padding_a_copy(read: Callable[[Source, int, int], PyTree]) -> Callable[..., PyTree]:
    """A subclass's ``read(start, stop)`` given ``pad_to``: its rows, then a padded copy of them."""

    def read_then_pad(self: Source, start: int, stop: int, pad_to: int | None = None) -> PyTree:
        rows = read(self, start, stop)
        return rows if pad_to is None else jax.tree.map(lambda x: padded(x, pad_to), rows)

    functools.update_wrapper(read_then_pad, read)
    del read_then_pad.__wrapped__  # its signature is the one with pad_to
    return read_then_pad


def check_unmasked(x: Any, who: str) -> Any:
    """``x``, unless it is a numpy masked array with masked entries (one-line UsageError).

    ``np.asarray`` would drop the mask and reduce the values under it: a silently wrong
    answer. Refused rather than guessed at (skipping rows with a masked entry is not what
    ``numpy.ma`` computes per column).
    """
    if isinstance(x, np.ma.MaskedArray):
        masked = int(np.ma.count_masked(x))
        if masked:
            raise UsageError(
                f"{who} is a numpy masked array with {masked} masked entries, and its values under the mask would be "
                "reduced as they are; pass x.filled(np.nan) with nan_policy='omit' to skip rows holding a masked "
                "entry, or x.filled(value) to count them as value."
            )
    return x


def num_rows_of(tree: PyTree) -> int:
    """The leading (row) dimension of a pytree of arrays."""
    return int(jax.tree.leaves(tree)[0].shape[0])
