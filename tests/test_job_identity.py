"""What names a job decides what resumes: a data file's size and modification time, the code
of a from_fn body; fields that only mean something together; how often a job saves."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

import sharded_scan as ss
from configs import gram
from launch.data import make_source
from tests.helpers import assert_usage_error

KW = {"mesh": "data:4", "microbatch": 8, "steps_per_call": 2}  # 64 rows a step


class CrashError(Exception):
    pass


def crash_at_step_3(p):
    if p.step == 3:
        raise CrashError


def test_a_changed_data_file_is_named_and_resumes_only_when_told(tmp_path):
    x = np.random.default_rng(0).normal(size=(700, 3)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    ck = str(tmp_path / "ck")
    with pytest.raises(CrashError):
        ss.run(ss.Gram(), ss.sources.NpySource(tmp_path / "x.npy"), checkpoint=ss.CheckpointOptions(ck, every_steps=1),
               progress=crash_at_step_3, **KW)
    os.utime(tmp_path / "x.npy", ns=(0, 10**9))  # same bytes, another modification time (a copy, a touch)
    src = ss.sources.NpySource(tmp_path / "x.npy")
    assert_usage_error(lambda: ss.run(ss.Gram(), src, checkpoint=ck, **KW),
                       ["the data changed since the checkpoint at row 128", "x.npy", "there but",
                        "--config.checkpoint.ignore_changed_data=true", "start afresh"])
    got, report = ss.run_with_report(
        ss.Gram(), src, checkpoint=ss.CheckpointOptions(ck, ignore_changed_data=True), **KW)
    assert report.resumed_from_cursor == 128
    np.testing.assert_array_equal(got, ss.run(ss.Gram(), x, **KW))


def test_an_edited_from_fn_body_is_another_job(tmp_path):
    x = np.ones((300, 3), np.float32)
    ck = str(tmp_path / "ck")
    first = ss.from_fn(lambda c, b: c + b.sum(0), jnp.zeros(3))
    np.testing.assert_array_equal(ss.run(first, x, checkpoint=ck, **KW), np.full(3, 300.0))
    edited = ss.from_fn(lambda c, b: c + 2 * b.sum(0), jnp.zeros(3))
    assert_usage_error(lambda: ss.run(edited, x, checkpoint=ck, **KW),
                       ["different job", "the code of", "<lambda>", "changed"])
    again = ss.from_fn(lambda c, b: c + b.sum(0), jnp.zeros(3))  # the same code, another function object
    np.testing.assert_array_equal(ss.run(again, x, checkpoint=ck, **KW), np.full(3, 300.0))


def test_a_data_field_the_kind_does_not_read_is_an_error():
    config = gram.get_config("quick")
    config.data.path = "/data/X.npy"  # kind is still "synthetic": the job would run on synthetic rows
    assert_usage_error(lambda: make_source(config.data),
                       ["config.data.path='/data/X.npy'", "'synthetic'", "--config.data.kind=npy"])


def saves(policy, total):
    """Checkpoints a job of ``total`` steps writes under ``policy`` (periodic ones and the final one)."""
    policy.plan(total)
    count = 0
    for step in range(1, total):  # the engine asks after every step but the last
        if policy.due(step, False):
            policy.saved(step)
            count += 1
    return count + 1


def test_saves_scale_with_the_job():
    assert saves(ss.checkpoint.SavePolicy(1, None), 40) == 40
    assert saves(ss.checkpoint.SavePolicy(1, None, per_job=4), 40) == 4
    assert saves(ss.checkpoint.SavePolicy(2, None, per_job=4), 8) == 4  # a small job keeps every_steps
    assert gram.get_config("quick").checkpoint.per_job == 4  # :quick writes a handful, whatever the data


@pytest.mark.parametrize("kind", ["parquet", "csv"])
def test_a_parquet_or_csv_file_replaced_between_a_crash_and_the_resume_is_named(tmp_path, kind):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    rng = np.random.default_rng(1)
    path = tmp_path / f"x.{kind}"

    def write(seed_shift):
        frame = pd.DataFrame(rng.normal(size=(700, 3)).astype(np.float32) + seed_shift, columns=["a", "b", "c"])
        frame.to_parquet(path) if kind == "parquet" else frame.to_csv(path, index=False)

    def source():
        return (ss.sources.ParquetSource if kind == "parquet" else ss.sources.CsvSource)(path, dtype="float32")

    write(0)
    ck = str(tmp_path / "ck")
    with pytest.raises(CrashError):
        ss.run(ss.Gram(), source(), checkpoint=ss.CheckpointOptions(ck, every_steps=1), progress=crash_at_step_3, **KW)
    assert str(path) in source().stamps()
    write(100)  # other rows, the same layout: resuming would mix both files
    os.utime(path, ns=(0, 10**9))
    assert_usage_error(lambda: ss.run(ss.Gram(), source(), checkpoint=ck, **KW),
                       ["the data changed since the checkpoint at row 128", f"x.{kind}"])
