"""One job per directory: an exclusive lease held in a lock file while the job runs.

The holder keeps ``DIR/lock.json`` open with an exclusive ``flock`` and writes into it
who holds it: host, pid, start time and the job's fingerprint digest. ``flock`` is
released by the kernel (or, on NFS, by the server) when the holder dies, so a lease
left by a killed job is free again at once; on mounts whose locks do not reach other
hosts (FUSE mounts such as GCS FUSE) the holder also rewrites the record every
:data:`HEARTBEAT_S` seconds, and there a record from another host younger than
:data:`STALE_S` still counts as held. A holder that exits removes the file; one that
was killed leaves it, stale. A new holder checks, once it has the lock, that the path
still names the file it locked, so removing never races with taking.

A remote directory (``gs://...``) has no locks: there the lease is advisory. The
record is read and, when no live holder's is there, written (and its heartbeat kept
up), so a second job started after the first is refused; two jobs started within
the same moment can both pass the check.

A second job on the directory gets one :class:`~sharded_scan.errors.UsageError` line
naming the holder before it touches anything; ``force=True`` takes the lease anyway.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
from typing import Any

from sharded_scan.errors import UsageError
from sharded_scan.paths import as_path, is_url, where

_log = logging.getLogger(__name__)

LEASE_FILE = "lock.json"
HEARTBEAT_S = 30.0   # how often a holder touches its lock file
STALE_S = 120.0      # a record from another host untouched this long is a dead holder's
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def _start_time(pid: int) -> str | None:
    """The kernel's start time of process ``pid`` (tells a live holder from a reused pid), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def mount_type(directory: str) -> str:
    """The file system type of the mount holding ``directory`` ("" when unknown)."""
    best, fstype = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and (directory + "/").startswith(fields[1].rstrip("/") + "/") \
                        and len(fields[1]) >= len(best):
                    best, fstype = fields[1], fields[2]
    except OSError:
        pass
    return fstype


# Where flock ignores the open mode, the lock is held through a read-only descriptor, so
# the mount can still be turned read-only under a running job; elsewhere (NFS emulates
# flock with fcntl locks, which need a writable descriptor) read-write.
_LOCAL_FILE_SYSTEMS = ("ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs")


def locks_reach_other_hosts(directory: str) -> bool:
    """Whether ``flock`` on ``directory`` excludes other hosts too (not on FUSE mounts such as gcsfuse)."""
    return not mount_type(directory).startswith("fuse")


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


