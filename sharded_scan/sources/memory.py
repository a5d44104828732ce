"""Sources held in memory or generated: numpy arrays and deterministic synthetic rows."""

from __future__ import annotations

import collections.abc
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sharded_scan.dtypes import check_numeric
from sharded_scan.errors import UsageError
from sharded_scan.sources.base import PyTree, Source, check_unmasked, row_spec


def not_rows(data: Any, leaves: list[Any]) -> str | None:
    """What is wrong with ``data`` when a leaf is not an array of rows (a phrase with the fix), or None."""
    for leaf in leaves:
        if isinstance(leaf, (str, os.PathLike)):
            return f"data is the path {os.fspath(leaf)!r}, not rows; read it with {reader_of(os.fspath(leaf))}"
        if isinstance(leaf, (collections.abc.Iterator, collections.abc.Generator)):
            return (f"data is a {type(leaf).__name__}, not rows; wrap it as sharded_scan.sources.IteratorSource(it, "
                    "num_rows) (it yields batches of rows)")
        if type(leaf).__module__.split(".")[0] == "pandas":
            dtypes = sorted({str(t) for t in np.atleast_1d(getattr(leaf, "dtypes", getattr(leaf, "dtype", "?")))})
            if np.asarray(leaf).dtype == object:
                return (f"data is a pandas {type(leaf).__name__} with dtypes {', '.join(dtypes)}, which numpy reads as "
                        "dtype object; pass df.astype('float64') (missing values become NaN) or "
                        "df.select_dtypes('number').to_numpy()")
    if isinstance(data, (list, tuple)) and leaves and all(isinstance(x, (bool, int, float)) for x in leaves):
        return f"data is a Python {type(data).__name__} of {len(leaves)} numbers; pass np.asarray(data) for rows"
    return None


# The source that reads a file, by its name's ending.
READERS = {
    (".parquet", ".pq", ".arrow", ".feather", ".ipc"): "sharded_scan.sources.ParquetSource(path, columns=...)",
    (".csv", ".tsv", ".txt"): "sharded_scan.sources.CsvSource(path, columns=...)",
    (".zarr",): "sharded_scan.sources.ZarrSource(path)",
}


def reader_of(path: str) -> str:
    """The source (a phrase) that reads the file or directory ``path``, guessed from its name."""
    name = path.rstrip("/").lower()
    found = next((reader for endings, reader in READERS.items() if name.endswith(endings)), None)
    return found or ("sharded_scan.sources.NpySource(path) (NpyShardsSource for a directory of .npy shards, "
                     "ParquetSource, CsvSource or ZarrSource for those formats)")


class ArraySource(Source):
    """Rows held in memory: a numpy array or a pytree of arrays with equal row counts."""

    def __init__(self, data: PyTree):
        problem = not_rows(data, [data])  # before flattening: JAX warns on a generator
        if problem is not None:
            raise UsageError(f"{problem}.")
        leaves, self._treedef = jax.tree.flatten(data)
        if not leaves:
            raise UsageError("the data has no arrays; pass a numpy array or a pytree such as (X, y).")
        problem = not_rows(data, leaves)
        if problem is not None:
            raise UsageError(f"{problem}.")
        self._leaves = [np.asarray(check_unmasked(x, "the data")) for x in leaves]
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
        return self._treedef.unflatten([row_spec(x.shape, x.dtype) for x in self._leaves])

    def read(self, start: int, stop: int) -> PyTree:
        return self._treedef.unflatten([x[start:stop] for x in self._leaves])


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
