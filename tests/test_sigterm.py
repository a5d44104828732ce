"""SIGTERM outside a run's steps (start-up, the final merge, a second one after the save) ends in one line.

Each moment is reached deterministically: the job sends SIGTERM to itself from a hook that runs
there (a source's stamps while the job is built, a progress callback at a step, a progress
context's exit after the save, a combiner's finalize).
"""

import os
import signal
import subprocess
import sys

import numpy as np

from tests import cli, forks, multiprocess

# The module's processes: forks of one process that imported the launcher (tests/forks.py), ~1.1 s of CPU
# less each than a fresh interpreter.
launcher_forks = forks.module_fixture()

ROWS = 4000


def sigterm_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def scenario(moment: str, workdir: str) -> None:
    """The job of one test, run as the CLI runs it (``stop_on_sigterm``, ``exits``), signalled at ``moment``."""
    import jax

    jax.config.update("jax_num_cpu_devices", 2)
    import sharded_scan as ss
    from sharded_scan import distributed
    from sharded_scan.sources import ArraySource
    from sharded_scan.workdir import exits

    class SignalledWhileBuilt(ArraySource):
        def stamps(self):
            sigterm_self()  # while the job is built: before the first step
            return super().stamps()

    class SignalledInFinalize(ss.Sum):
        def finalize(self, acc):
            sigterm_self()  # after the last step and the final save
            return super().finalize(acc)

    class SecondSignalAfterTheSave:
        def __call__(self, progress):
            if progress.step == 2:
                sigterm_self()  # the first: the watch saves after this step and stops

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            sigterm_self()  # the second, after the save, while the stop unwinds

    x = np.arange(ROWS * 3, dtype=np.float32).reshape(ROWS, 3)
    data = SignalledWhileBuilt(x) if moment == "start" else x
    combiner = SignalledInFinalize() if moment == "merge" else ss.Sum()
    progress = {"second": SecondSignalAfterTheSave(), "off": lambda p: p.step == 2 and sigterm_self()}.get(moment)
    distributed.stop_on_sigterm()
    with exits():
        ss.run_in_workdir(combiner, data, workdir, microbatch=16, steps_per_call=2, progress=progress,
                          checkpoint=None if moment == "off" else ss.CheckpointOptions())
    print("finished")


def run_scenario(moment: str, workdir) -> subprocess.CompletedProcess:
    code = f"from tests.test_sigterm import scenario; scenario({moment!r}, {str(workdir)!r})"
    return cli.run([sys.executable, "-c", code])


def test_sigterm_while_starting_says_nothing_was_computed(tmp_path):
    end = run_scenario("start", tmp_path / "w")
    assert end.returncode == 0, end.stdout + end.stderr
    assert end.stdout.strip().splitlines() == [
        "preempted (SIGTERM) before the first step: nothing was computed yet, so nothing needed saving; rerun the "
        "same command to resume."], end.stdout + end.stderr
    assert "Traceback" not in end.stderr and not (tmp_path / "w" / "checkpoints").exists()


def test_sigterm_during_the_final_merge_finishes_the_job(tmp_path):
    end = run_scenario("merge", tmp_path / "w")
    assert end.returncode == 0, end.stdout + end.stderr
    assert "SIGTERM: already past the last step: the finished job's checkpoint in" in end.stderr, end.stderr
    assert "is saved; merging and writing the result; it goes on." in end.stderr
    assert end.stdout.strip() == "finished" and "Traceback" not in end.stderr
    np.testing.assert_array_equal(cli.result(tmp_path / "w")["sum"],
                                  np.arange(ROWS * 3, dtype=np.float64).reshape(ROWS, 3).sum(0))


def test_a_second_sigterm_after_the_save_changes_nothing(tmp_path):
    end = run_scenario("second", tmp_path / "w")
    assert end.returncode == 0, end.stdout + end.stderr
    lines = end.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("preempted: saved a checkpoint at row "), end.stdout + end.stderr
    assert "SIGTERM: already saving a checkpoint and stopping; it goes on." in end.stderr, end.stderr
    assert "Traceback" not in end.stderr
    row = int(lines[0].split("row ")[1].split()[0])
    assert cli.checkpoints(tmp_path / "w") == [row]  # the save the first SIGTERM asked for, complete


def test_sigterm_without_checkpoints_says_nothing_was_saved(tmp_path):
    end = run_scenario("off", tmp_path / "w")
    assert end.returncode == 143, end.stdout + end.stderr
    errors = [line for line in end.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: terminated (SIGTERM) while folding with checkpoints off: nothing was saved; rerun the "
                      "same command to start again."], end.stderr
    assert "Traceback" not in end.stderr


def deferred_worker(directory: str):
    import jax

    import sharded_scan as ss
    from sharded_scan import distributed

    distributed.stop_on_sigterm()
    if jax.process_index() == 1:
        sigterm_self()  # one process only, before the job starts: deferred to the agreement
    try:
        ss.run(ss.Sum(), np.ones((100, 3), np.float32), mesh="data:-1", checkpoint=directory)
    except distributed.Terminated as e:
        return str(e)
    return None


def test_sigterm_to_one_process_while_starting_stops_every_process_together(tmp_path):
    results = multiprocess.run_processes("tests.test_sigterm:deferred_worker", 2, 1,
                                         kwargs={"directory": str(tmp_path / "ck")}, timeout=90)
    assert results[0] == results[1] and results[0].startswith("preempted (SIGTERM) before the first step"), results
    assert not (tmp_path / "ck").exists()  # stopped before the lease or any save


def test_exit_statuses_of_sigterm():
    from sharded_scan import workdir
    from sharded_scan.distributed import Terminated

    assert workdir.exit_status(Terminated()) == 0
    assert workdir.exit_status(Terminated(saved=False)) == workdir.EXIT_TERMINATED == 143
