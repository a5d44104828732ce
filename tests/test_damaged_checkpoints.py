"""A damaged latest checkpoint is skipped with a warning, set aside and never loaded."""

import errno
import glob
import json
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan import fs
from sharded_scan.checkpoint import KEY_ENV
from sharded_scan.checkpoint_damage import DAMAGED, damaged_steps
from sharded_scan.digest import json_digest, keyed_digest
from sharded_scan.errors import StorageError
from tests import cli
from tests.helpers import assert_usage_error

KW = {"mesh": "data:8", "microbatch": 8, "steps_per_call": 2}  # 128 rows per step
X = np.random.default_rng(3).normal(size=(1009, 5)).astype(np.float32)


class CrashError(Exception):
    pass


def crash_at_step_5(p):
    if p.step == 5:
        raise CrashError


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """Checkpoints at cursors 256, 384, 512 of a Gram run that died in step 5, and the uninterrupted result."""
    directory = tmp_path_factory.mktemp("crashed") / "ck"
    options = ss.CheckpointOptions(str(directory), every_steps=1, keep=3)
    with pytest.raises(CrashError):
        ss.run(ss.Gram(), X, checkpoint=options, progress=crash_at_step_5, **KW)
    assert sorted(int(n) for n in os.listdir(directory)) == [256, 384, 512]
    return directory, ss.run(ss.Gram(), X, **KW)


def no_commit_marker(step):
    os.remove(step / "commit_success.txt")


def no_step_metadata(step):
    os.remove(step / "_CHECKPOINT_METADATA")


def truncated_meta(step):
    path = step / "meta" / "metadata"
    path.write_text(path.read_text()[:10])


def truncated_arrays(step):
    files = [f for f in glob.glob(str(step / "partials" / "**" / "d" / "*"), recursive=True) if os.path.isfile(f)]
    assert files
    for f in files:
        os.truncate(f, os.path.getsize(f) // 3)


def emptied(step):
    shutil.rmtree(step)
    step.mkdir()


def half_written(step):
    """A save killed before orbax renamed its temporary directory."""
    os.rename(step, step.with_name(f"{step.name}.orbax-checkpoint-tmp-1234"))


DAMAGES = [no_commit_marker, no_step_metadata, truncated_meta, truncated_arrays, emptied, half_written]


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__)
def test_damaged_latest_is_skipped_and_the_previous_one_used(tmp_path, crashed, damage, caplog):
    original, want = crashed
    directory = tmp_path / "ck"
    shutil.copytree(original, directory)
    damage(directory / "512")
    with caplog.at_level(logging.WARNING, logger="sharded_scan.checkpoint"):
        got, report = ss.run_with_report(ss.Gram(), X, checkpoint=ss.CheckpointOptions(str(directory)), **KW)
    assert report.resumed_from_cursor == 384  # never the damaged 512
    np.testing.assert_array_equal(got, want)  # bitwise: every row once
    if damage is not half_written:  # orbax itself drops its temporary directories
        warnings = [r.getMessage() for r in caplog.records if "damaged checkpoint 512" in r.getMessage()]
        assert len(warnings) == 1 and "using the one before it" in warnings[0], caplog.text
        assert [p.split("-")[0] for p in os.listdir(directory / DAMAGED)] == ["512"]
    assert damaged_steps(str(directory)) == []


def test_every_checkpoint_damaged_starts_afresh(tmp_path, crashed):
    original, want = crashed
    directory = tmp_path / "ck"
    shutil.copytree(original, directory)
    for cursor in (256, 384):
        no_commit_marker(directory / str(cursor))
    truncated_arrays(directory / "512")
    got, report = ss.run_with_report(ss.Gram(), X, checkpoint=ss.CheckpointOptions(str(directory)), **KW)
    assert report.resumed_from_cursor is None and report.rows_this_run == len(X)
    np.testing.assert_array_equal(got, want)
    assert sorted(p.split("-")[0] for p in os.listdir(directory / DAMAGED)) == ["256", "384", "512"]


def test_a_checkpoint_of_another_job_is_refused_not_skipped(tmp_path, crashed):
    original, _ = crashed
    directory = tmp_path / "ck"
    shutil.copytree(original, directory)
    with pytest.raises(ss.UsageError, match="different job"):
        ss.run(ss.Gram(), X[:1000], checkpoint=ss.CheckpointOptions(str(directory)), **KW)
    assert sorted(os.listdir(directory)) == ["256", "384", "512"]


