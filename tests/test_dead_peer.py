"""Two launch.main processes as two hosts: a dead or stuck peer ends the other in one line."""

import contextlib
import json
import re
import signal
import threading
import time

import numpy as np

import sharded_scan as ss
from launch.processes import commands, free_port
from sharded_scan import watchdog
from sharded_scan.sources import SyntheticSource
from sharded_scan.watchdog import EXIT_PEER_LOST, EXIT_STALLED, PeerWatch, Watchdog
from tests import cli, forks, jobs

# The module's processes: forks of one process that imported the launcher (tests/forks.py), ~1.1 s of CPU
# less each than a fresh interpreter.
launcher_forks = forks.module_fixture()

ROWS = 38400  # 64 rows per step on 2 devices: 600 steps, a checkpoint every 50 (per_job: at most 12 saves)
# Process 0 logs every step, so a test can wait for the run to reach a row instead of sleeping.
ARGS = ("--config=configs/gram.py:quick", f"--config.data.num_rows={ROWS}", "--config.checkpoint.every_steps=50",
        "--config.checkpoint.per_job=12", "--config.log_every_seconds=0")
HEARTBEAT_S = 5


@contextlib.contextmanager
def two_processes(tmp_path, workdir, *extra, logs="log", args=ARGS, hold=None):
    """Both processes of the job (one CPU device each), killed on exit whatever happens; ``hold``: the file
    process 1's reader waits for (``tests.jobs.HOLD``)."""
    cmds = commands([*args, f"--workdir={workdir}", *extra], 2, 1, free_port())
    envs = [None, hold and dict(cli.env(), **{jobs.HOLD: str(hold)})]
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(cli.started(cmd, tmp_path / f"{logs}{i}", envs[i])) for i, cmd in enumerate(cmds)]


def wait_for_row(log_path, proc, past):
    """Waits until process 0's log (``log_path``) shows a step that ended past row ``past``; fails
    when ``proc`` ends first or after ``cli.TIMEOUT`` s (a bound for a hung test, not a timing)."""
    deadline = time.monotonic() + cli.TIMEOUT
    while True:
        rows = [int(r) for r in re.findall(r"\] step \d+/\d+  rows (\d+)/", log_path.read_text())]
        if rows and rows[-1] > past:
            return rows[-1]
        assert proc.poll() is None, f"the run ended (status {proc.returncode}) before row {past}"
        assert time.monotonic() < deadline, f"no step past row {past} after {cli.TIMEOUT} s"
        time.sleep(0.05)


def one_line(log_path, words):
    out = log_path.read_text()
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in out, out[-3000:]
    for word in words:
        assert word in errors[0], errors[0]
    return errors[0]


# The killed peer's job: 100 steps of 64 rows, saves at steps 40 and 80; process 1's reader stops past row 4,000
# (step 63) until a file that never comes, so the kill lands after the first save and before the second on a
# machine of any speed, without 500 steps of margin to pay for.
KILLED_ROWS, SAVE_STEPS = 6400, 40
HELD = ("--config=configs/gram.py:quick", "--config.data.kind=python",
        "--config.data.factory=tests.jobs:held_synthetic_source",
        f"--config.data.factory_kwargs.num_rows={KILLED_ROWS}", "--config.data.factory_kwargs.features=64",
        "--config.data.factory_kwargs.hold_after=4000",
        f"--config.checkpoint.every_steps={SAVE_STEPS}", "--config.log_every_seconds=0",
        f"--heartbeat_timeout={HEARTBEAT_S}")


