"""Checkpoint and resume inside one process: exactly-once, elastic, preemption, fingerprints."""

import os
import signal

import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan.identity import fingerprint_difference
from tests.helpers import CrashError, assert_usage_error, crash_at, f64, rel_err

KW = {"microbatch": 8, "steps_per_call": 2}  # 8 devices: 128 rows per step


def rows(n=1009, d=5, seed=0):
    return np.random.default_rng(seed).normal(size=(n, d)).astype(np.float32)



def listing(directory):
    return sorted((root, tuple(sorted(files))) for root, _, files in os.walk(directory))


def test_crash_and_rerun_counts_every_row_once_bitwise(tmp_path):
    x = rows()
    want, _ = ss.run_with_report(ss.Gram(), x, mesh="data:8", **KW)
    options = ss.CheckpointOptions(str(tmp_path), every_steps=2, keep=3)
    with pytest.raises(CrashError):
        ss.run(ss.Gram(), x, mesh="data:8", checkpoint=options, progress=crash_at(5), **KW)
    got, report = ss.run_with_report(ss.Gram(), x, mesh="data:8", checkpoint=options, **KW)
    assert report.resumed_from_cursor == 4 * 128 and report.resumed_from_step == 4
    assert report.rows_this_run == 1009 - 512 and report.steps == 4
    np.testing.assert_array_equal(got, want)
    assert rel_err(got, f64(x).T @ f64(x)) < 1e-5
    assert len(os.listdir(tmp_path)) <= 3  # keep
    # The finished checkpoint: a rerun folds nothing and gives the same result.
    again, report = ss.run_with_report(ss.Gram(), x, mesh="data:8", checkpoint=options, **KW)
    assert report.steps == 0 and report.resumed_from_cursor == 1009
    np.testing.assert_array_equal(again, want)


def test_elastic_resume_on_another_device_count(tmp_path):
    x = rows()  # test_crash_and_rerun's rows, and test_compact_checkpoint's shapes: their programs on data:8
    hist = ss.Histogram(bins=7, range=(-2.0, 2.0))
    for combiner in (ss.Gram(), hist):
        options = ss.CheckpointOptions(str(tmp_path / type(combiner).__name__), every_steps=1)
        with pytest.raises(CrashError):
            ss.run(combiner, x, mesh="data:8", checkpoint=options, progress=crash_at(4), **KW)
        # 8 partials folded into one, laid out over 3 devices as [merged, init, init].
        got, report = ss.run_with_report(combiner, x, mesh="data:3", checkpoint=options, **KW)
        assert report.resumed_from_cursor == 3 * 128 and report.devices == 3
        if combiner is hist:  # integer counts: exact
            np.testing.assert_array_equal(got.counts, hist_counts(x, 7, -2.0, 2.0))
        else:
            assert rel_err(got, f64(x).T @ f64(x)) < 1e-5


def hist_counts(x, bins, lo, hi):
    return np.stack([np.histogram(x[:, j], bins, (lo, hi))[0] for j in range(x.shape[1])])


def test_fixed_logical_shards_resume_bitwise_on_fewer_devices(tmp_path):
    x = rows(2000, d=4)
    options = ss.CheckpointOptions(str(tmp_path), every_steps=1)
    kw = dict(KW, logical_shards=8)
    want = ss.run(ss.Gram(), x, mesh="data:8", **kw)
    with pytest.raises(CrashError):
        ss.run(ss.Gram(), x, mesh="data:8", checkpoint=options, progress=crash_at(3), **kw)
    got, report = ss.run_with_report(ss.Gram(), x, mesh="data:4", checkpoint=options, **kw)
    assert report.resumed_from_cursor is not None and report.devices == 4
    np.testing.assert_array_equal(got, want)


def test_sigterm_saves_and_raises_preempted_then_resumes_bitwise(tmp_path):
    x = rows(1200, d=6)
    options = ss.CheckpointOptions(str(tmp_path), every_steps=None, every_seconds=None)

    def sigterm_at_3(p):
        if p.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ss.Preempted) as stop:
        ss.run(ss.Moments(), x, mesh="data:8", checkpoint=options, progress=sigterm_at_3, **KW)
    assert signal.getsignal(signal.SIGTERM) is previous  # handler restored
    assert "rerun the same command" in str(stop.value)
    assert stop.value.cursor in (3 * 128, 4 * 128)  # the step boundary after the signal
    got, report = ss.run_with_report(ss.Moments(), x, mesh="data:8", checkpoint=options, **KW)
    assert report.resumed_from_cursor == stop.value.cursor
    want = ss.run(ss.Moments(), x, mesh="data:8", **KW)
    for field in want._fields:
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field))