def flipped_array_byte(step):
    """One byte of the array data XOR 0x40 inside the compressed payload: readable, and wrong."""
    files = [f for f in glob.glob(str(step / "partials" / "**" / "d" / "*"), recursive=True) if os.path.isfile(f)]
    big = pathlib.Path(max(files, key=os.path.getsize))
    data = bytearray(big.read_bytes())
    data[len(data) // 2] ^= 0x40
    big.write_bytes(bytes(data))


def edited_meta(step):
    """Valid JSON that says something else (steps 4 -> 5)."""
    path = step / "meta" / "metadata"
    meta = json.loads(path.read_text())
    meta["steps"] += 1
    path.write_text(json.dumps(meta))


def edited_source_state(step):
    path = step / "source" / "metadata"
    saved = json.loads(path.read_text())
    saved["processes"] = [{"skip": 1}]
    path.write_text(json.dumps(saved))


@pytest.mark.parametrize("damage", [flipped_array_byte, edited_meta, edited_source_state], ids=lambda f: f.__name__)
def test_bytes_that_do_not_match_their_digest_are_set_aside(tmp_path, crashed, damage, caplog):
    test_damaged_latest_is_skipped_and_the_previous_one_used(tmp_path, crashed, damage, caplog)


def test_a_set_aside_the_storage_refuses_is_one_line_and_moves_nothing(tmp_path, crashed):
    original, _ = crashed
    directory = tmp_path / "ck"
    shutil.copytree(original, directory)
    no_commit_marker(directory / "512")

    def refuse(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied", src)

    with fs.replaced(replace=refuse), pytest.raises(StorageError) as err:
        ss.run(ss.Gram(), X, checkpoint=str(directory), **KW)
    message = str(err.value)
    assert "\n" not in message and err.value.errno == errno.EACCES
    for words in ("could not set aside the damaged checkpoint 512", "permission denied", "nothing was moved or "
                  "deleted", "give this user write permission and rerun the same command"):
        assert words in message, message
    assert sorted(p for p in os.listdir(directory) if p.isdigit()) == ["256", "384", "512"]


KILLED_AFTER_THE_MOVE = """
import os, signal, sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
import sharded_scan as ss
from sharded_scan import fs
from tests.test_damaged_checkpoints import KW, X

def replace(src, dst):  # the set-aside's move, then SIGKILL
    os.replace(src, dst)
    os.kill(os.getpid(), signal.SIGKILL)

with fs.replaced(replace=replace):
    ss.run(ss.Gram(), X, checkpoint=sys.argv[1], **KW)
"""


def test_a_sigkill_during_the_set_aside_loses_nothing(tmp_path, crashed):
    original, want = crashed
    directory = tmp_path / "ck"
    shutil.copytree(original, directory)
    flipped_array_byte(directory / "512")
    killed = subprocess.run([sys.executable, "-c", KILLED_AFTER_THE_MOVE, str(directory)], cwd=cli.ROOT, env=cli.env(),
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert [p.split("-")[0] for p in os.listdir(directory / DAMAGED)] == ["512"]  # moved, then killed
    got, report = ss.run_with_report(ss.Gram(), X, checkpoint=str(directory), **KW)
    assert report.resumed_from_cursor == 384
    np.testing.assert_array_equal(got, want)


def digests_removed(step):
    """Every digest field deleted from the meta: the checks would be off, so it is refused."""
    path = step / "meta" / "metadata"
    meta = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in meta.items() if k not in ("digest", "partials_digests",
                                                                           "source_digest")}))


def partials_digests_removed_and_meta_digest_recomputed(step):
    path = step / "meta" / "metadata"
    meta = {k: v for k, v in json.loads(path.read_text()).items() if k not in ("partials_digests", "digest")}
    path.write_text(json.dumps({**meta, "digest": json_digest(meta)}))


@pytest.mark.parametrize("damage", [digests_removed, partials_digests_removed_and_meta_digest_recomputed],
                         ids=lambda f: f.__name__)
def test_a_meta_without_its_digest_fields_is_set_aside(tmp_path, crashed, damage, caplog):
    test_damaged_latest_is_skipped_and_the_previous_one_used(tmp_path, crashed, damage, caplog)
    assert "lacks the digest field" in caplog.text and "partials_digests" in caplog.text


KEY = "a secret the operator keeps"


