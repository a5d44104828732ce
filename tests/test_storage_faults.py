"""Storage faults end in one line and lose nothing: a full disk or a file system turned
read-only at a save, a failed save's leftovers, the result's write, a finished job read back
from a read-only workdir. Small tmpfs mounts stand in for the disks (mounting needs root)."""

import contextlib
import errno
import os
import re
import subprocess
import time

import numpy as np
import pytest

import sharded_scan as ss
from configs import gram
from launch.main import run_job
from sharded_scan import fs
from sharded_scan.errors import StorageError
from sharded_scan.workdir import write_outputs
from tests import cli

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")

# Gram of 128 columns on 8 shards with Kahan terms: 1 MiB of partials, about 660 KiB a
# checkpoint on disk (compressed); 128 rows a step. 1700 KiB hold two of them, not three.
X = np.random.default_rng(7).normal(size=(4000, 128)).astype(np.float32)
KW = {"mesh": "data:8", "microbatch": 8, "steps_per_call": 2}


@contextlib.contextmanager
def tmpfs(path, size):
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def remount(path, options):
    """Remounts ``path``; a save in flight keeps files open for writing (EBUSY for ro): retry."""
    deadline = time.monotonic() + 20
    while subprocess.run(["mount", "-o", f"remount,{options}", str(path)], capture_output=True).returncode:
        assert time.monotonic() < deadline, f"cannot remount {path} {options}"
        time.sleep(0.02)


def steps_on_disk(directory):
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


@pytest.fixture(scope="module")
def want():
    return ss.run(ss.Gram(), X, **KW)


def test_disk_full_at_a_save_is_one_line_and_the_rerun_resumes_bitwise(tmp_path, want):
    with tmpfs(tmp_path / "disk", "1700k") as disk:
        options = ss.CheckpointOptions(str(disk / "ck"), every_steps=2, keep=2)
        with pytest.raises(StorageError) as err:
            ss.run(ss.Gram(), X, checkpoint=options, **KW)
        message, saved = str(err.value), steps_on_disk(disk / "ck")
        assert err.value.errno == errno.ENOSPC and "\n" not in message
        for words in ("could not save the checkpoint at row", "no space left on device (", "MiB needed)",
                      f"the previous checkpoint at row {saved[-1]} is intact", "free space and rerun the same command"):
            assert words in message, message
        remount(disk, "size=16m")
        got, report = ss.run_with_report(ss.Gram(), X, checkpoint=options, **KW)
        assert report.resumed_from_cursor == saved[-1]
        np.testing.assert_array_equal(got, want)


def roomy(path):
    """``statvfs`` of ``path`` with a terabyte free: the check before a save passes, orbax meets the full disk."""
    real = os.statvfs(path)
    return os.statvfs_result((*real[:4], (1 << 40) // real.f_frsize, *real[5:]))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # tensorstore, after the failure
def test_a_save_failing_in_flight_leaves_only_a_temporary_directory_cleaned_at_the_next_start(tmp_path, want):
    with tmpfs(tmp_path / "disk", "1700k") as disk:
        options = ss.CheckpointOptions(str(disk / "ck"), every_steps=2, keep=2)
        with fs.replaced(statvfs=roomy), pytest.raises(StorageError) as err:
            ss.run(ss.Gram(), X, checkpoint=options, **KW)
        assert err.value.errno == errno.ENOSPC and "is intact" in str(err.value)
        assert any(".orbax-checkpoint-tmp" in n for n in os.listdir(disk / "ck"))
        saved = steps_on_disk(disk / "ck")
        remount(disk, "size=16m")
        got, report = ss.run_with_report(ss.Gram(), X, checkpoint=options, **KW)
        assert report.resumed_from_cursor == saved[-1]
        np.testing.assert_array_equal(got, want)
        assert not any("tmp" in n for n in os.listdir(disk / "ck"))
        assert len(steps_on_disk(disk / "ck")) <= options.keep


def test_a_file_system_turned_read_only_mid_run_is_one_line(tmp_path, want):
    with tmpfs(tmp_path / "disk", "16m") as disk:
        options = ss.CheckpointOptions(str(disk / "ck"), every_steps=2, keep=2)

        def turn_read_only(p):
            if p.step == 5:
                remount(disk, "ro")

        with pytest.raises(StorageError) as err:
            ss.run(ss.Gram(), X, checkpoint=options, progress=turn_read_only, **KW)
        assert err.value.errno == errno.EROFS
        saved = steps_on_disk(disk / "ck")  # the save in flight at the remount may be the one that failed
        failed = int(re.search(r"at row (\d+) in", str(err.value)).group(1))
        assert saved and failed > saved[-1]
        for words in ("read-only file system", f"the previous checkpoint at row {saved[-1]} is intact",
                      "remount it read-write and rerun the same command"):
            assert words in str(err.value), str(err.value)
        remount(disk, "rw")
        got, report = ss.run_with_report(ss.Gram(), X, checkpoint=options, **KW)
        assert report.resumed_from_cursor == saved[-1]
        np.testing.assert_array_equal(got, want)


def test_a_result_the_disk_cannot_hold_is_one_line_and_leaves_no_temporary_file(tmp_path):
    with tmpfs(tmp_path / "disk", "1m") as disk:
        with pytest.raises(StorageError) as err:
            write_outputs(str(disk), {"G": np.zeros((1024, 512))}, {"rows": 1}, "the final checkpoint is intact")
        assert err.value.errno == errno.ENOSPC
        assert "could not write" in str(err.value) and "result.npz" in str(err.value)
        assert os.listdir(disk) == []


def test_cli_disk_full_exits_5_in_one_line_and_a_finished_job_reads_back_from_a_read_only_workdir(tmp_path):
    args = ("--config=configs/gram.py:quick", "--config.data.num_rows=6000", "--config.data.features=200",
            "--config.checkpoint.every_steps=8")
    with tmpfs(tmp_path / "disk", "1500k") as disk:
        full = cli.run(cli.main_cmd(*args, f"--workdir={disk / 'w'}"))
        out = full.stdout + full.stderr
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert full.returncode == 5 and len(errors) == 1 and "Traceback" not in out, out[-3000:]
        assert "no space left on device" in errors[0] and "rerun the same command" in errors[0]
        remount(disk, "size=16m")
        config = gram.get_config("quick")  # the same job, run to its end in this process
        config.data.num_rows, config.data.features, config.checkpoint.every_steps = 6000, 200, 8
        want, record = run_job(config, str(disk / "w"))
        assert record["resumed_from_cursor"] is not None
        remount(disk, "ro")
        got, again = run_job(config, str(disk / "w"))  # reads only: "already done"
        assert again.get("already_done") and again["job"] == record["job"]
        np.testing.assert_array_equal(got["result"], want)
