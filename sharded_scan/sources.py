"""Sources: where rows come from. Each one reads a row range into host numpy.

A source has ``num_rows``, ``spec`` (a pytree of ``jax.ShapeDtypeStruct`` giving the
shape and dtype of one row of each leaf) and ``read(start, stop)`` returning that
range as a pytree of numpy arrays. ``read`` must be safe to call from a reader thread.
"""

from __future__ import annotations

import abc
from typing import Any

import jax
import numpy as np

from sharded_scan.combiners.base import check_numeric
from sharded_scan.errors import UsageError

PyTree = Any


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

    def describe(self) -> dict[str, Any]:
        """What identifies the data for a checkpoint fingerprint: kind, rows, row spec."""
        return {
            "source": type(self).__name__,
            "num_rows": self.num_rows,
            "spec": jax.tree.map(lambda s: f"{np.dtype(s.dtype).name}{list(s.shape)}", self.spec),
        }


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
        return self._treedef.unflatten(
            [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in self._leaves]
        )

    def read(self, start: int, stop: int) -> PyTree:
        return self._treedef.unflatten([x[start:stop] for x in self._leaves])


def as_source(data: Any) -> Source:
    """Wraps ``data`` (a Source, a numpy array or a pytree of arrays) as a Source."""
    if isinstance(data, Source):
        return data
    return ArraySource(data)