def forged(step):
    """What one who can write the directory but lacks the key does: edit the meta, recompute its SHA-256."""
    path = step / "meta" / "metadata"
    meta = json.loads(path.read_text())
    kept = {k: meta.pop(k) for k in ("hmac",) if k in meta}  # the HMAC it cannot recompute stays as it was
    meta.pop("digest")
    meta["steps"] += 100
    path.write_text(json.dumps({**meta, "digest": json_digest(meta), **kept}))


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    """Checkpoints at 256, 384, 512 signed with KEY (a run that died in step 5)."""
    directory = tmp_path_factory.mktemp("signed") / "ck"
    with pytest.raises(CrashError):
        ss.run(ss.Gram(), X, checkpoint=ss.CheckpointOptions(str(directory), every_steps=1, keep=3, hmac_key=KEY),
               progress=crash_at_step_5, **KW)
    return directory


def test_a_keyed_checkpoint_resumes_under_its_key_and_the_key_is_never_written(tmp_path, crashed, signed,
                                                                               monkeypatch):
    _, want = crashed
    options = ss.CheckpointOptions(str(tmp_path / "ck"), hmac_key=KEY)
    assert KEY not in repr(options) and KEY not in repr(ss.RunOptions(checkpoint=options))
    for how in ("option", "environment"):
        shutil.copytree(signed, tmp_path / "ck")
        if how == "environment":
            monkeypatch.setenv(KEY_ENV, KEY)
            options = ss.CheckpointOptions(str(tmp_path / "ck"))
        got, report = ss.run_with_report(ss.Gram(), X, checkpoint=options, **KW)
        assert report.resumed_from_cursor == 512 and not (tmp_path / "ck" / DAMAGED).exists()
        np.testing.assert_array_equal(got, want)
        for path in (tmp_path / "ck").rglob("*"):
            assert not path.is_file() or KEY.encode() not in path.read_bytes(), path
        shutil.rmtree(tmp_path / "ck")


@pytest.mark.parametrize("case", ["another key", "no HMAC", "forged"])
def test_a_checkpoint_the_key_does_not_sign_is_set_aside(tmp_path, crashed, signed, case, caplog):
    unsigned, want = crashed
    directory = tmp_path / "ck"
    shutil.copytree(unsigned if case == "no HMAC" else signed, directory)
    if case == "forged":
        forged(directory / "512")
        _, report = ss.run_with_report(ss.Gram(), X, checkpoint=ss.CheckpointOptions(str(directory)), **KW)
        assert report.resumed_from_step == 104  # without the key a recomputed SHA-256 passes: checksums only
        shutil.rmtree(directory)
        shutil.copytree(signed, directory)
        forged(directory / "512")
    key = "another secret" if case == "another key" else KEY
    with caplog.at_level(logging.WARNING, logger="sharded_scan.checkpoint"):
        got, report = ss.run_with_report(ss.Gram(), X, checkpoint=ss.CheckpointOptions(str(directory), hmac_key=key),
                                         **KW)
    np.testing.assert_array_equal(got, want)
    if case == "forged":
        assert report.resumed_from_cursor == 384 and "does not verify" in caplog.text
    else:  # every checkpoint set aside: it starts afresh
        assert report.resumed_from_cursor is None
        assert sorted(p.split("-")[0] for p in os.listdir(directory / DAMAGED)) == ["256", "384", "512"]
        assert ("does not verify" if case == "another key" else "has no HMAC") in caplog.text


def test_processes_holding_different_keys_stop_in_one_line(tmp_path, monkeypatch):
    from sharded_scan import checkpoint

    mine, gather = keyed_digest(KEY.encode(), "sharded_scan checkpoint key"), checkpoint.gather_json
    monkeypatch.setattr(checkpoint, "gather_json", lambda v: [v, None] if v == mine else gather(v))  # a peer without
    options = ss.CheckpointOptions(str(tmp_path / "ck"), hmac_key=KEY)
    assert_usage_error(lambda: ss.run(ss.Gram(), X, checkpoint=options, **KW),
                       ["processes of this job hold different checkpoint keys", KEY_ENV, "the same one"])
    assert not (tmp_path / "ck").exists()  # refused before anything was written


def test_orbax_is_imported_at_the_first_checkpoint_and_its_commit_marker_is_ours():
    """A job without checkpoints never imports orbax (a third of a second of every process's start); the
    marker a step directory is checked for is orbax's own."""
    code = "import sys, sharded_scan; print(sorted(m for m in ('orbax', 'orbax.checkpoint') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.stdout.strip() == "[]", done.stdout
    import orbax.checkpoint as ocp

    from sharded_scan import checkpoint_store
    assert checkpoint_store.COMMIT_MARKER == ocp.path.atomicity.COMMIT_SUCCESS_FILE
