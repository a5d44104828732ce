"""Sources: where rows come from. Each one reads a row range into host numpy.

A source has ``num_rows``, ``spec`` (a pytree of ``jax.ShapeDtypeStruct`` giving the
shape and dtype of one row of each leaf) and ``read(start, stop)`` returning that
range as a pytree of numpy arrays. ``read`` must be safe to call from a reader thread
(one reader at a time), and ``read(n, n)`` returns zero rows of the right shapes.

Resuming. The engine resumes a job from a row ``cursor`` (saved in a checkpoint).
Before its first read it calls ``seek(cursor, state)``, where ``state`` is what
``state_at(cursor)`` returned when the checkpoint was taken (``{}`` when there was
none). Random-access sources (arrays, files, zarr, synthetic) are ``resumable``: the
cursor alone says where to read, their state is ``{}``, ``seek`` only checks the cursor.
``IteratorSource`` is ``sequential``: it can only be read forward (a read may skip
rows, never go back). It is resumable only when its iterable exposes its state with
``get_state()`` / ``set_state(state)``; then ``state_at(cursor)`` gives the iterable's
state before the batch holding row ``cursor`` plus the rows to skip in it. A resume at
``cursor > 0`` of an iterable without state raises a one-line :class:`UsageError`.

Validation. Every source checks its input when it is built (missing or unreadable
path, wrong shape, shards that disagree, non-numeric dtype) and raises a one-line
:class:`UsageError` before any compute.

Supervised data is a pytree of sources with equal row counts, e.g.
``as_source((NpySource("X.npy"), NpySource("y.npy")))``.
"""

from __future__ import annotations

import abc
import collections
import glob
import math
import mmap
import os
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sharded_scan.combiners.base import check_numeric
from sharded_scan.errors import UsageError

PyTree = Any

__all__ = [
    "ArraySource",
    "IteratorSource",
    "NpyShardsSource",
    "NpySource",
    "Source",
    "SyntheticSource",
    "TreeSource",
    "ZarrSource",
    "as_source",
]


ALIGN = 64  # bytes; the CPU runtime places arrays aligned like this without a copy


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


def _row_spec(shape: Sequence[int], dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(int(s) for s in shape[1:]), np.dtype(dtype))


class Source(abc.ABC):
    """Rows of a dataset, readable by range."""

    @property
    @abc.abstractmethod
    def num_rows(self) -> int:
        """The number of rows."""

    @property
    @abc.abstractmethod
    def spec(self) -> PyTree:
        """A pytree of ``jax.ShapeDtypeStruct``: shape and dtype of one row per leaf."""

    @abc.abstractmethod
    def read(self, start: int, stop: int) -> PyTree:
        """Returns rows ``[start, stop)`` as a pytree of numpy arrays."""

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

    def describe(self) -> dict[str, Any]:
        """What identifies the data for a checkpoint fingerprint: kind, rows, row spec."""
        return {
            "source": type(self).__name__,
            "num_rows": self.num_rows,
            "spec": jax.tree.map(lambda s: f"{np.dtype(s.dtype).name}{list(s.shape)}", self.spec),
        }

    def _check_range(self, start: int, stop: int) -> None:
        if not 0 <= start <= stop <= self.num_rows:
            raise ValueError(f"row range [{start}, {stop}) is outside [0, {self.num_rows}).")


