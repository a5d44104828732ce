"""Data a job config can name with ``--config.data.kind=python --config.data.factory=tests.jobs:NAME``."""

from __future__ import annotations

import os
import time

import numpy as np

from sharded_scan.sources import IteratorSource, SyntheticSource

BATCH_ROWS = (97, 131, 256)  # ragged against every step size


class ResumableBatches:
    """Deterministic ragged batches of ``(rows, features)`` with ``get_state``/``set_state``,
    like a grain iterator: ``iter()`` continues from the current state."""

    def __init__(self, num_rows: int, features: int, seed: int = 0, hold: str | None = None):
        self.num_rows, self.features, self.seed, self.hold = num_rows, features, seed, hold
        self._batch, self._row = 0, 0

    def get_state(self) -> dict:
        return {"batch": self._batch, "row": self._row}

    def set_state(self, state: dict) -> None:
        self._batch, self._row = int(state["batch"]), int(state["row"])

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        if self._row >= self.num_rows:
            raise StopIteration
        n = min(BATCH_ROWS[self._batch % len(BATCH_ROWS)], self.num_rows - self._row)
        rows = np.random.default_rng([self.seed, self._batch]).normal(3.0, 2.0, size=(n, self.features))
        self._batch, self._row = self._batch + 1, self._row + n
        while self.hold and self._row > 3 * self.num_rows // 4 and not os.path.exists(self.hold):
            time.sleep(0.01)  # a reader waiting for its data, as a slow store's would
        return rows.astype(np.float32)

    def all_rows(self) -> np.ndarray:
        """Every row, from a fresh copy (the reference)."""
        fresh = ResumableBatches(self.num_rows, self.features, self.seed)
        return np.concatenate(list(fresh))


def iterator_source(num_rows: int = 5000, features: int = 3, hold: str | None = None) -> IteratorSource:
    """An IteratorSource over fresh :class:`ResumableBatches`."""
    return IteratorSource(ResumableBatches(num_rows, features, hold=hold), num_rows)


HOLD = "SHARDED_SCAN_TEST_HOLD"


def held_iterator_source() -> IteratorSource:
    """40,000 rows of 4 features; where ``$SHARDED_SCAN_TEST_HOLD`` names a file, the reader waits past row
    30,000 until that file exists: a run to kill mid-way, on a machine of any speed."""
    return iterator_source(40_000, 4, hold=os.environ.get(HOLD))


class HeldSynthetic(SyntheticSource):
    """:class:`SyntheticSource`'s rows; a read past row ``hold_after`` waits while ``hold`` names a file that does
    not exist (a reader waiting for its data, as a slow store's would)."""

    def __init__(self, num_rows: int, features: int, hold: str | None, hold_after: int):
        super().__init__(num_rows, features)
        self.hold, self.hold_after = hold, hold_after

    def read(self, start: int, stop: int) -> np.ndarray:
        while self.hold and stop > self.hold_after and not os.path.exists(self.hold):
            time.sleep(0.01)
        return super().read(start, stop)


def held_synthetic_source(num_rows: int, features: int, hold_after: int) -> HeldSynthetic:
    """The synthetic kind's rows (``SyntheticSource(num_rows, features)``, the config's defaults); where
    ``$SHARDED_SCAN_TEST_HOLD`` names a file, this process's reader waits past row ``hold_after`` until that file
    exists: a multi-process run one of whose processes stops reading there, to kill mid-way on a machine of any
    speed."""
    return HeldSynthetic(num_rows, features, os.environ.get(HOLD), hold_after)
