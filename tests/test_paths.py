"""Paths: str, pathlib and epath alike, in a directory named with spaces and non-ASCII
characters; and the remote branches (``gs://``) against an in-memory fake of the store."""

import glob
import json
import os
import pathlib
import socket
import time

import numpy as np
import pytest
import tensorstore as ts
from etils import epath
from etils.epath import backend as epath_backend
from etils.epath import gpath
from fsspec.implementations.memory import MemoryFileSystem

import sharded_scan as ss
from sharded_scan import checkpoint, checkpoint_damage, checkpoint_store, storage
from sharded_scan.lease import LEASE_FILE, Lease
from sharded_scan.sources import NpyShardsSource, NpySource, ZarrSource
from tests.helpers import assert_usage_error
from tests.test_checkpoint import CrashError, crash_at

KW = {"mesh": "data:8", "microbatch": 8, "steps_per_call": 2}  # 128 rows a step
X = np.random.default_rng(0).normal(size=(700, 3)).astype(np.float32)
KINDS = {"str": str, "pathlib": pathlib.Path, "epath": epath.Path}
ODD = "données d'été ü"


@pytest.fixture
def odd(tmp_path):
    directory = tmp_path / ODD
    directory.mkdir()
    return directory


@pytest.mark.parametrize(("first", "then"), [("str", "pathlib"), ("pathlib", "epath"), ("epath", "str")])
def test_a_run_from_an_npy_file_crashes_and_resumes_bitwise_whatever_the_path_type(odd, first, then):
    np.save(odd / "x.npy", X)
    want = ss.run(ss.Gram(), X, **KW)

    def run(kind, **kw):
        as_kind = KINDS[kind]
        options = ss.CheckpointOptions(as_kind(odd / "ck"), every_steps=1)
        return ss.run_with_report(ss.Gram(), NpySource(as_kind(odd / "x.npy")), checkpoint=options, **KW, **kw)

    with pytest.raises(CrashError):
        run(first, progress=crash_at(3))
    got, report = run(then)  # another path type names the same job: the same fingerprint
    assert report.resumed_from_cursor == 2 * 128
    np.testing.assert_array_equal(got, want)
    assert LEASE_FILE not in os.listdir(odd / "ck")
    assert checkpoint_damage.damaged_steps(KINDS[then](odd / "ck")) == []


@pytest.mark.parametrize("kind", KINDS)
def test_file_sources_take_every_path_type(odd, kind):
    as_kind = KINDS[kind]
    np.save(odd / "x.npy", X)
    shards = odd / "parts [v1]"  # glob's brackets in a directory's name are a name, not a pattern
    shards.mkdir()
    for i, part in enumerate(np.split(X, [100, 350])):
        np.save(shards / f"part-{i}.npy", part)
    ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(odd / "x.zarr")}}, create=True,
            dtype=ts.float32, shape=list(X.shape)).result().write(X).result()
    for src, named in [(NpySource(as_kind(odd / "x.npy")), odd / "x.npy"),
                       (NpyShardsSource(as_kind(shards)), shards / "part-0.npy"),
                       (ZarrSource(as_kind(odd / "x.zarr")), odd / "x.zarr")]:
        np.testing.assert_array_equal(src.read(90, 400), X[90:400])
        assert str(named) in src.stamps() and str(named) in json.dumps(src.describe(), ensure_ascii=False)
    matched = NpyShardsSource(as_kind(os.path.join(glob.escape(str(shards)), "part-*.npy")))
    assert [os.path.basename(p) for p in matched.paths] == ["part-0.npy", "part-1.npy", "part-2.npy"]


def test_unknown_url_schemes_are_one_line():
    assert_usage_error(lambda: ss.CheckpointOptions("memory://bucket/ck"), ["etils.epath cannot open memory://"])
    assert_usage_error(lambda: NpySource("memory://bucket/x.npy"), ["etils.epath cannot open memory://"])


# ---- the remote branches, against an in-memory store standing in for gs:// -------------------------------


@pytest.fixture
def gs(monkeypatch):
    """``gs://`` paths read and written in memory, through etils.epath's fsspec backend."""

    class FakeGcs(MemoryFileSystem):
        protocol = ("gs", "gcs")
        store, pseudo_dirs = {}, [""]  # this test's own

        @classmethod
        def _strip_protocol(cls, path):
            path = os.fspath(path)
            return "/" + (path[len("gs://"):] if path.startswith("gs://") else path).strip("/")

        def info(self, path, **kwargs):  # with a modification time, as GCS gives one
            out = super().info(path, **kwargs)
            return {**out, "mtime": self.modified(path)} if out["type"] == "file" else out

    fake = FakeGcs()
    monkeypatch.setattr(gpath, "_is_tf_installed", lambda: False, raising=False)
    monkeypatch.setattr(epath_backend.fsspec_backend, "fs", lambda path: fake)
    return fake


def upload(local, url):
    """Copies a local file or tree to ``url`` on the fake store."""
    local, url = pathlib.Path(local), epath.Path(url)
    if local.is_dir():
        url.mkdir(parents=True, exist_ok=True)
        for child in local.iterdir():
            upload(child, url / child.name)
    else:
        url.write_bytes(local.read_bytes())


