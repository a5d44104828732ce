"""A job in a workdir, called directly: outputs, "already done" (also read-only), one lease,
and the CLI's exit statuses."""

import json
import os
import socket

import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan import workdir
from sharded_scan.distributed import Preempted
from sharded_scan.identity import job_digest
from sharded_scan.lease import LEASE_FILE, Lease
from sharded_scan.program import build_program
from sharded_scan.sources import as_source
from tests.helpers import assert_usage_error
from tests.test_storage_faults import remount, tmpfs

X = np.random.default_rng(3).normal(size=(500, 5)).astype(np.float32)
KW = {"mesh": "data:4", "microbatch": 8, "steps_per_call": 2}  # 64 rows a step: 8 steps


def gram64():
    x = X.astype(np.float64)
    return x.T @ x


def test_a_job_writes_its_outputs_then_is_already_done(tmp_path):
    result, summary = ss.run_in_workdir(ss.Gram(), X, tmp_path, checkpoint=ss.CheckpointOptions(every_steps=2), **KW)
    np.testing.assert_allclose(result, gram64(), rtol=1e-5, atol=1e-4)
    assert summary["rows"] == len(X) and summary["rows_this_run"] == len(X) and summary["checkpoints_written"] >= 2
    assert json.loads((tmp_path / workdir.SUMMARY).read_text()) == json.loads(json.dumps(summary))
    np.testing.assert_array_equal(workdir.load_result(tmp_path)["result"], result)
    program = build_program(ss.Gram(), as_source(X), ss.RunOptions(**KW))
    assert summary["job"] == job_digest(program.fingerprint)  # the job's name, not the run's
    assert LEASE_FILE not in os.listdir(tmp_path)  # released

    again, done = ss.run_in_workdir(ss.Gram(), X, tmp_path, checkpoint=ss.CheckpointOptions(every_steps=2), **KW)
    assert done["already_done"] and done["job"] == summary["job"] and done["rows_this_run"] == len(X)
    np.testing.assert_array_equal(again["result"], result)
    assert_usage_error(lambda: ss.run_in_workdir(ss.Gram(), X[:400], tmp_path, **KW),  # another job's checkpoints
                       ["belongs to a different job", "data.num_rows is 500 there but 400 here"])
    # the workdir's checkpoints are run's too: the same options, named by their directory there
    options = ss.CheckpointOptions(tmp_path / workdir.CHECKPOINTS, every_steps=2)
    resumed, report = ss.run_with_report(ss.Gram(), X, checkpoint=options, **KW)
    assert report.resumed_from_cursor == len(X) and report.steps == 0
    np.testing.assert_array_equal(resumed, result)
    other, ran = ss.run_in_workdir(ss.Gram(), X[:400], tmp_path, checkpoint=None, **KW)  # run, not read back
    assert "already_done" not in ran and ran["rows"] == 400
    np.testing.assert_allclose(other, X[:400].T.astype(np.float64) @ X[:400], rtol=1e-5, atol=1e-4)


def test_one_lease_on_the_workdir_covers_its_checkpoints(tmp_path):
    seen = []

    def look(p):
        seen.append(((tmp_path / LEASE_FILE).exists(), (tmp_path / workdir.CHECKPOINTS / LEASE_FILE).exists()))

    ss.run_in_workdir(ss.Gram(), X, tmp_path, progress=look, checkpoint=ss.CheckpointOptions(every_steps=1), **KW)
    assert seen and set(seen) == {(True, False)}  # the workdir's lease held; no second one on checkpoints/


def test_a_second_job_on_a_held_workdir_is_one_line_and_exit_2(tmp_path, capsys):
    holder = Lease(str(tmp_path), "another job's digest")
    holder.acquire()
    try:
        with pytest.raises(SystemExit) as end, workdir.exits():
            ss.run_in_workdir(ss.Gram(), X, tmp_path, **KW)
        assert end.value.code == workdir.EXIT_USAGE == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
        for word in ("is in use by pid", str(os.getpid()), socket.gethostname(), "(another job)", "--force_unlock",
                     "force_unlock=True"):
            assert word in err[0], (word, err[0])
        assert os.listdir(tmp_path) == [LEASE_FILE]  # nothing computed or written
        # Issue 45: one way to take a workdir (the checkpoint option's force_unlock is run()'s directories').
        assert_usage_error(lambda: ss.run_in_workdir(ss.Gram(), X, tmp_path, **KW,
                                                     checkpoint=ss.CheckpointOptions(force_unlock=True)),
                           ["run_in_workdir(..., force_unlock=True)", "--force_unlock", "not CheckpointOptions("])
        assert os.listdir(tmp_path) == [LEASE_FILE]
        got, _ = ss.run_in_workdir(ss.Gram(), X, tmp_path, force_unlock=True, checkpoint=None, **KW)
        np.testing.assert_allclose(got, gram64(), rtol=1e-5, atol=1e-4)
    finally:
        holder.release()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_finished_job_reads_back_from_a_read_only_workdir(tmp_path):
    with tmpfs(tmp_path / "disk", "16m") as disk:
        want, summary = ss.run_in_workdir(ss.Gram(), X, disk / "w", **KW)
        remount(disk, "ro")
        got, again = ss.run_in_workdir(ss.Gram(), X, disk / "w", **KW)
        assert again["already_done"] and again["job"] == summary["job"]
        np.testing.assert_array_equal(got["result"], want)
        assert_usage_error(lambda: ss.run_in_workdir(ss.Gram(), X[:400], disk / "w", **KW),  # another job
                           ["not a writable directory", "read-only file system"])


