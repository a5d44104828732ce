"""Input files that change: mid-run (one line, nothing lost), between a kill and the resume
(stamps, or the bytes themselves under verify_data="digest"), and after the job finished
(not "already done")."""

import dataclasses
import os
import shutil

import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan import workdir
from tests.helpers import CrashError, assert_usage_error, crash_at

KW = {"mesh": "data:4", "microbatch": 8, "steps_per_call": 2, "prefetch": 0}  # 64 rows a step, read when due
X = np.random.default_rng(5).normal(size=(700, 3)).astype(np.float32)
KINDS = ["npy", "parquet", "csv"]


def write(kind, path, x):
    """``x`` as a file of ``kind`` at ``path`` (same shape: same size for npy, same layout for the others)."""
    if kind == "npy":
        np.save(path, x)
        return
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    frame = pd.DataFrame(x, columns=["a", "b", "c"])
    if kind == "parquet":  # plain and uncompressed: the same values in another order take the same bytes
        frame.to_parquet(path, row_group_size=128, compression=None, use_dictionary=False)
    else:
        frame.to_csv(path, index=False)


def source(kind, path):
    if kind == "npy":
        return ss.sources.NpySource(path)
    return (ss.sources.ParquetSource if kind == "parquet" else ss.sources.CsvSource)(path, dtype="float32")


def rewritten_in_place(kind, path):
    """The file rewritten with its rows in another order (other rows at every cursor, the same size),
    then its modification time put back."""
    before = os.stat(path)
    if kind == "csv":
        lines = path.read_text().splitlines(keepends=True)
        path.write_text(lines[0] + "".join(reversed(lines[1:])))
    else:
        write(kind, path, X[::-1].copy())
    assert os.stat(path).st_size == before.st_size, (kind, os.stat(path).st_size, before.st_size)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


@pytest.mark.parametrize("change", ["rewritten", "deleted"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_file_changed_or_deleted_mid_run_is_one_line_and_the_checkpoint_resumes(tmp_path, kind, change):
    path = tmp_path / f"x.{kind}"
    write(kind, path, X)
    original = tmp_path / "original"
    shutil.copy2(path, original)
    ck = ss.CheckpointOptions(str(tmp_path / "ck"), every_steps=1)

    def change_at_step_3(p):
        if p.step == 3:
            os.remove(path) if change == "deleted" else write(kind, path, X + 100)

    assert_usage_error(lambda: ss.run(ss.Gram(), source(kind, path), checkpoint=ck, progress=change_at_step_3, **KW),
                       [f"x.{kind}", "disappeared" if change == "deleted" else "changed while the job read it",
                        "nothing is lost", "checkpoints written so far are intact"])
    shutil.copy2(original, path)  # the original back, with its time: the same command resumes
    got, report = ss.run_with_report(ss.Gram(), source(kind, path), checkpoint=ck, **KW)
    assert report.resumed_from_cursor == 192
    np.testing.assert_array_equal(got, ss.run(ss.Gram(), source(kind, path), **KW))


@pytest.mark.parametrize("kind", KINDS)
def test_a_same_size_rewrite_with_its_time_put_back_is_caught_by_digests_only(tmp_path, kind):
    path = tmp_path / f"x.{kind}"
    write(kind, path, X)
    for verify in ("stamps", "digest"):
        ck = str(tmp_path / verify)
        write(kind, path, X)
        with pytest.raises(CrashError):
            ss.run(ss.Gram(), source(kind, path), progress=crash_at(3),
                   checkpoint=ss.CheckpointOptions(ck, every_steps=1, verify_data=verify), **KW)
        rewritten_in_place(kind, path)
        options = ss.CheckpointOptions(ck, verify_data=verify)
        if verify == "stamps":  # what stamps cannot see (documented): it resumes
            assert ss.run_with_report(ss.Gram(), source(kind, path), checkpoint=options, **KW)[1].resumed_from_cursor
        else:
            assert_usage_error(lambda: ss.run(ss.Gram(), source(kind, path), checkpoint=options, **KW),  # noqa: B023
                               ["the data changed since the checkpoint at row 128", f"x.{kind}", "holds other bytes",
                                "size and modification time are the same", "ignore_changed_data"])


def test_digests_cover_every_file_of_npy_shards_and_a_zarr_directory(tmp_path):
    for i, part in enumerate(np.split(X, [300])):
        np.save(tmp_path / f"part-{i}.npy", part)
    fingerprint = {"files": ss.sources.NpyShardsSource(tmp_path).stamps()}
    files = ss.identity.with_contents(fingerprint)["files"]
    assert all(", sha256 " in stamp for stamp in files.values()) and len(files) == 2
    assert ss.identity.with_contents({"files": files}) == {"files": files}  # read once
    zarr = tmp_path / "x.zarr"
    (zarr / "c").mkdir(parents=True)
    (zarr / "zarr.json").write_text("{}")
    (zarr / "c" / "0").write_bytes(b"chunk")
    stamps = {str(zarr): "dir", str(zarr / "zarr.json"): "meta", str(zarr / "c"): "chunks"}
    digested = ss.identity.with_contents({"files": stamps})["files"]
    assert ", sha256 " in digested[str(zarr)] and digested[str(zarr / "c")] == "chunks"  # the directory covers it
    (zarr / "c" / "0").write_bytes(b"chunK")
    assert ss.identity.with_contents({"files": stamps})["files"] != digested
    assert_usage_error(lambda: ss.identity.with_contents({"files": {str(tmp_path / "gone.npy"): "8 bytes"}}),
                       ["verify_data='digest' cannot read", "gone.npy", "verify_data='stamps'"])


@pytest.mark.parametrize("verify", ["stamps", "digest"])
def test_a_finished_job_whose_input_changed_says_which_instead_of_already_done(tmp_path, verify):
    path = tmp_path / "x.npy"
    write("npy", path, X)
    work = tmp_path / "work"
    fields = ss.CheckpointOptions(verify_data=verify)
    want, summary = ss.run_in_workdir(ss.Gram(), ss.sources.NpySource(path), work, checkpoint=fields, **KW)
    assert list(summary["files"]) == [str(path)]
    assert (", sha256 " in summary["files"][str(path)]) == (verify == "digest")
    rewritten_in_place("npy", path)
    if verify == "stamps":  # the stamps are the same: it cannot tell (documented)
        _, done = ss.run_in_workdir(ss.Gram(), ss.sources.NpySource(path), work, checkpoint=fields, **KW)
        assert done["already_done"]
    os.utime(path, ns=(0, 10**9))  # now the time differs too
    listing = {p: os.stat(work / p).st_mtime_ns for p in os.listdir(work)}
    assert_usage_error(
        lambda: ss.run_in_workdir(ss.Gram(), ss.sources.NpySource(path), work, checkpoint=fields, **KW),
        [str(work), "holds this job's result, computed before the data changed", "x.npy", "new workdir",
         "ignore_changed_data=true"])
    got, again = ss.run_in_workdir(ss.Gram(), ss.sources.NpySource(path), work,
                                   checkpoint=dataclasses.replace(fields, ignore_changed_data=True), **KW)
    assert again["already_done"] and "x.npy" in again["data_changed"]
    assert {p: os.stat(work / p).st_mtime_ns for p in os.listdir(work)} == listing  # both read only
    np.testing.assert_array_equal(got["result"], want)
    shutil.rmtree(work)  # a new workdir runs the new data
    assert not ss.run_in_workdir(ss.Gram(), ss.sources.NpySource(path), work, checkpoint=fields, **KW)[1].get(
        "already_done")
    assert workdir.load_result(work)["result"].shape == (3, 3)