def test_remote_npy_reads_and_runs_through_epath(gs, tmp_path):
    np.save(tmp_path / "x.npy", X)
    url = f"gs://bucket/{ODD}/x.npy"
    upload(tmp_path / "x.npy", url)
    for path in (url, epath.Path(url)):
        src = NpySource(path)
        np.testing.assert_array_equal(src.read(3, 517), X[3:517])
        assert src.describe()["path"] == url and list(src.stamps()) == [url]
        assert src.stamps()[url].startswith(f"{os.path.getsize(tmp_path / 'x.npy')} bytes, modified 20")
    np.testing.assert_array_equal(ss.run(ss.Gram(), NpySource(url), **KW), ss.run(ss.Gram(), X, **KW))
    assert_usage_error(lambda: NpySource(url, zero_copy=True), ["zero_copy maps local files only", "drop zero_copy"])
    assert_usage_error(lambda: NpySource(url + ".missing"), ["no such .npy file"])

    src = NpySource(url)
    epath.Path(url).write_bytes(epath.Path(url).read_bytes()[:-12])  # rewritten shorter while the job reads it
    assert_usage_error(lambda: src.read(0, 10), ["changed while the job read it", url])


def test_remote_npy_shards_are_globbed_through_epath(gs):
    for i, part in zip((10, 2, 1), np.split(X, [100, 350]), strict=True):
        with epath.Path(f"gs://bucket/{ODD}/part-{i}.npy").open("wb") as f:
            np.save(f, part)
    order = [X[350:], X[100:350], X[:100]]  # part-1, part-2, part-10
    for shards in (f"gs://bucket/{ODD}", epath.Path(f"gs://bucket/{ODD}"), f"gs://bucket/{ODD}/part-*.npy"):
        src = NpyShardsSource(shards)
        assert [p.rsplit("/", 1)[1] for p in src.paths] == ["part-1.npy", "part-2.npy", "part-10.npy"]
        np.testing.assert_array_equal(src.read(0, len(X)), np.concatenate(order))
    assert_usage_error(lambda: NpyShardsSource("gs://bucket/nothing/*.npy"), ["no .npy shards found"])


def test_remote_zarr_is_stamped_by_its_metadata_file(gs, odd):
    ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(odd / "x.zarr")}}, create=True,
            dtype=ts.float32, shape=list(X.shape)).result().write(X).result()
    src = ZarrSource(odd / "x.zarr")
    url = f"gs://bucket/{ODD}/x.zarr"
    upload(odd / "x.zarr", url)
    src._path = url  # what ZarrSource(url) holds once tensorstore has opened it (no GCS here)
    assert src.describe()["path"] == url and list(src.stamps()) == [f"{url}/.zarray"]
    src._path = "memory://x.zarr"  # a kvstore epath cannot open: no stamps, as before
    assert src.stamps() == {}


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """Checkpoints at cursors 256 and 384 of a Gram run that died in step 4."""
    directory = tmp_path_factory.mktemp("crashed") / "ck"
    options = ss.CheckpointOptions(str(directory), every_steps=1, keep=2)
    with pytest.raises(CrashError):
        ss.run(ss.Gram(), X, checkpoint=options, progress=crash_at(4), **KW)
    assert sorted(os.listdir(directory)) == ["256", "384"]
    return directory


def test_a_remote_checkpoint_directory_is_listed_checked_and_set_aside_through_epath(gs, crashed):
    url = f"gs://bucket/{ODD}/ck"
    upload(crashed, url)
    assert checkpoint_damage.damaged_steps(url) == []
    (epath.Path(url) / "384" / checkpoint_store.COMMIT_MARKER).unlink()
    assert checkpoint_damage.damaged_steps(epath.Path(url)) == [("384", "commit_success.txt is missing")]

    ckpt = checkpoint.as_checkpointer(url)  # not made absolute, not checked as a local directory
    root = epath.Path(url)
    assert ckpt.directory == url and storage.check_room(url, 1 << 60) is None
    assert checkpoint_store.committed_steps(root) == [256]
    assert checkpoint.intact(root, 384) == "the previous checkpoint at row 256 is intact"
    on_disk = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(crashed / "256") for f in fs)
    assert checkpoint_store.room_needed(root, None) == int(1.25 * on_disk) + checkpoint_store.METADATA_BYTES
    checkpoint_damage.move_aside(url, "384", checkpoint_damage.aside_target(root, "384"), "the marker is missing")
    assert sorted(p.name for p in root.iterdir()) == ["256", checkpoint_damage.DAMAGED]
    [moved] = (root / checkpoint_damage.DAMAGED).iterdir()
    assert moved.name.startswith("384-")
    want = {str(p.relative_to(crashed / "384")) for p in (crashed / "384").rglob("*") if p.is_file()}
    assert files_under(moved) == want - {checkpoint_store.COMMIT_MARKER}  # every file moved, the marker deleted first


def files_under(url, prefix=""):
    """Relative names of the files under ``url`` on the fake store."""
    found = set()
    for child in url.iterdir():
        name = f"{prefix}{child.name}"
        found |= files_under(child, f"{name}/") if child.is_dir() else {name}
    return found


def test_a_remote_lease_is_advisory_checked_then_written(gs):
    url = f"gs://bucket/{ODD}"
    lock = epath.Path(url) / LEASE_FILE
    with Lease(url, "job") as lease:
        assert lease.held and json.loads(lock.read_text())["pid"] == os.getpid()
    assert not lock.exists()

    other = {"host": socket.gethostname() + "-other", "pid": 1, "since": "today", "job": "job"}
    lock.write_text(json.dumps({**other, "heartbeat": time.time()}))  # another host, beating
    assert_usage_error(lambda: Lease(url, "job").acquire(), ["is in use by pid 1", "(same job)", "force_unlock"])
    with Lease(url, "job", force=True):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    lock.write_text(json.dumps({**other, "heartbeat": time.time() - 3600}))  # stale: its holder is gone
    with Lease(url, "job"):
        lock.write_text(json.dumps({**other, "heartbeat": time.time()}))  # taken over (forced) meanwhile
    assert json.loads(lock.read_text())["host"] == other["host"]  # release leaves the new holder's record