def test_checkpoint_means_the_same_in_run_and_run_in_workdir_and_the_old_forms_are_one_line(tmp_path):
    w = tmp_path / "w"
    for old, new in ((True, "write checkpoint=sharded_scan.CheckpointOptions()"), (False, "write checkpoint=None"),
                     ({"every_steps": 2}, "write checkpoint=sharded_scan.CheckpointOptions(every_steps=2)")):
        assert_usage_error(lambda old=old: ss.run_in_workdir(ss.Gram(), X, w, checkpoint=old),
                           ["checkpoint must be None or sharded_scan.CheckpointOptions", "the same in run and", new])
        assert_usage_error(lambda old=old: ss.run(ss.Gram(), X, checkpoint=old),
                           ["must be None, a directory or sharded_scan.CheckpointOptions", "the same in run"])
    assert_usage_error(lambda: ss.run(ss.Gram(), X, checkpoint={"every_steps": 2}),
                       ["write checkpoint=sharded_scan.CheckpointOptions('DIR', every_steps=2)"])
    assert_usage_error(lambda: ss.run(ss.Gram(), X, checkpoint=ss.CheckpointOptions(every_steps=2)),
                       ["names no directory", "CheckpointOptions('DIR', ...)", "run_in_workdir"])
    for elsewhere in (str(tmp_path), ss.CheckpointOptions(tmp_path / "c")):
        assert_usage_error(lambda elsewhere=elsewhere: ss.run_in_workdir(ss.Gram(), X, w, checkpoint=elsewhere),
                           ["a workdir keeps its checkpoints in", "naming no directory", str(tmp_path)])
    assert_usage_error(lambda: ss.run_in_workdir(ss.Gram(), X, w, options=ss.RunOptions(checkpoint=str(tmp_path))),
                       ["checkpoints/", "run_in_workdir(checkpoint="])
    assert os.listdir(tmp_path) == []  # nothing written


def test_exit_statuses():
    assert workdir.exit_status(None) == 0
    assert workdir.exit_status(Preempted(10, 20, "/ck")) == 0
    assert workdir.exit_status(ss.UsageError("x")) == 2
    assert workdir.exit_status(ss.StorageError(28, "x")) == 5
    assert workdir.exit_status(KeyboardInterrupt()) == 130
    assert workdir.exit_status(RuntimeError("connection reset")) == 1  # a lost peer only in a multi-process job


class CrashError(Exception):
    pass


class FullDiskWriter:
    """A progress callback whose close fails, as a TensorBoard writer's flush on a full disk."""

    def __call__(self, p):
        if p.step == 2:
            raise CrashError

    def close(self):
        raise OSError(28, "No space left on device")


def test_the_runs_own_error_is_reported_when_closing_the_callbacks_fails_too(tmp_path):
    with pytest.raises(CrashError):
        ss.run_in_workdir(ss.Gram(), X, tmp_path, progress=ss.progress.combine(FullDiskWriter()), **KW)
    assert LEASE_FILE not in os.listdir(tmp_path)  # released


def test_a_reduction_of_several_passes_runs_every_pass_in_the_workdir(tmp_path):
    x = np.random.default_rng(5).normal(size=(20_000, 2)).astype(np.float32)
    exact = ss.Quantiles(qs=[0.1, 0.5], k=16, exact=True, method="lower")  # one pass: far off at k=16
    result, summary = ss.run_in_workdir(exact, x, tmp_path, mesh="data:4")
    np.testing.assert_array_equal(result.quantiles, np.quantile(x, [0.1, 0.5], axis=0, method="lower").T)
    assert summary["passes"] > 1 and sorted(os.listdir(tmp_path / workdir.CHECKPOINTS))[0] == "pass1"
    assert LEASE_FILE not in os.listdir(tmp_path / workdir.CHECKPOINTS / "pass1")  # the workdir's lease covers it
    again, done = ss.run_in_workdir(exact, x, tmp_path, mesh="data:4")
    assert done["already_done"]
    np.testing.assert_array_equal(again["quantiles"], result.quantiles)


