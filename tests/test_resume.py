"""Kill, preempt and resume through the CLI: exactly-once, bitwise, on other device counts."""

import concurrent.futures
import shutil
import signal

import numpy as np
import pytest

import sharded_scan as ss
from configs import histogram, moments
from launch.data import make_combiner, make_source, run_options
from sharded_scan.workdir import named_arrays
from tests import cli, jobs
from tests.jobs import iterator_source

# ~150 steps of 512 rows on 4 devices, a checkpoint every 10 steps.
ARGS = (
    "--config=configs/histogram.py:quick", "--config.data.num_rows=80000", "--config.microbatch=64",
    "--config.checkpoint.every_steps=10", "--config.checkpoint.keep=3",
)


def whole_run(config, source=None) -> dict[str, np.ndarray]:
    """The job of ``config`` run whole by the library in this process, on 4 devices as the CLI's, without
    a launcher process (~1.8 s of imports, and its saves); its arrays as ``result.npz`` holds them."""
    source = source or make_source(config.data)
    return named_arrays(ss.run(make_combiner(config.combiner, config.data), source, run_options(config), mesh="data:4"))


def uninterrupted_run() -> dict[str, np.ndarray]:
    """ARGS' job, whole (histogram counts are integers, the same on any split)."""
    config = histogram.get_config("quick")
    config.data.num_rows, config.microbatch = 80000, 64
    return whole_run(config)


@pytest.fixture(scope="module")
def uninterrupted():
    """The uninterrupted run's result, computed while the tests start theirs: call it to wait."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the run ends before the module does
        run = pool.submit(uninterrupted_run)
        yield run.result


def test_sigkill_mid_stream_then_rerun_is_bitwise_and_elastic(tmp_path, uninterrupted):
    killed = tmp_path / "killed"
    with cli.started(cli.main_cmd(*ARGS, f"--workdir={killed}"), tmp_path / "log") as proc:
        found = cli.wait_for_checkpoint(killed, proc, at_least=2)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert found[-1] < 80000
    elastic = tmp_path / "elastic"
    shutil.copytree(killed, elastic)
    # The rerun, and the same checkpoint resumed on 3 devices (4 partials folded, laid out over 3).
    again, other = cli.run_all([cli.main_cmd(*ARGS, f"--workdir={killed}"),
                                cli.main_cmd(*ARGS, f"--workdir={elastic}", devices=3)])
    assert again.returncode == 0, again.stderr
    cli.assert_same(cli.result(killed), uninterrupted())  # bitwise: every row counted once
    assert other.returncode == 0, other.stderr
    cli.assert_same(cli.result(elastic), uninterrupted())  # histogram counts are integers: exact


def test_sigterm_saves_exits_zero_and_resume_is_bitwise(tmp_path, uninterrupted):
    workdir = tmp_path / "w"
    with cli.started(cli.main_cmd(*ARGS, f"--workdir={workdir}"), tmp_path / "log") as proc:
        cli.wait_for_checkpoint(workdir, proc, at_least=1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    out = (tmp_path / "log").read_text()
    assert "rerun the same command to resume" in out, out
    assert not (workdir / "result.npz").exists()
    again = cli.run(cli.main_cmd(*ARGS, f"--workdir={workdir}"))
    assert again.returncode == 0, again.stderr
    cli.assert_same(cli.result(workdir), uninterrupted())


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
