"""Prefetch: results unchanged, lookahead bounded, reader errors surface, the thread always ends."""

import _thread
import signal
import sys
import threading
import time

import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan.layout import make_layout
from sharded_scan.mesh import make_mesh
from sharded_scan.prefetch import ReadError, device_batches
from sharded_scan.sources import ArraySource, NpySource
from tests.helpers import f64, rel_err

READER = "sharded_scan-reader"


def rows(n, d=4):
    return np.random.default_rng(0).normal(size=(n, d)).astype(np.float32)


def readers():
    return [t for t in threading.enumerate() if t.name == READER]


class Spy(ArraySource):
    """Records reads; optionally fails at a row, or blocks until released."""

    def __init__(self, x, fail_at=None, block_at=None):
        super().__init__(x)
        self.reads, self.fail_at, self.block_at = [], fail_at, block_at
        self.blocked, self.release = threading.Event(), threading.Event()

    def read(self, start, stop):
        self.reads.append(start)
        if self.fail_at is not None and start >= self.fail_at:
            raise OSError(f"disk gone at row {start}")
        if self.block_at is not None and start >= self.block_at:
            self.blocked.set()
            self.release.wait(30)
        return super().read(start, stop)


def stack(thread):
    """The names of the functions ``thread`` is in, innermost first."""
    frame, names = sys._current_frames().get(thread.ident), []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return names


def wait_until(condition, timeout=60):
    """Polls ``condition`` until it holds; fails after ``timeout`` s (a bound for a hung test, not a timing)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{condition.__name__} still false after {timeout} s"
        time.sleep(0.01)


def reader_waits_for_room():
    """Whether the reader thread waits inside ``Queue.put`` for a full queue to make room."""
    return any(stack(t)[:4] == ["wait", "put", "put", "reader"] for t in readers())


def batches(src, prefetch, mb=4):
    mesh = make_mesh("data:2")
    return device_batches(src, make_layout(src.num_rows, mesh, mb, 1), mesh, 0, prefetch)


@pytest.mark.parametrize("prefetch", [0, 1, 2, 5])
def test_prefetch_does_not_change_the_result(prefetch):
    x = rows(203)
    got = ss.run(ss.Gram(), Spy(x), mesh="data:8", microbatch=4, steps_per_call=2, prefetch=prefetch)
    assert rel_err(got, f64(x).T @ f64(x)) < 1e-5
    assert not readers()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_each_step_is_one_read_and_only_the_last_asks_for_padding(prefetch, tmp_path):
    x = rows(203)  # 25 steps of 8 rows, then 3
    np.save(tmp_path / "x.npy", x)
    calls = []

    class Logged(NpySource):
        def read(self, start, stop, pad_to=None):
            calls.append((start, stop, pad_to))
            return super().read(start, stop, pad_to)

    got = [np.asarray(item.batch) for item in batches(Logged(tmp_path / "x.npy"), prefetch)]
    assert calls == [(c, c + 8, None) for c in range(0, 200, 8)] + [(200, 203, 8)]
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate([x, np.zeros((5, 4), np.float32)]))
    assert not readers()


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_host_never_reads_more_than_prefetch_ahead(prefetch):
    src = Spy(rows(400))  # 50 steps of 8 rows
    it = batches(src, prefetch)
    first = next(it)
    assert first.cursor == 0 and first.num_valid == 8
    bound = 1 if prefetch == 0 else prefetch + 2  # queued + one being placed + the one handed out
    if prefetch:  # once it has read that many, the reader waits for room in a full queue: no read can follow
        wait_until(lambda: len(src.reads) >= bound and reader_waits_for_room())
    assert len(src.reads) == bound
    it.close()
    assert not readers()


def test_reader_error_surfaces_with_its_cause():
    src = Spy(rows(80), fail_at=40)
    got = []
    with pytest.raises(ReadError, match=r"rows \[40, 48\) from Spy failed: OSError: disk gone") as info:
        for item in batches(src, 2):
            got.append(item.cursor)
    assert isinstance(info.value.__cause__, OSError)
    assert got == [0, 8, 16, 24, 32]  # every step before the failure arrived, in order
    assert not readers()


def test_reader_error_surfaces_from_run():
    with pytest.raises(ReadError) as info:
        ss.run(ss.Sum(), Spy(rows(80), fail_at=16), mesh="data:2", microbatch=4, steps_per_call=1)
    assert isinstance(info.value.__cause__, OSError)
    assert not readers()


def test_reader_usage_error_is_raised_as_is():
    class Bad(ArraySource):
        def read(self, start, stop):
            raise ss.UsageError("row 3 is corrupt; fix the file.")

    with pytest.raises(ss.UsageError, match="corrupt"):
        list(batches(Bad(rows(40)), 2))
    assert not readers()


def test_closing_early_stops_the_reader():
    src = Spy(rows(4000))
    it = batches(src, 2)
    next(it)
    it.close()
    assert not readers()
    assert len(src.reads) <= 4


def test_error_in_the_consumer_stops_the_reader():
    def boom(progress):
        raise RuntimeError("consumer failed")

    with pytest.raises(RuntimeError, match="consumer failed"):
        ss.run(ss.Sum(), Spy(rows(400)), mesh="data:2", microbatch=4, steps_per_call=1, progress=boom)
    assert not readers()


def test_ctrl_c_while_the_reader_is_blocked_stops_promptly():
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:  # interrupt_main would do nothing
        pytest.skip("SIGINT is ignored here (pytest started in the background by a non-interactive shell)")
    src = Spy(rows(400), block_at=16)
    it = batches(src, 2)
    next(it)
    next(it)

    main = threading.main_thread()

    def waiting_in_the_generator():
        return "device_batches" in stack(main)

    def joining_the_stuck_reader():
        names = stack(main)
        return any(a == "join" and b == "device_batches" for a, b in zip(names, names[1:], strict=False))

    def interrupt():
        try:
            assert src.blocked.wait(60)
            wait_until(waiting_in_the_generator)
            _thread.interrupt_main()
            wait_until(joining_the_stuck_reader)  # the interrupt arrived while the read was stuck
        finally:  # the stuck read returns, so the join completes (or, failed above, the loop ends: no hang)
            src.release.set()

    threading.Thread(target=interrupt, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in it:  # waits on the empty queue: the read of row 16 is stuck
                pass
    finally:
        src.release.set()
    assert not readers()
