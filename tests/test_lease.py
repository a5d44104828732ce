"""One job per directory: a second job is refused in one line before it touches anything;
a dead holder's lease is free again; --force_unlock takes it anyway."""

import json
import os
import signal
import socket
import time

import numpy as np

import sharded_scan as ss
from configs import gram
from sharded_scan.lease import LEASE_FILE, Lease
from tests import cli
from tests.helpers import assert_usage_error, launcher_error_line

X = np.random.default_rng(0).normal(size=(300, 4)).astype(np.float32)
KW = {"mesh": "data:2", "microbatch": 8, "steps_per_call": 2}


def test_a_held_directory_is_refused_in_one_line_then_forced(tmp_path):
    directory = tmp_path / "ck"
    holder = Lease(str(directory), "another job's digest")
    holder.acquire()
    try:
        words = ["is in use by pid", str(os.getpid()), socket.gethostname(), "(another job)", "force_unlock=True"]
        assert_usage_error(lambda: ss.run(ss.Sum(), X, checkpoint=str(directory), **KW), words)
        assert os.listdir(directory) == [LEASE_FILE]  # nothing else touched
        forced = ss.CheckpointOptions(str(directory), force_unlock=True)
        got = ss.run(ss.Sum(), X, checkpoint=forced, **KW)
        np.testing.assert_allclose(got.sum, X.sum(0), rtol=1e-5)
    finally:
        holder.release()
    assert LEASE_FILE not in os.listdir(directory)  # the forced holder removed its own file


def test_a_killed_holders_lock_file_is_stale(tmp_path):
    directory = tmp_path / "ck"
    directory.mkdir()
    dead = {"host": socket.gethostname(), "pid": 2**22 + 7, "pid_start": "1", "since": "yesterday",
            "heartbeat": 0.0, "job": "x"}
    (directory / LEASE_FILE).write_text(json.dumps(dead))  # no process holds its lock
    got, report = ss.run_with_report(ss.Sum(), X, checkpoint=str(directory), **KW)
    assert report.checkpoints_written == 1 and int(got.count) == len(X)
    assert LEASE_FILE not in os.listdir(directory)


def test_a_second_cli_job_on_a_running_workdir_gets_one_line(tmp_path, capsys):
    """The concurrent-second-job fault: the same command twice on one workdir (the second, the same config,
    through the launcher's end of a run in this process: exits and cli_wording around run_job)."""
    args = ("--config=configs/gram.py:quick", "--config.data.num_rows=8000000", "--config.checkpoint.every_steps=50",
            "--config.log_every_seconds=0", f"--workdir={tmp_path}")
    config = gram.get_config("quick")
    config.data.num_rows, config.checkpoint.every_steps, config.log_every_seconds = 8000000, 50, 0.0
    log = tmp_path.parent / f"{tmp_path.name}.log"
    with cli.started(cli.main_cmd(*args), log) as first:
        deadline = time.monotonic() + 60
        while not (tmp_path / LEASE_FILE).exists():  # the first job holds the workdir
            assert first.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.05)
        line = launcher_error_line(capsys, config, tmp_path)
        for word in ("is in use by pid", str(first.pid), "(same job)", "wait for it or pass --force_unlock"):
            assert word in line, line
        assert first.poll() is None  # the first job runs on, untouched
        while "step " not in log.read_text():  # its steps have begun (a Ctrl-C while compiling saves nothing: 130)
            assert first.poll() is None and time.monotonic() < deadline + 60, log.read_text()[-2000:]
            time.sleep(0.05)
        first.send_signal(signal.SIGINT)  # Ctrl-C: it saves and stops like on SIGTERM
        assert first.wait(timeout=60) == 0
    assert "interrupted (SIGINT): saved a checkpoint at row" in log.read_text()
    assert not (tmp_path / LEASE_FILE).exists()  # released by the job that held it
