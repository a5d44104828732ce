"""grain input: a grain dataset iterator (here over ArrayRecord files) resumes exactly once through
the checkpoint, as an ``IteratorSource`` saving the iterator's own state."""

import contextlib

import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan.sources import IteratorSource
from tests.helpers import CrashError, crash_at

grain = pytest.importorskip("grain")
array_record_module = pytest.importorskip("array_record.python.array_record_module")

ROWS, D, BATCH = 1000, 3, 48  # ragged: the last batch holds 40 rows


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """Rows with a large mean, written as one ArrayRecord file of one record per row."""
    x = (1e4 + np.random.default_rng(0).normal(size=(ROWS, D))).astype(np.float32)
    path = str(tmp_path_factory.mktemp("grain") / "rows.array_record")
    writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
    for row in x:
        writer.write(row.tobytes())
    writer.close()
    return x, path


def grain_iterator(path):
    """The user's grain pipeline: ArrayRecord records decoded into float32 rows, in batches."""
    records = grain.sources.ArrayRecordDataSource([path])
    dataset = grain.MapDataset.source(records).map(lambda r: np.frombuffer(r, np.float32)).batch(BATCH)
    return iter(dataset.to_iter_dataset())


def test_a_grain_iterator_over_array_record_resumes_exactly_once(rows, tmp_path):
    x, path = rows
    options = dict(mesh="data:2", microbatch=16, steps_per_call=2)
    whole = ss.run(ss.Moments(), IteratorSource(grain_iterator(path), ROWS), **options)
    np.testing.assert_allclose(whole.mean, x.astype(np.float64).mean(0), rtol=1e-7)
    np.testing.assert_allclose(whole.var, x.astype(np.float64).var(0), rtol=1e-4)
    assert int(whole.count) == ROWS

    checkpoint = ss.CheckpointOptions(str(tmp_path / "ck"), every_steps=1)
    with contextlib.suppress(CrashError):
        ss.run(ss.Moments(), IteratorSource(grain_iterator(path), ROWS), checkpoint=checkpoint,
               progress=crash_at(3), **options)
    resumed, report = ss.run_with_report(ss.Moments(), IteratorSource(grain_iterator(path), ROWS),
                                         checkpoint=checkpoint, **options)
    assert report.resumed_from_cursor and 0 < report.rows_this_run < ROWS
    for got, want in zip(resumed, whole, strict=True):  # every row once: bitwise the uninterrupted run
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