def test_links_in_the_workdir_are_never_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own file")
    work = tmp_path / "work"
    work.mkdir()
    (work / LEASE_FILE).symlink_to(victim)
    assert_usage_error(lambda: ss.run_in_workdir(ss.Sum(), X, work, **KW), ["lock.json", "symbolic link", "remove it"])
    (work / LEASE_FILE).unlink()
    for name in (workdir.RESULT, workdir.SUMMARY, f"{workdir.RESULT}.tmp", f"{workdir.SUMMARY}.tmp"):
        (work / name).symlink_to(victim)
    old_umask = os.umask(0)
    try:
        result, _ = ss.run_in_workdir(ss.Sum(), X, work, **KW)
    finally:
        os.umask(old_umask)
    assert victim.read_text() == "the user's own file"
    for name in (workdir.RESULT, workdir.SUMMARY):
        assert not (work / name).is_symlink() and (work / name).stat().st_mode & 0o777 == 0o644
    np.testing.assert_allclose(workdir.load_result(work)["sum"], X.astype(np.float64).sum(0), rtol=1e-5)
    (work / LEASE_FILE).mkdir()
    assert_usage_error(lambda: ss.run_in_workdir(ss.Gram(), X, work, **KW), ["lock.json", "a directory"])


@pytest.mark.parametrize("damage", ["another result", "truncated", "deleted"])
def test_a_replaced_or_damaged_result_is_rebuilt_from_the_final_checkpoint(tmp_path, damage):
    want, summary = ss.run_in_workdir(ss.Gram(), X, tmp_path, **KW)
    result = tmp_path / workdir.RESULT
    assert summary["result_sha256"] == workdir.result_digest(tmp_path)
    if damage == "another result":
        np.savez(result, result=np.zeros_like(want))
    elif damage == "truncated":
        result.write_bytes(result.read_bytes()[:100])
    else:
        result.unlink()
    got, again = ss.run_in_workdir(ss.Gram(), X, tmp_path, **KW)
    assert "already_done" not in again and again["resumed_from_cursor"] == len(X) and again["rows_this_run"] == 0
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(workdir.load_result(tmp_path)["result"], want)
    assert ss.run_in_workdir(ss.Gram(), X, tmp_path, **KW)[1]["already_done"]


def reject(constant):
    raise ValueError(f"not strict JSON: {constant}")


def test_a_workdir_holds_every_output_or_is_not_done_and_the_rerun_writes_what_is_missing(tmp_path, monkeypatch):
    """Issue 42, build item 6: an output missing (deleted, or a crash between the writes) or damaged was never
    written again ("already done"); summary.json now covers each, and every JSON file is strict JSON."""
    outputs = {"gram.txt": lambda r: np.array2string(np.asarray(r)), "none.txt": lambda r: None}
    (tmp_path / "none.txt").write_text("another job's file")
    writes = workdir.write_atomically

    def crash_at_gram(where, name, write):
        if name == "gram.txt":
            raise CrashError  # after result.npz, before gram.txt and summary.json
        writes(where, name, write)

    monkeypatch.setattr(workdir, "write_atomically", crash_at_gram)
    with pytest.raises(CrashError):
        ss.run_in_workdir(ss.Gram(), X, tmp_path, outputs=outputs, **KW)
    monkeypatch.setattr(workdir, "write_atomically", writes)
    assert (tmp_path / workdir.RESULT).exists() and not (tmp_path / "gram.txt").exists()
    record = {"limits": (float("inf"), float("-inf"), float("nan"))}
    want, summary = ss.run_in_workdir(ss.Gram(), X, tmp_path, outputs=outputs, record=record, **KW)
    assert "already_done" not in summary and summary["rows_this_run"] == 0  # from the final checkpoint
    text = (tmp_path / "gram.txt").read_text()
    assert text == outputs["gram.txt"](want) and not (tmp_path / "none.txt").exists()
    written = json.loads((tmp_path / workdir.SUMMARY).read_text(), parse_constant=reject)
    assert written == summary and written["limits"] == ["inf", "-inf", None]  # the one spelling: result.json's
    assert written["outputs_sha256"]["none.txt"] is None and written["result_sha256"] == workdir.result_digest(tmp_path)
    for damage in ("delete", "truncate"):
        if damage == "delete":
            (tmp_path / "gram.txt").unlink()
        else:
            (tmp_path / "gram.txt").write_text(text[:10])
        got, again = ss.run_in_workdir(ss.Gram(), X, tmp_path, outputs=outputs, **KW)
        assert "already_done" not in again and again["resumed_from_cursor"] == len(X) and again["rows_this_run"] == 0
        np.testing.assert_array_equal(got, want)
        assert (tmp_path / "gram.txt").read_text() == text
    assert ss.run_in_workdir(ss.Gram(), X, tmp_path, outputs=outputs, **KW)[1]["already_done"]
    assert ss.run_in_workdir(ss.Gram(), X, tmp_path, **KW)[1]["already_done"]  # asks for fewer files: done
    more = {**outputs, "new.txt": lambda r: "a file this summary does not cover"}
    assert "already_done" not in ss.run_in_workdir(ss.Gram(), X, tmp_path, outputs=more, **KW)[1]
    assert (tmp_path / "new.txt").exists() and ss.run_in_workdir(ss.Gram(), X, tmp_path, outputs=more, **KW)[1][
        "already_done"]