def test_a_killed_peer_stops_the_other_in_one_line_and_a_rerun_resumes(tmp_path):
    workdir = tmp_path / "w"
    with two_processes(tmp_path, workdir, args=HELD, hold=tmp_path / "never") as (survivor, victim):
        saved = max(cli.wait_for_checkpoint(workdir, survivor))
        assert saved == SAVE_STEPS * 64
        # Past the save: the survivor steps again (a peer that dies during a save's barrier is JAX's heartbeat
        # abort, WORKSPACE.md, "When a job hangs"), and cannot pass the victim's held reader.
        wait_for_row(tmp_path / "log0", survivor, saved)
        victim.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        survivor.wait(timeout=cli.TIMEOUT)
        took = time.monotonic() - killed
    assert survivor.returncode == EXIT_PEER_LOST, (tmp_path / "log0").read_text()[-3000:]
    print(f"survivor exited {took:.2f} s after its peer was killed")
    one_line(tmp_path / "log0", ["process 0 of 2", "lost a peer", "rerun the same command"])
    # The same command on both processes (the reader no longer held) resumes from the last checkpoint and finishes.
    with two_processes(tmp_path, workdir, args=HELD, logs="rerun") as procs:
        # meanwhile, the uninterrupted result here: the same rows, mesh and steps
        want = ss.run(ss.Gram(), SyntheticSource(KILLED_ROWS, 64), mesh="data:2", microbatch=16, steps_per_call=2)
        assert [p.wait(timeout=cli.TIMEOUT) for p in procs] == [0, 0]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["resumed_from_cursor"] == saved and summary["rows_this_run"] == KILLED_ROWS - saved
    np.testing.assert_array_equal(cli.result(workdir)["result"], want)  # every row once


def test_sigterm_to_one_process_saves_on_both_at_the_same_row(tmp_path):
    workdir = tmp_path / "w"
    with two_processes(tmp_path, workdir, "--config.checkpoint.every_steps=100000") as procs:
        # Step 2 ends on process 0 only after both agreed on step 1: process 1 is in the loop, catching SIGTERM.
        wait_for_row(tmp_path / "log0", procs[0], 64)
        procs[1].send_signal(signal.SIGTERM)  # one process only, as a preemption of one host
        assert [p.wait(timeout=cli.TIMEOUT) for p in procs] == [0, 0]
    rows = []
    for i in range(2):
        found = re.findall(r"preempted: saved a checkpoint at row (\d+)", (tmp_path / f"log{i}").read_text())
        assert found, (tmp_path / f"log{i}").read_text()[-3000:]
        rows.append(int(found[-1]))
    assert rows[0] == rows[1] and cli.checkpoints(workdir) == [rows[0]]


def test_a_stuck_peer_is_caught_by_the_step_watchdog(tmp_path):
    workdir = tmp_path / "w"
    timeout = 4
    # A heartbeat of 30 s: peers are watched for 10 s of silence (a third), well past the watchdog's 4-5 s;
    # the healthy coordinator's farewell then waits out those 10 s (it waited 20 s at 60).
    with two_processes(tmp_path, workdir, "--heartbeat_timeout=30", f"--step_timeout={timeout}") as (healthy, stuck):
        cli.wait_for_checkpoint(workdir, healthy)
        stuck.send_signal(signal.SIGSTOP)  # alive, holds its connections, never steps again
        stopped = time.monotonic()
        healthy.wait(timeout=cli.TIMEOUT)
        took = time.monotonic() - stopped
        stuck.send_signal(signal.SIGCONT)
    assert healthy.returncode == EXIT_STALLED, (tmp_path / "log0").read_text()[-3000:]
    print(f"watchdog ended the healthy process {took:.2f} s after its peer stopped")
    one_line(tmp_path / "log0", ["process 0 of 2", "no step finished", f"step_timeout {timeout} s", "stuck",
                                 "rerun the same command"])
    assert cli.checkpoints(workdir)  # the last complete checkpoint is there to resume from


def test_a_peer_stopped_past_the_heartbeat_is_our_line_not_jax_abort(tmp_path):
    workdir = tmp_path / "w"
    # JAX's heartbeat used to end the survivor with a fatal C++ log, a stack and SIGABRT (status 134).
    with two_processes(tmp_path, workdir, "--heartbeat_timeout=6", "--step_timeout=600") as (survivor, stopped):
        cli.wait_for_checkpoint(workdir, survivor)
        stopped.send_signal(signal.SIGSTOP)  # alive, holds its connections, sends no heartbeat
        survivor.wait(timeout=cli.TIMEOUT)
        stopped.send_signal(signal.SIGCONT)
    log = (tmp_path / "log0").read_text()
    assert survivor.returncode == EXIT_PEER_LOST, log[-3000:]
    one_line(tmp_path / "log0", ["process 0 of 2 lost a peer: process 1 gave no sign of life", "heartbeat",
                                 "rerun the same command"])
    assert "Terminating process" not in log and "Check failure" not in log


