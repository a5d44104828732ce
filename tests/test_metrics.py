"""Metrics and profiling: TensorBoard scalars, a profiler window, the tqdm bar, chained callbacks."""

import glob
import io
import sys

import numpy as np
import pytest

import sharded_scan as ss
from launch.metrics import TAGS, MetricsWriter, ProfileWindow, combine, parse_steps
from sharded_scan import progress as progress_module
from tests.helpers import assert_usage_error
from tests.tfrecords import read_scalars

KW = dict(microbatch=2, steps_per_call=2)  # 8 devices x 2 x 2 = 32 rows a step: 100 rows in 4 steps
X = np.random.default_rng(0).normal(size=(100, 5)).astype(np.float32)
ROW_BYTES = 5 * 4


def stop_at(step):
    def progress(p):
        if p.step == step:
            raise RuntimeError(f"stopped at step {step}")

    return progress


def test_tensorboard_scalars_by_step_over_a_killed_and_resumed_run(tmp_path):
    checkpoint = ss.CheckpointOptions(tmp_path / "ck", every_steps=1, every_seconds=None)
    with pytest.raises(RuntimeError, match="step 3"), combine(MetricsWriter(tmp_path / "tb", ROW_BYTES),
                                                               stop_at(3)) as progress:
        ss.run(ss.Sum(), X, checkpoint=checkpoint, progress=progress, **KW)  # saved after steps 1 and 2
    with MetricsWriter(tmp_path / "tb", row_bytes=ROW_BYTES) as writer:
        result = ss.run(ss.Sum(), X, checkpoint=checkpoint, progress=writer, **KW)  # resumes at step 2
    assert result.count == 100

    scalars = read_scalars(tmp_path / "tb")
    assert set(scalars) == set(TAGS)
    steps = {tag: [step for step, _ in values] for tag, values in scalars.items()}
    assert steps["progress"] == [1, 2, 3, 3, 4]  # the killed run's step 3, then the resumed run's steps 3 and 4
    np.testing.assert_allclose([v for _, v in scalars["progress"]], [0.32, 0.64, 0.96, 0.96, 1.0], rtol=1e-6)
    assert steps["step_seconds"] == steps["rows_per_second"] == steps["bytes_per_second"] == [2, 3, 4]  # no first steps
    assert steps["checkpoint_seconds"] == [1, 2, 3]  # each save, reported with the step after it
    assert all(v > 0 for tag in ("step_seconds", "checkpoint_seconds", "rows_per_second") for _, v in scalars[tag])
    for (_, rows), (_, bytes_), (_, seconds) in zip(scalars["rows_per_second"], scalars["bytes_per_second"],
                                                    scalars["step_seconds"], strict=True):
        np.testing.assert_allclose(bytes_, rows * ROW_BYTES, rtol=1e-5)
        assert rows * seconds == pytest.approx(32, rel=1e-4) or rows * seconds == pytest.approx(4, rel=1e-4)


def test_metrics_writer_without_tensorboardx_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    assert_usage_error(lambda: MetricsWriter(tmp_path), ["pip install tensorboardX", "sharded_scan[metrics]"])


def test_profile_window_traces_its_steps_and_stops_when_the_run_fails(tmp_path):
    window = ProfileWindow(2, 3, tmp_path / "ok")
    with window:
        ss.run(ss.Sum(), X, progress=window, **KW)
        assert window.trace_dir == str(tmp_path / "ok") and not window._tracing  # stopped after step 3
    assert glob.glob(str(tmp_path / "ok" / "plugins" / "profile" / "*" / "*.xplane.pb"))

    with pytest.raises(RuntimeError, match="step 2"), combine(ProfileWindow(1, 4, tmp_path / "failed"),
                                                               stop_at(2)) as progress:
        ss.run(ss.Sum(), X, progress=progress, **KW)
    assert glob.glob(str(tmp_path / "failed" / "plugins" / "profile" / "*" / "*.xplane.pb"))


@pytest.mark.parametrize("text, want", [("2:5", (2, 5)), (" 3 : 3 ", (3, 3)), ("7", (7, 7))])
def test_parse_steps(text, want):
    assert parse_steps(text) == want


@pytest.mark.parametrize(
    "text, words",
    [("a:b", ["'A:B'", "'a:b'"]), ("1:2:3", ["'A:B'"]), ("", ["'A:B'"]), ("5:2", ["'5:2'", "end before"]),
     ("-1:3", ["count from 1", "'-1:3'"]), ("0:3", ["count from 1"])],
)
def test_bad_profile_steps_are_one_line(text, words):
    assert_usage_error(lambda: parse_steps(text), words)


def test_progress_true_draws_a_bar_over_rows(capsys):
    ss.run(ss.Sum(), X, progress=True, **KW)
    err = capsys.readouterr().err
    assert "100/100" in err and "rows/s" in err


def test_the_bar_starts_at_the_resumed_cursor_and_is_closed_at_the_end(tmp_path):
    with progress_module.reporter(True, 64, 100) as report:
        bar = report._bar
        assert (bar.n, bar.total, bar.unit) == (64, 100, "rows")
        report(ss.Progress(1, 2, 96, 100, 0.1))
        assert bar.n == 96
    assert bar.disable  # closed


