"""Kill, preempt and resume through the CLI: exactly-once, bitwise, on other device counts."""

import concurrent.futures
import re
import shutil
import signal
import time

import numpy as np
import pytest

import sharded_scan as ss
from configs import histogram, moments
from launch.data import make_combiner, make_source, run_options
from sharded_scan.workdir import named_arrays
from tests import cli, forks, jobs
from tests.jobs import iterator_source

# The module's processes: forks of one process that imported the launcher (tests/forks.py), ~1.1 s of CPU
# less each than a fresh interpreter.
launcher_forks = forks.module_fixture()

# 40 steps of 512 rows on 4 devices, a checkpoint every 5 steps; where the environment names a hold file, the
# reader stops past row 14,000 (step 28) until that file exists: a run killed mid-stream on a machine of any speed.
ROWS = 20480
ARGS = (
    "--config=configs/histogram.py:quick", "--config.data.kind=python",
    "--config.data.factory=tests.jobs:held_synthetic_source", f"--config.data.factory_kwargs.num_rows={ROWS}",
    "--config.data.factory_kwargs.features=16", "--config.data.factory_kwargs.hold_after=14000",
    "--config.microbatch=64", "--config.checkpoint.every_steps=5", "--config.checkpoint.keep=3",
    "--config.log_every_seconds=0",
)


def whole_run(config, source=None) -> dict[str, np.ndarray]:
    """The job of ``config`` run whole by the library in this process, on 4 devices as the CLI's, without
    a launcher process (~1.8 s of imports, and its saves); its arrays as ``result.npz`` holds them."""
    source = source or make_source(config.data)
    return named_arrays(ss.run(make_combiner(config.combiner, config.data), source, run_options(config), mesh="data:4"))


def uninterrupted_run() -> dict[str, np.ndarray]:
    """ARGS' job, whole: the synthetic kind's rows, which its factory reads (histogram counts are integers, the
    same on any split)."""
    config = histogram.get_config("quick")
    config.data.num_rows, config.microbatch = ROWS, 64
    return whole_run(config)


@pytest.fixture(scope="module")
def uninterrupted():
    """The uninterrupted run's result, computed while the tests start theirs: call it to wait."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the run ends before the module does
        run = pool.submit(uninterrupted_run)
        yield run.result


def held(hold_file) -> dict[str, str]:
    """The launcher's environment with the reader held past row 14,000 until ``hold_file`` exists."""
    return dict(cli.env(), **{jobs.HOLD: str(hold_file)})


def wait_for_a_step(log_path, proc) -> None:
    """Waits until the run logged a finished step (fails when it ends first or after ``cli.TIMEOUT`` s)."""
    deadline = time.monotonic() + cli.TIMEOUT
    while not re.search(r"\] step \d+/\d+  rows ", log_path.read_text()):
        assert proc.poll() is None, f"the run ended (status {proc.returncode}) before a step"
        assert time.monotonic() < deadline, f"no step after {cli.TIMEOUT} s"
        time.sleep(0.05)


def test_sigkill_then_sigterm_mid_stream_then_rerun_is_bitwise_and_elastic(tmp_path, uninterrupted):
    killed, release = tmp_path / "killed", tmp_path / "release"
    with cli.started(cli.main_cmd(*ARGS, f"--workdir={killed}"), tmp_path / "log", held(release)) as proc:
        found = cli.wait_for_checkpoint(killed, proc, at_least=2)
        proc.send_signal(signal.SIGKILL)  # before row 14,000: the reader holds there
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert found[-1] < ROWS
    elastic = tmp_path / "elastic"
    shutil.copytree(killed, elastic)
    # The rerun resumes, steps, and is preempted: SIGTERM saves and exits 0 (the reader let go only after the
    # signal, so the job cannot end before it).
    with cli.started(cli.main_cmd(*ARGS, f"--workdir={killed}"), tmp_path / "log2", held(release)) as proc:
        wait_for_a_step(tmp_path / "log2", proc)
        proc.send_signal(signal.SIGTERM)
        release.touch()
        assert proc.wait(timeout=60) == 0
    out = (tmp_path / "log2").read_text()
    assert "rerun the same command to resume" in out, out
    assert not (killed / "result.npz").exists()
    # The rerun after the SIGTERM, and the killed run's checkpoint resumed on 3 devices (4 partials folded, laid
    # out over 3).
    again, other = cli.run_all([cli.main_cmd(*ARGS, f"--workdir={killed}"),
                                cli.main_cmd(*ARGS, f"--workdir={elastic}", devices=3)])
    assert again.returncode == 0, again.stderr
    assert cli.summary(killed)["resumed_from_cursor"] > found[-1]  # from the SIGTERM's save
    cli.assert_same(cli.result(killed), uninterrupted())  # bitwise: every row counted once
    assert other.returncode == 0, other.stderr
    cli.assert_same(cli.result(elastic), uninterrupted())  # histogram counts are integers: exact


ITERATOR_ARGS = (
    "--config=configs/moments.py:quick", "--config.data.kind=python",
    "--config.data.factory=tests.jobs:held_iterator_source", "--config.microbatch=64",
    "--config.checkpoint.every_steps=5",
)


def test_a_killed_iterator_source_job_resumes_bitwise_from_its_saved_reader_state(tmp_path):
    killed = tmp_path / "killed"
    config = moments.get_config("quick")
    config.microbatch = 64
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the whole job meanwhile: the same rows, not slowed
        whole = pool.submit(whole_run, config, iterator_source(40_000, 4))
        held = dict(cli.env(), **{jobs.HOLD: str(tmp_path / "never")})  # stops reading at 3/4: killed there
        with cli.started(cli.main_cmd(*ITERATOR_ARGS, f"--workdir={killed}"), tmp_path / "log", held) as proc:
            found = cli.wait_for_checkpoint(killed, proc, at_least=2)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        assert found[-1] <= 30_000
        again = cli.run(cli.main_cmd(*ITERATOR_ARGS, f"--workdir={killed}"))
        assert again.returncode == 0, again.stderr
        assert cli.summary(killed)["resumed_from_cursor"] > 0
        cli.assert_same(cli.result(killed), whole.result())
