"""A Python iterable of batches as a sequential source, resumable through its own state."""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from sharded_scan.dtypes import check_numeric
from sharded_scan.errors import UsageError
from sharded_scan.sources.base import PyTree, Source, check_unmasked, num_rows_of, row_spec


class IteratorSource(Source):
    """A Python iterable of numpy batches (arrays, or pytrees such as ``(X, y)``), read forward.

    Batches may have any number of rows; together they must hold exactly ``num_rows``
    rows (fewer or more is one :class:`UsageError` line naming both numbers). The
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
        if self.resumable:
            try:
                json.dumps(self._initial_state)
            except (TypeError, ValueError):
                raise UsageError(
                    f"IteratorSource: {type(batches).__name__}.get_state() returned a "
                    f"{type(self._initial_state).__name__} that is not JSON; checkpoints store it as JSON."
                ) from None
        self._restart(0, None)
        if spec is None:
            first = self._next_batch()
            if first is None:
                raise UsageError("IteratorSource's iterable yielded no batch; pass spec= for an empty one.")
            spec = jax.tree.map(lambda x: row_spec(x.shape, x.dtype), first)
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

    @property
    def rereadable(self) -> bool:
        """True unless the iterable is a one-shot iterator without ``get_state``/``set_state``."""
        return self.resumable or iter(self._batches) is not self._batches

    def _restart(self, position: int, state: Any) -> None:
        self._iter = iter(self._batches)
        self._position = position          # global row of the first row of self._buffer
        self._buffer: PyTree = None        # the current batch, sliced past consumed rows
        self._pending: PyTree = None       # a batch drawn to learn the spec, not yet used
        self._boundaries: collections.deque = collections.deque(maxlen=self.HISTORY)
        self._state_before = state
        self._end_checked = False

    def _next_batch(self) -> PyTree:
        if self.resumable:
            self._state_before = self._batches.get_state()
        batch = next(self._iter, None)
        if batch is None:
            return None
        batch = jax.tree.map(lambda x: np.asarray(check_unmasked(x, "IteratorSource's batch")), batch)
        rows = {x.shape[0] if x.ndim else None for x in jax.tree.leaves(batch)}
        if len(rows) != 1 or None in rows:
            raise UsageError("IteratorSource got a batch whose leaves lack one common leading row dimension.")
        return batch

    def _fill(self) -> int:
        """Makes ``self._buffer`` hold at least one row; returns its row count."""
        while self._buffer is None or num_rows_of(self._buffer) == 0:
            batch, self._pending = (self._pending, None) if self._pending is not None else (self._next_batch(), None)
            if batch is None:
                raise UsageError(
                    f"IteratorSource's iterable ended at row {self._position}, before its num_rows={self._num_rows}."
                )
            got = jax.tree.map(lambda x: row_spec(x.shape, x.dtype), batch)
            if jax.tree.structure(got) != jax.tree.structure(self._spec) or got != self._spec:
                raise UsageError(f"IteratorSource got a batch with rows {got}; expected {self._spec}.")
            self._boundaries.append((self._position, self._state_before))
            self._buffer = batch
        return num_rows_of(self._buffer)

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
            if stop == self._num_rows and not self._end_checked:
                self._end_checked = True
                self._check_no_more_rows()
        empty = jax.tree.map(lambda s: np.zeros((0,) + s.shape, s.dtype), self._spec)
        return jax.tree.map(lambda *xs: np.concatenate(xs), empty, *pieces)

    def _check_no_more_rows(self) -> None:
        """Raises when the iterable holds rows past ``num_rows`` (they would be dropped silently).

        Counts them (up to ``num_rows`` more) so that the message names the real total.
        """
        extra = sum(num_rows_of(b) for b in (self._buffer, self._pending) if b is not None)
        while extra <= max(self._num_rows, 1 << 16):
            batch = self._next_batch()
            if batch is None:
                break
            extra += num_rows_of(batch)
        else:
            raise UsageError(
                f"IteratorSource's iterable yields more than {self._num_rows + extra} rows, not num_rows="
                f"{self._num_rows} (it may be endless); pass the right num_rows, or itertools.islice the iterable's "
                "batches to the rows you mean."
            )
        if extra:
            raise UsageError(
                f"IteratorSource's iterable yields {self._num_rows + extra} rows, not num_rows={self._num_rows}: "
                f"the last {extra} would be dropped; pass num_rows={self._num_rows + extra}, or itertools.islice the "
                "iterable's batches to the rows you mean."
            )

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