def test_a_list_of_callbacks_and_the_bar_and_the_bar_closed_on_failure(monkeypatch):
    bars = []

    class Bar(progress_module.ProgressBar):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append(self)

    monkeypatch.setattr(progress_module, "ProgressBar", Bar)
    seen = []
    with pytest.raises(RuntimeError, match="step 3"):
        ss.run(ss.Sum(), X, progress=[True, seen.append, None, stop_at(3)], **KW)
    assert [p.step for p in seen] == [1, 2, 3] and seen[-1].step_seconds > 0 and seen[-1].steps_before == 0
    assert len(bars) == 1 and bars[0]._bar.disable


def test_progress_true_without_tqdm_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    assert_usage_error(lambda: ss.RunOptions(progress=True), ["tqdm", "pip install tqdm"])
    assert_usage_error(lambda: ss.RunOptions.make(progress=[print, True]), ["pip install tqdm"])
    assert ss.RunOptions(progress=False).progress is None
    assert_usage_error(lambda: ss.RunOptions(progress=[print, 3]), ["progress", "int"])


def test_combine_calls_in_order_and_closes_every_part_in_reverse():
    events = []

    class Part:
        def __init__(self, name):
            self.name = name

        def __call__(self, p):
            events.append((self.name, p))

        def close(self):
            events.append((self.name, "closed"))

    class Managed(Part):
        def __enter__(self):
            events.append((self.name, "entered"))
            return self

        def __exit__(self, *exc):
            events.append((self.name, "exited"))

    with pytest.raises(KeyError), combine(Part("a"), None, Managed("b")) as both:
        both(1)
        raise KeyError
    assert events == [("b", "entered"), ("a", 1), ("b", 1), ("b", "exited"), ("a", "closed")]
    events.clear()
    combine(Part("a"), Managed("b")).close()  # closed without a with block: closes, never enters
    assert events == [("b", "closed"), ("a", "closed")]
    assert_usage_error(lambda: combine(Part("a"), 3), ["combine", "int"])


def test_writer_and_window_check_their_arguments(tmp_path):
    (tmp_path / "file").write_text("")
    writer, window = MetricsWriter(tmp_path / "file" / "tb"), ProfileWindow(1, 2, tmp_path / "file")  # built: fine
    assert_usage_error(lambda: combine(writer, window).__enter__(), ["not a writable directory"])
    assert_usage_error(window.__enter__, ["not a writable directory"])
    assert_usage_error(lambda: MetricsWriter(tmp_path, row_bytes=0), ["row_bytes"])
    assert_usage_error(lambda: ProfileWindow(3, 2, tmp_path), ["end before"])
    assert_usage_error(lambda: ProfileWindow(0, 2, tmp_path), ["count from 1"])


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self):
        return True


def test_auto_progress_is_only_on_a_terminal_and_progress_false_is_off(monkeypatch):
    # Issue 43: ss.run showed no progress by default on a long run. "auto" is the default now, on a terminal only.
    assert ss.RunOptions().progress == "auto" and ss.RunOptions(progress=None).progress == "auto"
    assert ss.RunOptions(progress=False).progress is None
    assert ss.RunOptions(progress=[print, "auto"]).progress == (print, "auto")
    assert progress_module.auto_progress(io.StringIO()) is None  # a file, a pipe, pytest's capture: nothing
    assert isinstance(progress_module.auto_progress(Terminal()), progress_module.AutoProgress)
    monkeypatch.setattr(sys, "stderr", Terminal())
    for option, shown in ((None, True), ("auto", True), (False, False), (print, False)):
        with progress_module.reporter(ss.RunOptions(progress=option).progress, 0, 100) as report:
            assert isinstance(report, progress_module.AutoProgress) == shown, option
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with progress_module.reporter(ss.RunOptions().progress, 0, 100) as report:
        assert report is None


def test_auto_progress_waits_a_few_seconds_then_shows_rows_rate_and_time_left():
    lines = Terminal()
    auto = progress_module.AutoProgress(lines)  # no tqdm: a line every 5 s, by the steps' own clock
    for seconds, rows in ((2.0, 100), (2.5, 200), (2.9, 300)):  # the first step (compiling) ends at 2 s
        auto(ss.Progress(rows // 100, 10, rows, 1000, seconds))
    assert lines.getvalue() == ""  # a short run shows nothing
    auto(ss.Progress(4, 10, 400, 1000, 3.5))
    auto(ss.Progress(5, 10, 500, 1000, 8.0))
    auto(ss.Progress(6, 10, 600, 1000, 8.6))
    auto(ss.Progress(10, 10, 1000, 1000, 9.0))  # the last: one more line
    auto.close()
    assert lines.getvalue().splitlines() == [
        "sharded_scan: 400/1,000 rows (40.0%), 200 rows/s, 3 s left",  # 300 rows in 1.5 s after the first step
        "sharded_scan: 600/1,000 rows (60.0%), 76 rows/s, 5 s left",
        "sharded_scan: 1,000/1,000 rows (100.0%), 129 rows/s, 0 s left",
    ]

    bars = []

    class Bar:
        def __init__(self, total, initial, **options):
            self.n, self.total, self.options = initial, total, options
            bars.append(self)

        def update(self, rows):
            self.n += rows

        def close(self):
            self.closed = True

    auto = progress_module.AutoProgress(lines, tqdm=Bar)
    auto(ss.Progress(1, 10, 100, 1000, 2.0))
    assert not bars
    auto(ss.Progress(2, 10, 200, 1000, 3.0))
    auto(ss.Progress(3, 10, 300, 1000, 3.4))
    auto.close()
    assert len(bars) == 1 and bars[0].n == 300 and bars[0].total == 1000 and bars[0].options["file"] is lines
    assert bars[0].closed