class Store:
    """The coordination service's key-value store, in memory (``fail``: the coordinator does not answer)."""

    def __init__(self, fail=False):
        self.values, self.fail = {}, fail

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.fail:
            raise RuntimeError("DEADLINE_EXCEEDED")
        self.values[key] = value

    def key_value_dir_get(self, prefix):
        if self.fail:
            raise RuntimeError("DEADLINE_EXCEEDED")
        return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


def watch_until_lost(store, process, processes):
    lost, fired = [], threading.Event()
    peers = PeerWatch(store, process, processes, heartbeat=0.3, on_lost=lambda m: (lost.append(m), fired.set()))
    peers.start()
    try:
        assert fired.wait(cli.TIMEOUT)
    finally:
        peers.stop()
    return lost


def test_peer_watch_names_the_silent_peer_and_not_one_that_ended():
    store = Store()
    store.key_value_set(f"{PeerWatch.PREFIX}/done/2", "1")  # process 2 ended on purpose; process 1 never pulses
    lost = watch_until_lost(store, 0, 3)
    assert len(lost) == 1 and lost[0].startswith("process 0 of 3 lost a peer: process 1 gave no sign of life"), lost
    assert json.loads(store.values[f"{PeerWatch.PREFIX}/done/0"]) == [0, ""]  # stopping says so to the peers
    assert f"{PeerWatch.PREFIX}/alive/0" in store.values  # it pulsed meanwhile


def test_peer_watch_ends_with_the_line_of_a_peer_that_ended_with_an_error():
    store = Store()
    store.key_value_set(f"{PeerWatch.PREFIX}/done/1", json.dumps([2, "bad flag; fix it."]))  # PeerWatch.farewell
    lost = watch_until_lost(store, 0, 2)
    assert lost == ["process 0 of 2 lost a peer: process 1 ended (status 2): bad flag; fix it."], lost


def test_peer_watch_names_a_coordinator_that_does_not_answer():
    lost = watch_until_lost(Store(fail=True), 1, 2)
    assert lost[0].startswith("process 1 of 2 lost a peer: the coordinator (process 0) has not answered"), lost


class Clock:
    """A monotonic clock that the test moves; it counts the watchdog thread's looks at it."""

    def __init__(self):
        self.now, self.looks, self._changed = 0.0, 0, threading.Condition()

    def monotonic(self) -> float:
        with self._changed:
            if threading.current_thread().name == "sharded_scan-watchdog":
                self.looks += 1
                self._changed.notify_all()
            return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def wait_for_a_look(self) -> None:
        """Returns once the watchdog has looked at the time again (a check of the beats)."""
        with self._changed:
            seen = self.looks
            assert self._changed.wait_for(lambda: self.looks > seen, timeout=cli.TIMEOUT)


def test_watchdog_fires_only_when_beats_stop(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(watchdog, "time", clock)  # the watchdog's time only; it still polls in real time
    fired, stalled = [], threading.Event()
    with Watchdog(0.4, on_stall=lambda message: (fired.append(message), stalled.set())) as dog:
        for _ in range(8):  # 0.8 s of steady beats, each checked by the watchdog: no stall
            clock.advance(0.1)
            dog.beat("after row 7")
            clock.wait_for_a_look()
        assert not fired
        clock.advance(1.5)
        assert stalled.wait(cli.TIMEOUT)
    assert len(fired) == 1 and "no step finished" in fired[0] and "after row 7" in fired[0], fired


def test_run_with_a_step_timeout_gives_the_same_result():
    x = np.arange(60, dtype=np.float32).reshape(20, 3)
    watched = ss.run(ss.Gram(), x, microbatch=2, step_timeout=60)
    np.testing.assert_array_equal(watched, ss.run(ss.Gram(), x, microbatch=2))