def test_ctrl_c_saves_and_stops_like_sigterm_and_a_second_one_would_abort(tmp_path):
    x = rows(1200, d=6)
    options = ss.CheckpointOptions(str(tmp_path), every_steps=None, every_seconds=None)
    second = []

    def ctrl_c_at_3(p):
        if p.step == 3:
            os.kill(os.getpid(), signal.SIGINT)
            second.append(signal.getsignal(signal.SIGINT))

    previous = signal.getsignal(signal.SIGINT)
    with pytest.raises(ss.Preempted) as stop:
        ss.run(ss.Moments(), x, mesh="data:8", checkpoint=options, progress=ctrl_c_at_3, **KW)
    assert second == [signal.SIG_DFL]  # a second Ctrl-C ends the process at once
    assert signal.getsignal(signal.SIGINT) is previous
    assert str(stop.value).startswith("interrupted (SIGINT): saved a checkpoint at row 384")
    got, report = ss.run_with_report(ss.Moments(), x, mesh="data:8", checkpoint=options, **KW)
    assert report.resumed_from_cursor == 384
    want = ss.run(ss.Moments(), x, mesh="data:8", **KW)
    for field in want._fields:
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field))


HIST = ss.Histogram(bins=4, range=(-1.0, 1.0))


@pytest.fixture(scope="module")
def crashed_histogram(tmp_path_factory):
    """A checkpoint directory of a Histogram run that stopped after step 3."""
    directory = tmp_path_factory.mktemp("crashed")
    options = ss.CheckpointOptions(str(directory), every_steps=1)
    with pytest.raises(CrashError):
        ss.run(HIST, rows(1009, d=5), mesh="data:8", checkpoint=options, progress=crash_at(3), **KW)
    return options


@pytest.mark.parametrize(
    "change, words",
    [
        ({"combiner": ss.Histogram(bins=5, range=(-1.0, 1.0))}, ["combiner.bins", "4", "5"]),
        ({"data": rows(1009, d=5).astype(np.float16)}, ["data.spec", "float32", "float16"]),
        ({"data": rows(1010, d=5)}, ["data.num_rows", "1009", "1010"]),
        ({"microbatch": 16}, ["microbatch is 8 there but 16 here", "resume with microbatch=8"]),  # a default may change
        ({"compensated": False}, ["combiner.compensated"]),
    ],
)
def test_fingerprint_mismatch_is_one_line_and_keeps_the_checkpoint(crashed_histogram, change, words):
    directory = crashed_histogram.directory
    before = listing(directory)
    args = {"combiner": HIST, "data": rows(1009, d=5), "microbatch": 8, "compensated": True, **change}
    assert_usage_error(
        lambda: ss.run(args.pop("combiner"), args.pop("data"), mesh="data:8", checkpoint=crashed_histogram,
                       steps_per_call=2, **args),
        ["different job", directory, *words],
    )
    assert listing(directory) == before


def test_fingerprint_difference_names_the_field():
    a = {"combiner": {"combiner": "Gram"}, "data": {"num_rows": 10, "spec": "float32[3]"}}
    assert fingerprint_difference(a, a) is None
    b = {"combiner": {"combiner": "Gram"}, "data": {"num_rows": 11, "spec": "float32[3]"}}
    assert fingerprint_difference(a, b) == "data.num_rows is 10 there but 11 here"


def test_bad_checkpoint_arguments_are_usage_errors(tmp_path):
    x = rows(10)
    assert_usage_error(lambda: ss.CheckpointOptions(str(tmp_path), every_steps=0), ["every_steps"])
    assert_usage_error(lambda: ss.run(ss.Gram(), x, checkpoint=3), ["checkpoint must be"])
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if not os.access(locked, os.W_OK):  # root can write anywhere
            assert_usage_error(lambda: ss.run(ss.Gram(), x, checkpoint=str(locked / "c")), ["not writable"])
    finally:
        locked.chmod(0o700)


def test_a_session_saves_before_any_restore_and_a_run_resumes_from_that_save(tmp_path):
    from sharded_scan.checkpoint import Checkpointer
    from sharded_scan.engine import checkpoint_job
    from sharded_scan.program import build_program

    x = rows()
    program = build_program(ss.Gram(), ss.sources.as_source(x), ss.RunOptions(mesh="data:8", **KW))
    ckpt = Checkpointer(ss.CheckpointOptions(str(tmp_path), every_seconds=None))
    session = ckpt.open(checkpoint_job(program))  # the job is named here: no restore_latest needed first
    session.save(256, 2, program.init())  # identity partials, as if rows 0..255 folded nothing
    session.close()
    assert session.written == 1 and sorted(os.listdir(tmp_path)) == ["256"]
    again = ckpt.open(checkpoint_job(program))
    restored = again.restore_latest()
    again.close()
    assert (restored.cursor, restored.steps, restored.source_state) == (256, 2, {})
    got, report = ss.run_with_report(ss.Gram(), x, mesh="data:8", checkpoint=str(tmp_path), **KW)
    assert report.resumed_from_cursor == 256 and report.resumed_from_step == 2
    assert rel_err(got, f64(x[256:]).T @ f64(x[256:])) < 1e-5  # only the rows after the save