class ArraySource(Source):
    """Rows held in memory: a numpy array or a pytree of arrays with equal row counts."""

    def __init__(self, data: PyTree):
        leaves, self._treedef = jax.tree.flatten(data)
        if not leaves:
            raise UsageError("the data has no arrays; pass a numpy array or a pytree such as (X, y).")
        self._leaves = [np.asarray(x) for x in leaves]
        for x in self._leaves:
            if x.ndim == 0:
                raise UsageError("the data holds a scalar; every leaf needs a leading row dimension.")
            check_numeric(x.dtype, "sharded_scan")
        counts = {x.shape[0] for x in self._leaves}
        if len(counts) > 1:
            shapes = ", ".join(str(x.shape) for x in self._leaves)
            raise UsageError(f"the data's leaves have different row counts ({shapes}); every leaf needs the same rows.")
        self._num_rows = counts.pop()

    @property
    def num_rows(self) -> int:
        return self._num_rows

    @property
    def spec(self) -> PyTree:
        return self._treedef.unflatten([_row_spec(x.shape, x.dtype) for x in self._leaves])

    def read(self, start: int, stop: int) -> PyTree:
        return self._treedef.unflatten([x[start:stop] for x in self._leaves])


class _NpyFile:
    """One ``.npy`` file: its header, and row ranges read through a short-lived memory map."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise UsageError(f"no such .npy file: {path!r}; check the path.")
        try:
            with open(path, "rb") as f:
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
        if fortran and len(shape) > 1:
            raise UsageError(f"{path!r} is stored in Fortran order; save it with np.save(np.ascontiguousarray(x)).")
        row_bytes = dtype.itemsize * math.prod(shape[1:])
        if os.path.getsize(path) < self.offset + row_bytes * shape[0]:
            raise UsageError(f"{path!r} is shorter than its header says ({shape}); the file is truncated.")
        self.path, self.shape, self.dtype, self.row_bytes = path, tuple(shape), dtype, row_bytes

    def read(self, start: int, stop: int) -> np.ndarray:
        if stop <= start or self.row_bytes == 0:
            return np.zeros((max(stop - start, 0),) + self.shape[1:], self.dtype)
        begin = self.offset + start * self.row_bytes
        if begin % ALIGN == 0:
            return _mapped_rows(self.path, begin, (stop - start,) + self.shape[1:], self.dtype)
        # A map of just these rows, copied out and dropped: resident memory stays one chunk.
        mapped = np.memmap(self.path, self.dtype, "r", begin, (stop - start,) + self.shape[1:])
        rows = aligned_empty(mapped.shape, self.dtype)
        rows[...] = mapped
        del mapped
        return rows


def _mapped_rows(path: str, begin: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Rows of a file as a read-only view of a private memory map of just them, faulted in now.

    No copy: on CPU devices placing the view is zero-copy too, so the devices read the
    page cache directly. The map lives as long as the view (and what is placed from it);
    ``MAP_POPULATE`` makes the reader thread, not the compute, pay the page faults.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    page_start = begin - begin % mmap.ALLOCATIONGRANULARITY
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), begin - page_start + nbytes, flags=flags, prot=mmap.PROT_READ,
                           offset=page_start)
    return np.frombuffer(mapped, dtype, math.prod(shape), begin - page_start).reshape(shape)


class NpySource(Source):
    """One ``.npy`` file, read by row range through a memory map; never loaded whole."""

    def __init__(self, path: str | os.PathLike):
        self._file = _NpyFile(os.fspath(path))

    @property
    def path(self) -> str:
        return self._file.path

    @property
    def num_rows(self) -> int:
        return self._file.shape[0]

    @property
    def spec(self) -> PyTree:
        return _row_spec(self._file.shape, self._file.dtype)

    def read(self, start: int, stop: int) -> np.ndarray:
        self._check_range(start, stop)
        return self._file.read(start, stop)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "path": os.path.abspath(self.path)}


class NpyShardsSource(Source):
    """Several ``.npy`` shards read as one row-concatenated array.

    Args:
      shards: a directory (its ``*.npy`` files), a glob pattern, or a list of paths.
        Directory and glob matches are taken in sorted name order.
    """

    def __init__(self, shards: str | os.PathLike | Sequence[str | os.PathLike]):
        if isinstance(shards, (str, os.PathLike)):
            where = os.fspath(shards)
            pattern = os.path.join(where, "*.npy") if os.path.isdir(where) else where
            paths = sorted(glob.glob(pattern))
        else:
            where, paths = "the list", [os.fspath(p) for p in shards]
        if not paths:
            raise UsageError(f"no .npy shards found in {where!r}; give a directory, a glob or a list of .npy files.")
        self._files = [_NpyFile(p) for p in paths]
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
        return _row_spec(self._files[0].shape, self._files[0].dtype)

    def read(self, start: int, stop: int) -> np.ndarray:
        self._check_range(start, stop)
        first = self._files[0]
        out = aligned_empty((stop - start,) + first.shape[1:], first.dtype)
        for i, f in enumerate(self._files):
            lo, hi = max(start, self._starts[i]), min(stop, self._starts[i + 1])
            if lo < hi:
                out[lo - start : hi - start] = f.read(lo - self._starts[i], hi - self._starts[i])
        return out

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "paths": [os.path.abspath(p) for p in self.paths]}


class ZarrSource(Source):
    """A zarr array (v2 or v3) read through tensorstore.

    Args:
      path: a local directory, or a URL tensorstore's kvstore understands (``file://``,
        ``gs://``, ``s3://``, ...).
      driver: ``"zarr"`` (v2), ``"zarr3"``, or ``None`` to detect it.
    """

    def __init__(self, path: str | os.PathLike, driver: str | None = None):
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
                self._store = ts.open({"driver": candidate, "kvstore": kvstore}, open=True, read=True).result()
                break
            except ValueError as e:
                errors.append(str(e).splitlines()[0])
        else:
            raise UsageError(f"cannot open {path!r} as a zarr array ({'; '.join(errors)}).")
        self._path, self._driver = path, driver
        self._dtype = np.dtype(self._store.dtype.numpy_dtype)
        check_numeric(self._dtype, f"the zarr array {path!r}")
        if self._store.rank == 0:
            raise UsageError(f"{path!r} holds a scalar; a zarr source needs a leading row dimension.")

    @property
    def num_rows(self) -> int:
        return int(self._store.shape[0])

    @property
    def spec(self) -> PyTree:
        return _row_spec(self._store.shape, self._dtype)

    def read(self, start: int, stop: int) -> np.ndarray:
        self._check_range(start, stop)
        return np.asarray(self._store[start:stop].read().result())

    def describe(self) -> dict[str, Any]:
        where = self._path if "://" in self._path else os.path.abspath(self._path)
        return {**super().describe(), "path": where}


class SyntheticSource(Source):
    """Deterministic rows from a seed, generated per block of ``chunk_rows`` rows.

    Row ``r`` depends only on ``(seed, r // chunk_rows)``, so any range reads the same
    values however it is cut. With ``targets=True`` it yields ``(X, y)`` with
    ``y = X @ coef + intercept + noise * N(0, 1)`` from a hidden linear model
    (``coef`` and ``intercept`` are attributes, for checking a regression).

    Args:
      num_rows: rows in the dataset.
      features: columns of ``X`` (an int, or a row shape tuple).
      dtype: a float dtype for the rows.
      seed: the seed every value derives from.
      kind: ``"normal"`` (standard normal) or ``"uniform"`` (on ``[0, 1)``).
      chunk_rows: rows generated together (part of the data's identity).
      targets: also yield a regression target ``y`` of shape ``(num_rows,)``.
      noise: standard deviation of the target noise.
    """

    KINDS = ("normal", "uniform")

    def __init__(
        self,
        num_rows: int,
        features: int | Sequence[int],
        dtype: Any = "float32",
        seed: int = 0,
        kind: str = "normal",
        chunk_rows: int = 4096,
        targets: bool = False,
        noise: float = 0.1,
    ):
        shape = (features,) if isinstance(features, (int, np.integer)) else tuple(features)
        for name, value, low in (("num_rows", num_rows, 0), ("chunk_rows", chunk_rows, 1)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise UsageError(f"SyntheticSource {name} must be an integer >= {low}, got {value!r}.")
        if not shape or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1 for s in shape):
            raise UsageError(f"SyntheticSource features must be a positive int or shape, got {features!r}.")
        if kind not in self.KINDS:
            raise UsageError(f"SyntheticSource kind must be one of {self.KINDS}, got {kind!r}.")
        try:
            self._dtype = np.dtype(dtype)
        except TypeError:
            raise UsageError(f"SyntheticSource dtype {dtype!r} is not a numpy dtype.") from None
        if not jnp.issubdtype(self._dtype, jnp.floating):
            raise UsageError(f"SyntheticSource needs a float dtype, got {self._dtype}.")
        self._num_rows, self._shape, self._seed = int(num_rows), tuple(int(s) for s in shape), int(seed)
        self._kind, self._chunk_rows, self._targets, self._noise = kind, int(chunk_rows), bool(targets), float(noise)
        model = np.random.default_rng([self._seed, 2**31])
        self.coef = model.normal(size=self._shape)
        self.intercept = float(model.normal())

    @property
    def num_rows(self) -> int:
        return self._num_rows

    @property
    def spec(self) -> PyTree:
        x = jax.ShapeDtypeStruct(self._shape, self._dtype)
        return (x, jax.ShapeDtypeStruct((), self._dtype)) if self._targets else x

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray | None]:
        rng = np.random.default_rng([self._seed, b])
        n = min(self._chunk_rows, self._num_rows - b * self._chunk_rows)
        size = (n,) + self._shape
        x = rng.standard_normal(size) if self._kind == "normal" else rng.random(size)
        if not self._targets:
            return x, None
        axes = tuple(range(1, x.ndim))
        y = np.tensordot(x, self.coef, axes=(axes, tuple(range(len(axes))))) + self.intercept
        return x, y + self._noise * rng.standard_normal(n)

    def read(self, start: int, stop: int) -> PyTree:
        self._check_range(start, stop)
        xs, ys = [np.zeros((0,) + self._shape)], [np.zeros(0)]
        for b in range(start // self._chunk_rows, math.ceil(stop / self._chunk_rows)):
            lo, hi = start - b * self._chunk_rows, stop - b * self._chunk_rows
            x, y = self._block(b)
            xs.append(x[max(lo, 0) : hi])
            if y is not None:
                ys.append(y[max(lo, 0) : hi])
        x = np.concatenate(xs).astype(self._dtype)
        return (x, np.concatenate(ys).astype(self._dtype)) if self._targets else x

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "seed": self._seed,
            "kind": self._kind,
            "chunk_rows": self._chunk_rows,
            "targets": self._targets,
            "noise": self._noise,
        }


class IteratorSource(Source):
    """A Python iterable of numpy batches (arrays, or pytrees such as ``(X, y)``), read forward.

    Batches may have any number of rows; together they must hold ``num_rows`` rows. The
    source is sequential (see the module docstring): with several processes each one
    iterates the whole stream and keeps only its own rows, so prefer a random-access
    source for multi-host jobs. It is resumable only when the
    iterable has ``get_state()`` and ``set_state(state)``; then ``iter(iterable)`` after
    ``set_state`` must continue from that state.

    Args:
      batches: the iterable. Iterated once per run from row 0; a plain one-shot iterator
        can therefore be run only once.
      num_rows: the rows it yields in all.
      spec: the row spec (pytree of ``jax.ShapeDtypeStruct``); by default taken from the
        first batch.
    """

    # Batch boundaries kept for ``state_at``: far more than any prefetch lookahead.
    HISTORY = 1 << 14

    def __init__(self, batches: Iterable[PyTree], num_rows: int, spec: PyTree = None):
        if isinstance(num_rows, bool) or not isinstance(num_rows, (int, np.integer)) or num_rows < 0:
            raise UsageError(f"IteratorSource num_rows must be a non-negative integer, got {num_rows!r}.")
        if not isinstance(batches, Iterable):
            raise UsageError(f"IteratorSource needs an iterable of numpy batches, got {type(batches).__name__}.")
        self._batches, self._num_rows = batches, int(num_rows)
        self._lock = threading.Lock()
        self._initial_state = batches.get_state() if self.resumable else None
        self._restart(0, None)
        if spec is None:
            first = self._next_batch()
            if first is None:
                raise UsageError("IteratorSource's iterable yielded no batch; pass spec= for an empty one.")
            spec = jax.tree.map(lambda x: _row_spec(x.shape, x.dtype), first)
            self._pending = first
        for s in jax.tree.leaves(spec):
            check_numeric(s.dtype, "IteratorSource")
        self._spec = spec

    @property
    def num_rows(self) -> int:
        return self._num_rows

    @property
    def spec(self) -> PyTree:
        return self._spec

    @property
    def resumable(self) -> bool:
        return callable(getattr(self._batches, "get_state", None)) and callable(
            getattr(self._batches, "set_state", None)
        )

    @property
    def sequential(self) -> bool:
        return True

    def _restart(self, position: int, state: Any) -> None:
        self._iter = iter(self._batches)
        self._position = position          # global row of the first row of self._buffer
        self._buffer: PyTree = None        # the current batch, sliced past consumed rows
        self._pending: PyTree = None       # a batch drawn to learn the spec, not yet used
        self._boundaries: collections.deque = collections.deque(maxlen=self.HISTORY)
        self._state_before = state

    def _next_batch(self) -> PyTree:
        if self.resumable:
            self._state_before = self._batches.get_state()
        batch = next(self._iter, None)
        if batch is None:
            return None
        batch = jax.tree.map(np.asarray, batch)
        rows = {x.shape[0] if x.ndim else None for x in jax.tree.leaves(batch)}
        if len(rows) != 1 or None in rows:
            raise UsageError("IteratorSource got a batch whose leaves lack one common leading row dimension.")
        return batch

    def _fill(self) -> int:
        """Makes ``self._buffer`` hold at least one row; returns its row count."""
        while self._buffer is None or _rows(self._buffer) == 0:
            batch, self._pending = (self._pending, None) if self._pending is not None else (self._next_batch(), None)
            if batch is None:
                raise UsageError(
                    f"IteratorSource's iterable ended at row {self._position}, before its num_rows={self._num_rows}."
                )
            got = jax.tree.map(lambda x: _row_spec(x.shape, x.dtype), batch)
            if jax.tree.structure(got) != jax.tree.structure(self._spec) or got != self._spec:
                raise UsageError(f"IteratorSource got a batch with rows {got}; expected {self._spec}.")
            self._boundaries.append((self._position, self._state_before))
            self._buffer = batch
        return _rows(self._buffer)

    def read(self, start: int, stop: int) -> PyTree:
        self._check_range(start, stop)
        with self._lock:
            if start < self._position:
                raise ValueError(f"IteratorSource reads forward only: row {start} is before row {self._position}.")
            pieces = []
            while self._position < stop:
                n = self._fill()
                skip = max(start - self._position, 0)
                take = min(n, stop - self._position)
                if skip < take:
                    pieces.append(jax.tree.map(lambda x, a=skip, b=take: x[a:b], self._buffer))
                self._buffer = jax.tree.map(lambda x, t=take: x[t:], self._buffer)
                self._position += take
        empty = jax.tree.map(lambda s: np.zeros((0,) + s.shape, s.dtype), self._spec)
        return jax.tree.map(lambda *xs: np.concatenate(xs), empty, *pieces)

    def state_at(self, cursor: int) -> dict[str, Any]:
        """The iterable's state before the batch holding row ``cursor``, and rows to skip in it.

        Raises:
          UsageError: the iterable exposes no state, or ``cursor`` was not read recently.
        """
        if cursor == 0:
            return {}
        if not self.resumable:
            raise UsageError(self._cannot_resume(cursor))
        with self._lock:
            for first, state in reversed(self._boundaries):
                if first <= cursor:
                    return {"iterator": state, "skip": cursor - first}
        raise UsageError(f"IteratorSource has no record of row {cursor}; it was read too long ago or not yet.")

    def seek(self, cursor: int, state: dict[str, Any] | None = None) -> None:
        super().seek(cursor)
        with self._lock:
            if cursor == 0 and not state:
                if self._position == 0 and self._buffer is None:
                    return  # fresh: keep the batch drawn for the spec
                if self.resumable:
                    self._batches.set_state(self._initial_state)
                elif self._batches is iter(self._batches):
                    raise UsageError("IteratorSource's one-shot iterator was already read; pass a re-iterable.")
                self._restart(0, None)
                return
            if not self.resumable:
                raise UsageError(self._cannot_resume(cursor))
            if not state or "iterator" not in state:
                raise UsageError(f"cannot resume IteratorSource at row {cursor} without the state saved with it.")
            self._batches.set_state(state["iterator"])
            self._restart(cursor - int(state["skip"]), state["iterator"])
        self.read(cursor, cursor)  # skips to the cursor within the first batch

    def _cannot_resume(self, cursor: int) -> str:
        return (
            f"cannot resume at row {cursor}: IteratorSource over a {type(self._batches).__name__} is not resumable "
            "(it has no get_state/set_state); restart from row 0 or use a seekable source."
        )


def _rows(tree: PyTree) -> int:
    return int(jax.tree.leaves(tree)[0].shape[0])


class TreeSource(Source):
    """A pytree of sources with equal row counts, read together (e.g. ``(X, y)``)."""

    def __init__(self, sources: PyTree):
        self._sources, self._treedef = jax.tree.flatten(sources, is_leaf=lambda s: isinstance(s, Source))
        if not self._sources or not all(isinstance(s, Source) for s in self._sources):
            raise UsageError("TreeSource needs a non-empty pytree whose leaves are all Sources.")
        counts = [s.num_rows for s in self._sources]
        if len(set(counts)) > 1:
            names = ", ".join(f"{type(s).__name__}: {n}" for s, n in zip(self._sources, counts, strict=True))
            raise UsageError(f"the sources have different row counts ({names}); every source needs the same rows.")

    @property
    def num_rows(self) -> int:
        return self._sources[0].num_rows

    @property
    def spec(self) -> PyTree:
        return self._treedef.unflatten([s.spec for s in self._sources])

    @property
    def resumable(self) -> bool:
        return all(s.resumable for s in self._sources)

    @property
    def sequential(self) -> bool:
        return any(s.sequential for s in self._sources)

    def read(self, start: int, stop: int) -> PyTree:
        return self._treedef.unflatten([s.read(start, stop) for s in self._sources])

    def state_at(self, cursor: int) -> dict[str, Any]:
        states = [s.state_at(cursor) for s in self._sources]
        return {"sources": states} if any(states) else {}

    def seek(self, cursor: int, state: dict[str, Any] | None = None) -> None:
        states = (state or {}).get("sources") or [{}] * len(self._sources)
        for s, st in zip(self._sources, states, strict=True):
            s.seek(cursor, st)

    def describe(self) -> dict[str, Any]:
        return {"source": "TreeSource", "sources": self._treedef.unflatten([s.describe() for s in self._sources])}


def as_source(data: Any) -> Source:
    """Wraps ``data`` as a Source.

    Args:
      data: a Source, a numpy array, a pytree of arrays, or a pytree of Sources (arrays
        may stand among them); every leaf needs the same number of rows.
    """
    if isinstance(data, Source):
        return data
    leaves = jax.tree.leaves(data, is_leaf=lambda s: isinstance(s, Source))
    if not any(isinstance(s, Source) for s in leaves):
        return ArraySource(data)
    return TreeSource(jax.tree.map(lambda s: s if isinstance(s, Source) else ArraySource(s), data,
                                   is_leaf=lambda s: isinstance(s, Source)))