class Lease:
    """An exclusive lease on ``directory`` for one job (a context manager).

    Args:
      directory: the directory (created if missing): a local path, or a URL (advisory lease).
      job: the job's fingerprint digest; the message says whether a holder runs the same job.
      force: take the lease even when another process holds it (the operator knows it is gone).
    """

    def __init__(self, directory: str | os.PathLike, job: str, force: bool = False):
        self.directory, self.job, self.force = where(directory), job, force
        self.path = os.path.join(self.directory, LEASE_FILE)
        self.remote = is_url(self.directory)
        self._fd: int | None = None
        self._remote_held = False
        self._since = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Lease:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    @property
    def held(self) -> bool:
        return self._fd is not None or self._remote_held

    def acquire(self) -> None:
        """Takes the lease, or raises a one-line UsageError naming the holder.

        Raises:
          UsageError: another live process holds the lease (and ``force`` is off).
          OSError: the lock file cannot be written (a storage fault).
        """
        if self.remote:
            self._acquire_remote()
            self._start_heartbeat()
            return
        os.makedirs(self.directory, exist_ok=True)
        self._since = _when(time.time())
        mode = os.O_RDONLY if mount_type(self.directory) in _LOCAL_FILE_SYSTEMS else os.O_RDWR
        for _ in range(5):
            fd = self._open(mode | os.O_CREAT)
            try:
                locked = self._lock(fd)
                try:
                    if os.fstat(fd).st_ino != os.stat(self.path).st_ino:
                        continue  # replaced between our open and our lock: try the new file
                except FileNotFoundError:
                    continue
                holder = self._read(fd)
                busy = not locked or self._alive_elsewhere(holder)
                if busy and not self.force:
                    raise UsageError(self._in_use(holder))
                if busy:
                    _log.warning("taking over %s from pid %s on %s (forced)", self.directory, holder.get("pid"),
                                 holder.get("host"))
                    if not locked:  # the holder keeps its lock on the old file; a fresh one is ours
                        os.unlink(self.path)
                        continue
                self._write(fd, self._record())
                self._fd, fd = fd, None
            finally:
                if fd is not None:
                    os.close(fd)
            self._start_heartbeat()
            return
        raise UsageError(f"{self.directory}: its lock file {LEASE_FILE} keeps being replaced; is another job starting?")

    def _acquire_remote(self) -> None:
        """The advisory lease on a remote directory: the record checked, then ours written."""
        lock = as_path(self.path)
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            holder = self._read_remote()
        except ImportError as e:  # the store's file system (gcsfs, s3fs, ...) is not installed
            raise UsageError(f"cannot use {self.directory}: {' '.join(str(e).split())}") from None
        self._since = _when(time.time())
        if self._alive_elsewhere(holder):
            if not self.force:
                raise UsageError(self._in_use(holder))
            _log.warning("taking over %s from pid %s on %s (forced)", self.directory, holder.get("pid"),
                         holder.get("host"))
        lock.write_text(json.dumps(self._record()) + "\n")
        self._remote_held = True

    def _read_remote(self) -> dict[str, Any]:
        lock = as_path(self.path)
        try:
            record = json.loads(lock.read_text()) if lock.exists() else {}
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) else {}

    def _ours(self, record: dict[str, Any]) -> bool:
        """Whether a remote record is still this holder's (not taken over by a forced one)."""
        return (record.get("host"), record.get("pid"), record.get("since")) == (
            socket.gethostname(), os.getpid(), self._since)

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat, name="sharded_scan-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Removes the lock file and drops the lock (idempotent; a storage fault is only logged)."""
        if not self.held:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.remote:
            self._remote_held = False
            try:
                if self._ours(self._read_remote()):
                    as_path(self.path).unlink()
            except OSError as e:
                _log.info("could not remove %s (a later job takes it over): %s", self.path, e)
            return
        fd, self._fd = self._fd, None
        try:
            if os.fstat(fd).st_ino == os.stat(self.path).st_ino:  # not taken over by a forced holder
                os.unlink(self.path)
        except OSError as e:
            _log.info("could not remove %s (a later job takes it over): %s", self.path, e)
        os.close(fd)  # drops the lock

    def _lock(self, fd: int) -> bool:
        """Whether this process now holds the kernel lock (True also where locks are unsupported)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno in _NO_LOCKS:
                return True  # no kernel locks here: the record alone decides
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise

    def _alive_elsewhere(self, holder: dict[str, Any]) -> bool:
        """Whether a record we could lock still names a live holder (locks that do not reach it)."""
        if not holder:
            return False
        if holder.get("host") == socket.gethostname():
            pid = int(holder.get("pid", 0))
            return pid != os.getpid() and _start_time(pid) == holder.get("pid_start")
        if not self.remote and locks_reach_other_hosts(self.directory):
            return False  # we hold the lock, so the holder on that host is gone
        return time.time() - float(holder.get("heartbeat", 0)) < STALE_S

    def _in_use(self, holder: dict[str, Any]) -> str:
        same = "same job" if holder.get("job") == self.job else "another job"
        since = holder.get("since", "an unknown time")
        return (
            f"{self.directory} is in use by pid {holder.get('pid', '?')} on {holder.get('host', '?')} since {since} "
            f"({same}); wait for it or pass --force_unlock (from Python: force_unlock=True) if you know it is gone"
        )

    def _record(self) -> dict[str, Any]:
        return {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _start_time(os.getpid()),
                "since": self._since, "heartbeat": time.time(), "job": self.job}

    def _open(self, flags: int) -> int:
        """Opens the local lease file, never through a symbolic link (whoever can write into a
        shared directory could otherwise point it at the job user's files)."""
        try:
            return os.open(self.path, flags | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.EISDIR):
                raise
            what = "a symbolic link" if e.errno == errno.ELOOP else "a directory"
            raise UsageError(f"{self.path} is {what}, not a lease file, and is never written through; remove it "
                             f"(and check who can write into {self.directory}), then rerun.") from None

    @staticmethod
    def _read(fd: int) -> dict[str, Any]:
        try:
            text = os.pread(fd, 1 << 16, 0).decode()
            record = json.loads(text) if text.strip() else {}
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) else {}

    def _write(self, fd: int, record: dict[str, Any]) -> None:
        """Writes ``record`` into the file ``fd`` (held read-only) names, through a short-lived writer."""
        out = self._open(os.O_WRONLY)
        try:
            if os.fstat(out).st_ino != os.fstat(fd).st_ino:
                return  # taken over (forced): the file is another holder's now
            os.ftruncate(out, 0)
            os.pwrite(out, (json.dumps(record) + "\n").encode(), 0)
            os.fsync(out)
        finally:
            os.close(out)

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if self.remote:
                try:
                    if not self._ours(self._read_remote()):
                        return  # taken over (forced)
                    as_path(self.path).write_text(json.dumps(self._record()) + "\n")
                except OSError as e:
                    _log.debug("lease heartbeat failed: %s", e)
                continue
            fd = self._fd
            if fd is None:
                return
            try:
                self._write(fd, self._record())
            except OSError as e:  # a storage fault here is met again, and reported, by the next save
                _log.debug("lease heartbeat failed: %s", e)
