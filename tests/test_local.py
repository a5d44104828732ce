"""launch.local: 2 processes x 2 devices equal 1 x 4; a dying process stops the job."""

import os
import signal

import numpy as np

import sharded_scan as ss
from configs import moments
from launch.data import make_source
from launch.processes import commands, free_port, resume_hint
from tests import cli, forks

# launch.local: forks of one process that imported what it imports (tests/forks.py), ~1.1 s of CPU less each; the
# processes it starts are fresh interpreters, as users get them.
launcher_forks = forks.module_fixture()


def children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_two_processes_of_two_devices_equal_one_of_four(tmp_path):
    # No checkpoints: what is compared is the result (saves and resumes of several processes: test_dead_peer,
    # test_compact_checkpoint, test_multihost); each process imports no orbax and saves nothing.
    args = ("--config=configs/moments.py:quick", "--config.logical_shards=4", "--config.data.num_rows=3001",
            "--config.checkpoint.enabled=false")
    proc = cli.run(cli.local_cmd(2, 2, *args, f"--workdir={tmp_path}"))
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "[0] " in proc.stdout and "[1] " in proc.stdout
    config = moments.get_config("quick")
    config.data.num_rows = 3001
    want = ss.run(ss.Moments(), make_source(config.data), mesh="data:4", logical_shards=4,
                  microbatch=config.microbatch, steps_per_call=config.steps_per_call)
    got = cli.result(tmp_path)
    for field in want._fields:  # fixed logical shards: bitwise on any process/device split
        np.testing.assert_array_equal(got[field], getattr(want, field), err_msg=field)


def test_one_process_dying_stops_the_others_and_fails(tmp_path):
    args = ("--config=configs/gram.py:quick", "--config.data.num_rows=2000000", "--config.checkpoint.per_job=100000",
            f"--workdir={tmp_path}")
    with cli.started(cli.local_cmd(2, 1, *args), tmp_path / "log") as proc:
        cli.wait_for_checkpoint(tmp_path, proc, at_least=1)
        workers = children(proc.pid)
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGKILL)
        assert proc.wait(timeout=60) == 128 + signal.SIGKILL
        for pid in workers:  # launch.local waited for (reaped) both
            assert not os.path.exists(f"/proc/{pid}")
    assert "stopping the others" in (tmp_path / "log").read_text()


def test_the_resume_hint_promises_a_resume_only_when_a_checkpoint_exists(tmp_path):
    args = ["--config=configs/gram.py:quick", f"--workdir={tmp_path}"]
    assert "no checkpoint was written yet" in resume_hint(args)
    (tmp_path / "checkpoints" / "4096").mkdir(parents=True)  # a save that never completed
    assert "no checkpoint was written yet" in resume_hint(args)
    (tmp_path / "checkpoints" / "2048").mkdir()
    (tmp_path / "checkpoints" / "2048" / "commit_success.txt").write_text("")
    assert resume_hint(args) == "rerun the same command to resume from the checkpoint at row 2048"


def test_commands_and_port():
    port = free_port()
    cmds = commands(["--workdir=w"], 3, 2, port)
    assert len(cmds) == 3
    assert all(f"--coordinator_address=127.0.0.1:{port}" in c and "--jax_num_cpu_devices=2" in c for c in cmds)
    assert [c for c in cmds[2] if c.startswith("--process_id")] == ["--process_id=2"]
