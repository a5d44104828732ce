"""Faults, on purpose: each run ends in one line or resumes, and every rerun is bitwise right.

    python bench/faults.py                  # every fault below (root: the disk faults mount tmpfs)
    python bench/faults.py --faults kill --kills 2 --rows 20000   # what tests/test_faults.py runs

- ``kill``: SIGKILL a checkpointed job at a random moment (a third of them while a save is
  in flight), rerun it, compare with an uninterrupted run: bitwise, every row once.
- ``flip``: flip one random byte (XOR a random non-zero value) of a random file of the
  latest checkpoint and resume: it must be set aside, not matter, or stop the run in one
  line; never restored into a wrong result.
- ``disk_full``: fill the workdir's disk (a tmpfs) once a random checkpoint is complete, or
  while a save is in flight; then free it and rerun.
- ``erofs``: remount the workdir's file system read-only at a random moment; then
  read-write, and rerun.
- ``concurrent``: start the same command, and another job, on the workdir of a running
  job; both must be refused in one line and the running job must finish untouched.
- ``set_aside``: SIGKILL a rerun just before or just after it moves a damaged checkpoint
  into ``damaged/``; then rerun.
- ``sigterm``: 2 processes x 2 devices under CPU load; SIGTERM one of them at a random
  moment: both must save at the same row and exit 0; every 10th is rerun to the end.
- ``coordinator``: SIGKILL process 0 of 2 while a save is in flight: how the survivor
  ends (one line, status 4?), then a rerun of both.
- ``disagree``: 2 processes started with different flags (``data.seed``, ``microbatch``,
  ``data.num_rows``, ``checkpoint.every_steps``, ``--workdir``): both must stop with status 2
  and the same one line naming the field, before anything is written.
- ``stopped``: SIGSTOP one of 2 processes at a random moment and leave it stopped past
  ``--heartbeat_timeout``: the other must end with status 4 and one line naming it, never
  JAX's fatal log and SIGABRT.
- ``early_sigterm``: SIGTERM to the CLI job at a random moment of its first 8 s (imports,
  start-up, compiling): a line and status 0 (143 only while Python itself starts), then a
  rerun bitwise equal to an uninterrupted run.
- ``inputs``: a job reading a ``.npy``, Parquet or CSV file whose file is replaced by other
  rows: while it runs, between a SIGKILL and the rerun (a new modification time), the same
  with the same size and the time put back (under ``verify_data=digest``), and after it
  finished. Every such run must stop in one line naming the file (status 2), never resume
  onto the other rows; with the original put back (``cp -p``) the rerun resumes, bitwise.
- ``result``: a finished job's ``result.npz`` truncated, replaced by another valid npz, or
  deleted: the rerun rebuilds it from the final checkpoint, bitwise, without folding a row.
- ``symlinks``: symbolic links left in a workdir (``lock.json``; ``result.npz``,
  ``summary.json``) pointing at a file of the user's: a link at the lock is one line; the
  others are replaced, never written through.

A run that ends must end with status 0 (done, or preempted and saved), 2 (usage) or 5
(storage) and at most one ``error:`` line and no traceback. Prints a tally per fault and
writes bench/results/faults.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's sharded_scan, not an installed one

import numpy as np  # noqa: E402

ROWS, FEATURES, DEVICES = 200_000, 8, 4
JOB = {"microbatch": 64, "steps_per_call": 2}  # 512 rows per step: ~390 steps
EVERY_STEPS, KEEP = 5, 2
TMP_MARK = ".orbax-checkpoint-tmp"
FAULTS = ("kill", "flip", "disk_full", "erofs", "concurrent", "set_aside", "sigterm", "coordinator", "disagree",
          "early_sigterm", "stopped", "inputs", "result", "symlinks")
ROOT_ONLY = ("disk_full", "erofs")
TIMEOUT = 300.0


# ---------------------------------------------------------------- the library job (kill, flip)


def child(workdir: str, rows: int) -> None:
    """The job: Covariance of ``rows`` fixed rows on 4 CPU devices, checkpointed under ``workdir/ck``."""
    import jax

    jax.config.update("jax_num_cpu_devices", DEVICES)
    jax.config.update("jax_platforms", "cpu")
    import sharded_scan as ss

    x = np.random.default_rng(0).normal(1.0, 2.0, size=(rows, FEATURES)).astype(np.float32)
    options = ss.CheckpointOptions(os.path.join(workdir, "ck"), every_steps=EVERY_STEPS, keep=KEEP)
    result, report = ss.run_with_report(ss.Covariance(), x, checkpoint=options, **JOB)
    np.savez(os.path.join(workdir, "result.tmp.npz"), **{k: v for k, v in result._asdict().items() if v is not None})
    os.replace(os.path.join(workdir, "result.tmp.npz"), os.path.join(workdir, "result.npz"))
    with open(os.path.join(workdir, "report.json"), "w") as f:
        json.dump(report._asdict(), f)


def env() -> dict[str, str]:
    e = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    e.pop("JAX_NUM_CPU_DEVICES", None)
    return e


def start(workdir: pathlib.Path, rows: int) -> subprocess.Popen:
    log = open(workdir / "log.txt", "a")  # noqa: SIM115 - the child holds it
    proc = subprocess.Popen(
        [sys.executable, __file__, f"--rows={rows}", "--child", str(workdir)],
        cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT,
    )
    log.close()
    return proc


def finish(workdir: pathlib.Path, rows: int, timeout: float) -> tuple[dict, dict]:
    """Runs the job to its end in ``workdir``; returns its result arrays and report."""
    proc = start(workdir, rows)
    try:
        status = proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if status != 0:
        raise RuntimeError(f"the job failed with status {status}: {(workdir / 'log.txt').read_text()[-2000:]}")
    with np.load(workdir / "result.npz") as f:
        arrays = {k: f[k] for k in f.files}
    return arrays, json.loads((workdir / "report.json").read_text())


def saving(ck: pathlib.Path) -> bool:
    """Whether a save is in flight: orbax writes into a temporary directory, then renames it."""
    return ck.is_dir() and any(TMP_MARK in p.name for p in ck.iterdir())


def complete(ck: pathlib.Path) -> list[int]:
    if not ck.is_dir():
        return []
    return sorted(int(p.name) for p in ck.iterdir() if p.name.isdigit() and (p / "commit_success.txt").exists())


def process_state(pid: int) -> str:
    """The state letter of ``/proc/PID/stat`` (``T``: stopped), or ``Z`` once the process is gone."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return "Z"


def frozen_in_save(proc: subprocess.Popen, ck: pathlib.Path) -> bool:
    """SIGSTOPs the job; True when it stopped with a save still in flight (so a kill lands inside it,
    however loaded the machine), else lets it go on (SIGCONT) and returns False."""
    proc.send_signal(signal.SIGSTOP)
    while proc.poll() is None and process_state(proc.pid) not in "TtZ":
        time.sleep(0.0005)  # SIGSTOP is delivered asynchronously: wait until the process is stopped
    if saving(ck):
        return True
    proc.send_signal(signal.SIGCONT)
    return False


def kill_once(workdir: pathlib.Path, rows: int, at: float | None, timeout: float) -> dict:
    """Starts the job and SIGKILLs it ``at`` seconds in, or (None) during a save after the first."""
    ck = workdir / "ck"
    proc = start(workdir, rows)
    began = time.monotonic()
    try:
        while proc.poll() is None and time.monotonic() - began < timeout:
            now = time.monotonic() - began
            if at is not None and now >= at:
                break
            if at is None and saving(ck) and complete(ck) and frozen_in_save(proc, ck):
                break
            time.sleep(0.001 if at is None else 0.005)
        killed_at = time.monotonic() - began
        exited_first = proc.poll() is not None
        proc.send_signal(signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return {
        "kill_after_s": round(killed_at, 3),
        "target": "save" if at is None else "random",
        "during_save": saving(ck),  # the killed save's temporary directory is still there
        "exited_before_kill": exited_first,
        "checkpoints_left": complete(ck),
    }


def saved(ck: pathlib.Path) -> int:
    """How many saves the CLI job has completed (``keep`` removes the older ones: count by cursor)."""
    return max(complete(ck), default=0) // CLI_ROWS_PER_SAVE


def same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def run_faults(
    kills: int, rows: int = ROWS, seed: int = 0, timeout: float = TIMEOUT, out: pathlib.Path | None = None
) -> dict:
    """Runs ``kills`` kill-and-rerun episodes; returns (and writes to ``out``) the tally."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="faults-") as tmp:
        base = pathlib.Path(tmp)
        (base / "reference").mkdir()
        started = time.monotonic()
        want, _ = finish(base / "reference", rows, timeout)
        duration = time.monotonic() - started
        episodes = []
        for i in range(kills):
            workdir = base / f"kill-{i}"
            workdir.mkdir()
            at = None if i % 3 == 1 else rng.uniform(0.0, duration)  # every third kill (the 2nd, 5th...) aims at a save
            episode = kill_once(workdir, rows, at, timeout)
            got, report = finish(workdir, rows, timeout)
            episode.update(
                bitwise_equal=same(got, want),
                rows_counted=int(got["count"]),
                resumed_from_cursor=report["resumed_from_cursor"],
                rows_rerun=report["rows_this_run"],
            )
            episodes.append(episode)
            print(f"kill {i + 1:2d}/{kills}: {json.dumps(episode)}", flush=True)
    tally = {
        "command": "python bench/faults.py --faults kill" + (f" --kills {kills}" if kills != 20 else "")
        + (f" --rows {rows}" if rows != ROWS else ""),
        "kills": kills,
        "bitwise_equal": sum(e["bitwise_equal"] for e in episodes),
        "rows_counted_once": sum(e["rows_counted"] == rows for e in episodes),
        "killed_during_save": sum(e["during_save"] for e in episodes),
        "resumed_from_a_checkpoint": sum(e["resumed_from_cursor"] is not None for e in episodes),
        "rows": rows,
        "uninterrupted_run_s": round(duration, 2),
        "job": {**JOB, "rows": rows, "features": FEATURES, "devices": DEVICES, "combiner": "Covariance",
                "checkpoint_every_steps": EVERY_STEPS, "keep": KEEP},
        "episodes": episodes,
    }
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(tally, indent=2) + "\n")
    return tally


def run_flips(trials: int, rng: random.Random) -> dict:
    """Flips one byte of a random file of the latest checkpoint, ``trials`` times, and resumes in process."""
    import jax

    jax.config.update("jax_num_cpu_devices", DEVICES)
    jax.config.update("jax_platforms", "cpu")
    import sharded_scan as ss

    logging.getLogger("sharded_scan.checkpoint").setLevel(logging.ERROR)
    x = np.random.default_rng(0).normal(1.0, 2.0, size=(20_000, 32)).astype(np.float32)
    kw = dict(JOB, mesh=f"data:{DEVICES}")
    want = ss.run(ss.Gram(), x, **kw)

    def stop_at_step_9(p):
        if p.step == 9:
            raise KeyboardInterrupt

    counts = {"set_aside": 0, "no_effect": 0, "refused_in_one_line": 0, "silent_wrong": 0}
    episodes = []
    with tempfile.TemporaryDirectory(prefix="flips-") as tmp:
        original = pathlib.Path(tmp) / "original"
        with contextlib.suppress(KeyboardInterrupt):
            ss.run(ss.Gram(), x, checkpoint=ss.CheckpointOptions(str(original), every_steps=4, keep=3),
                   progress=stop_at_step_9, **kw)
        latest = max(complete(original))
        for i in range(trials):
            directory = pathlib.Path(tmp) / f"flip-{i}"
            shutil.copytree(original, directory)
            files = sorted(p for p in (directory / str(latest)).rglob("*") if p.is_file() and p.stat().st_size)
            victim = rng.choice(files)
            data = bytearray(victim.read_bytes())
            offset = rng.randrange(len(data))
            data[offset] ^= rng.randrange(1, 256)
            victim.write_bytes(bytes(data))
            where = str(victim.relative_to(directory / str(latest)))
            try:
                got, report = ss.run_with_report(ss.Gram(), x, checkpoint=str(directory), **kw)
            except ss.UsageError as e:
                outcome, detail = "refused_in_one_line", str(e)[:160]
            else:
                aside = (directory / "damaged").is_dir() and any((directory / "damaged").iterdir())
                outcome = ("set_aside" if aside else "no_effect") if np.array_equal(got, want) else "silent_wrong"
                detail = f"resumed from {report.resumed_from_cursor}"
            counts[outcome] += 1
            episodes.append({"file": re.sub(r"[0-9a-f]{32}", "<hash>", where), "offset": offset, "outcome": outcome,
                             "detail": detail})
            print(f"flip {i + 1:2d}/{trials}: {json.dumps(episodes[-1])}", flush=True)
            shutil.rmtree(directory)
    return {"trials": trials, **counts, "checkpoint": latest, "job": "Gram of 20000 x 32 float32, 4 devices",
            "episodes": episodes}


# ---------------------------------------------------------------- the CLI job (storage, leases, processes)

CLI_JOB = (
    "--config=configs/covariance.py:quick", "--config.data.num_rows=300000", "--config.data.features=64",
    "--config.microbatch=64", "--config.steps_per_call=2", "--config.checkpoint.every_steps=10",
    "--config.checkpoint.per_job=100000", "--config.log_every_seconds=600",
)
CLI_ROWS_PER_SAVE = 10 * 64 * 2 * DEVICES
MULTI_JOB = (
    "--config=configs/gram.py:quick", "--config.data.num_rows=1000000", "--config.microbatch=256",
    "--config.steps_per_call=4", "--config.checkpoint.per_job=100000", "--config.log_every_seconds=600",
    "--heartbeat_timeout=10",
)


def cli_cmd(workdir: pathlib.Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "launch.main", *CLI_JOB, f"--workdir={workdir}", *extra,
            f"--jax_num_cpu_devices={DEVICES}", "--jax_platforms=cpu"]


def launch(cmd: list[str], log: pathlib.Path) -> subprocess.Popen:
    with open(log, "a") as f:
        return subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def ended(proc: subprocess.Popen, log: pathlib.Path, timeout: float = TIMEOUT) -> dict:
    """How a process ended: its status, its ``error:`` lines, whether a traceback was printed."""
    try:
        status = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        status = proc.wait()
    text = log.read_text(errors="replace")
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    return {"status": status, "error": errors[-1][:300] if errors else None,
            "one_line": len(errors) <= 1 and "Traceback" not in text and "Fatal Python error" not in text}


def cli_result(workdir: pathlib.Path, timeout: float = TIMEOUT, cmd: list[str] | None = None) -> tuple[dict, dict]:
    """Reruns the CLI job (or ``cmd``) in ``workdir`` to its end; its result arrays and summary."""
    log = workdir.parent / f"{workdir.name}-rerun.log"
    end = ended(launch(cmd or cli_cmd(workdir), log), log, timeout)
    if end["status"] != 0:
        raise RuntimeError(f"the rerun failed: {end} {log.read_text()[-2000:]}")
    with np.load(workdir / "result.npz") as f:
        arrays = {k: f[k] for k in f.files}
    return arrays, json.loads((workdir / "summary.json").read_text())


@contextlib.contextmanager
def tmpfs(path: pathlib.Path, size: str = "64m"):
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def remount(path: pathlib.Path, options: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while subprocess.run(["mount", "-o", f"remount,{options}", str(path)], capture_output=True).returncode:
        if time.monotonic() > deadline:
            raise RuntimeError(f"cannot remount {path} {options}")
        time.sleep(0.01)


def fill(disk: pathlib.Path) -> pathlib.Path:
    """Writes zeros into ``disk`` until it is full; returns the filler file."""
    filler = disk / "filler"
    for chunk in (1 << 20, 4096):
        with open(filler, "ab", buffering=0) as f, contextlib.suppress(OSError):
            while f.write(bytes(chunk)) == chunk:
                pass
    return filler


def wait_for(predicate, proc: subprocess.Popen, timeout: float = TIMEOUT, poll: float = 0.002) -> bool:
    """Waits until ``predicate()``; False when ``proc`` ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(poll)
    return False


def storage_episode(base: pathlib.Path, i: int, kind: str, rng: random.Random, want: dict) -> dict:
    """One disk-full or read-only episode on a fresh tmpfs; then the storage is fixed and the job rerun."""
    with tmpfs(base / f"{kind}-{i}") as disk:
        workdir, log = disk / "w", base / f"{kind}-{i}.log"
        ck = workdir / "checkpoints"
        proc = launch(cli_cmd(workdir), log)
        when, k, filler = rng.choice(["after_save", "during_save"]), rng.randint(1, 5), None
        if kind == "erofs":
            wait_for(lambda: len(complete(ck)) >= 1, proc)
            time.sleep(rng.uniform(0.0, 3.0))
            if proc.poll() is None:
                remount(disk, "ro")
        elif wait_for(lambda: saved(ck) >= k + (when == "during_save") or
                      saved(ck) >= k and when == "during_save" and saving(ck), proc, poll=0.0005):
            when = "during_save" if saving(ck) else "after_save"
            filler = fill(disk)
        end = ended(proc, log)
        if kind == "erofs":
            remount(disk, "rw")
        elif filler is not None:
            filler.unlink()
        got, summary = cli_result(workdir)
        episode = {"kind": kind, "fill": None if kind == "erofs" else f"{when} {k}", **end,
                   "resumed_from_cursor": summary.get("resumed_from_cursor"), "bitwise_equal": same(got, want)}
        return episode


def concurrent_episode(base: pathlib.Path, i: int, rng: random.Random, want: dict) -> dict:
    workdir = base / f"concurrent-{i}"
    first_log = base / f"concurrent-{i}.log"
    first = launch(cli_cmd(workdir), first_log)
    wait_for(lambda: (workdir / "lock.json").exists(), first, poll=0.01)
    time.sleep(rng.uniform(0.0, 2.0))
    seconds = []
    for j, extra in enumerate([(), ("--config.data.seed=1",)]):  # the same command, then another job
        log = base / f"concurrent-{i}-second-{j}.log"
        seconds.append(ended(launch(cli_cmd(workdir, *extra), log), log, 120))
    end = ended(first, first_log)
    with np.load(workdir / "result.npz") as f:
        got = {k: f[k] for k in f.files}
    refused = [s["status"] == 2 and s["one_line"] and s["error"] is not None and "is in use by pid" in s["error"]
               for s in seconds]
    return {"kind": "concurrent", **end, "second_same_job": seconds[0], "second_other_job": seconds[1],
            "seconds_refused": sum(refused), "bitwise_equal": end["status"] == 0 and same(got, want)}


# What process 1 of 2 is given otherwise, and the field its line must name.
DISAGREEMENTS = (
    ("--config.data.seed=7", "data.seed"), ("--config.microbatch=128", "microbatch"),
    ("--config.data.num_rows=999999", "data.num_rows"), ("--config.checkpoint.every_steps=3", "checkpoint.every_steps"),
    ("--workdir={other}", "workdir"),
)


def disagree_episode(base: pathlib.Path, i: int, flag: str, field: str) -> dict:
    workdir, other = base / f"disagree-{i}", base / f"disagree-{i}-other"
    cmds = multi_cmds(workdir)
    cmds[1].append(flag.format(other=other))
    logs = [base / f"disagree-{i}-p{j}.log" for j in range(2)]
    ends = [ended(p, log, 120) for p, log in zip([launch(c, log) for c, log in zip(cmds, logs, strict=True)], logs,
                                                    strict=True)]
    line = f"error: processes disagree on the job: {field} differs (process 0: "
    return {"kind": "disagree", "field": field, "statuses": [e["status"] for e in ends], "error": ends[0]["error"],
            "status_2_one_line": all(e["status"] == 2 and e["one_line"] for e in ends),
            "field_named": ends[0]["error"] == ends[1]["error"] and (ends[0]["error"] or "").startswith(line),
            "nothing_written": not workdir.exists() and not other.exists()}


def stopped_episode(base: pathlib.Path, i: int, rng: random.Random) -> dict:
    workdir = base / f"stopped-{i}"
    procs, logs = multi_run(workdir, "p", "--step_timeout=600")
    target = rng.randrange(2)
    try:
        wait_for(lambda: (workdir / "lock.json").exists(), procs[0], poll=0.01)
        time.sleep(rng.uniform(0.3, 3.0))
        procs[target].send_signal(signal.SIGSTOP)
        survivor = ended(procs[1 - target], logs[1 - target], 120)
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGCONT)
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    text, error = logs[1 - target].read_text(errors="replace"), survivor["error"] or ""
    named = f"process {target} gave no sign of life" in error or "the coordinator (process 0) has not answered" in error
    return {"kind": "stopped", "target": target, **survivor, "jax_abort": "Terminating process" in text,
            "status_4_one_line_named": survivor["status"] == 4 and survivor["one_line"] and named
            and "Terminating process" not in text}


def early_sigterm_episode(base: pathlib.Path, i: int, rng: random.Random, want: dict) -> dict:
    workdir, log = base / f"early-sigterm-{i}", base / f"early-sigterm-{i}.log"
    proc = launch(cli_cmd(workdir), log)
    at = rng.uniform(0.3, 8.0)
    time.sleep(at)
    proc.send_signal(signal.SIGTERM)
    end = ended(proc, log, 120)
    text = log.read_text(errors="replace")
    said = ("before the first step" if "preempted (SIGTERM) before the first step" in text else
            "saved" if "preempted: saved a checkpoint" in text else "done" if "done:" in text else None)
    return {"kind": "early_sigterm", "at": round(at, 2), **end, "said": said,
            "line_and_status_0": end["status"] == 0 and end["one_line"] and said is not None,
            "bitwise_equal": same(cli_result(workdir)[0], want)}


def set_aside_episode(base: pathlib.Path, i: int, rng: random.Random, want: dict) -> dict:
    """A killed job's latest checkpoint damaged; its rerun SIGKILLed just before or after the set-aside."""
    workdir = base / f"set_aside-{i}"
    ck = workdir / "checkpoints"
    log = base / f"set_aside-{i}.log"
    proc = launch(cli_cmd(workdir), log)
    wait_for(lambda: saved(ck) >= 2 and not saving(ck), proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    latest = max(complete(ck))
    (ck / str(latest) / "commit_success.txt").unlink()  # damaged: the rerun must set it aside
    moment = rng.choice(["before", "after"])
    killed_log = base / f"set_aside-{i}-killed.log"
    cmd = [sys.executable, __file__, f"--kill-in-set-aside={moment}", "--", *cli_cmd(workdir)[3:]]
    killed = ended(launch(cmd, killed_log), killed_log)
    moved = (ck / "damaged").is_dir() and any((ck / "damaged").iterdir())
    got, summary = cli_result(workdir)
    return {"kind": "set_aside", "moment": moment, "killed_status": killed["status"], "moved_before_rerun": moved,
            "damaged": latest, "resumed_from_cursor": summary.get("resumed_from_cursor"),
            "bitwise_equal": same(got, want)}


def kill_in_set_aside(moment: str, argv: list[str]) -> None:
    """Runs ``launch.main argv`` with a SIGKILL just before or after the set-aside's move."""
    import runpy

    from sharded_scan import fs

    def replace(src, dst):
        if moment == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        os.replace(src, dst)
        os.kill(os.getpid(), signal.SIGKILL)

    sys.argv = ["launch.main", *argv]
    with fs.replaced(replace=replace):
        runpy.run_module("launch.main", run_name="__main__", alter_sys=True)


def multi_cmds(workdir: pathlib.Path, *extra: str) -> list[list[str]]:
    from launch.processes import commands, free_port

    return commands([*MULTI_JOB, f"--workdir={workdir}", *extra], 2, 2, free_port())


def multi_run(workdir: pathlib.Path, logs: str, *extra: str) -> tuple[list[subprocess.Popen], list[pathlib.Path]]:
    paths = [workdir.parent / f"{workdir.name}-{logs}{j}.log" for j in range(2)]
    return [launch(cmd, p) for cmd, p in zip(multi_cmds(workdir, *extra), paths, strict=True)], paths


def multi_result(workdir: pathlib.Path) -> dict:
    procs, logs = multi_run(workdir, "rerun")
    ends = [ended(p, log) for p, log in zip(procs, logs, strict=True)]
    if any(e["status"] != 0 for e in ends):
        raise RuntimeError(f"the rerun failed: {ends}")
    with np.load(workdir / "result.npz") as f:
        return {k: f[k] for k in f.files}


@contextlib.contextmanager
def cpu_load(processes: int = 2):
    """Busy processes competing for the cores, as other jobs on a shared host would."""
    hogs = [subprocess.Popen(["nice", "-n", "5", sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def sigterm_episode(base: pathlib.Path, i: int, rng: random.Random, want: dict | None) -> dict:
    workdir = base / f"sigterm-{i}"
    procs, logs = multi_run(workdir, "p")
    try:
        wait_for(lambda: (workdir / "lock.json").exists(), procs[0], poll=0.01)
        time.sleep(rng.uniform(0.3, 3.0))
        target = rng.randrange(2)
        signalled = time.monotonic()
        procs[target].send_signal(signal.SIGTERM)
        ends = [ended(p, log, 120) for p, log in zip(procs, logs, strict=True)]
        took = time.monotonic() - signalled
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    rows = []
    for log in logs:
        found = re.findall(r"preempted: saved a checkpoint at row (\d+)", log.read_text())
        rows.append(int(found[-1]) if found else None)
    saved = rows[0] is not None and rows[0] == rows[1] and (workdir / "checkpoints" / str(rows[0])).is_dir()
    episode = {"kind": "sigterm", "target": target, "statuses": [e["status"] for e in ends], "rows": rows,
               "saved_and_exit_0": saved and all(e["status"] == 0 for e in ends), "seconds": round(took, 2)}
    if want is not None:
        episode["bitwise_equal"] = same(multi_result(workdir), want)
    return episode


def coordinator_episode(base: pathlib.Path, i: int, want: dict) -> dict:
    workdir = base / f"coordinator-{i}"
    ck = workdir / "checkpoints"
    procs, logs = multi_run(workdir, "p", "--config.checkpoint.every_steps=1")
    try:
        wait_for(lambda: len(complete(ck)) >= 1 and saving(ck), procs[0], poll=0.001)
        procs[0].send_signal(signal.SIGKILL)
        survivor = ended(procs[1], logs[1], 120)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    text = logs[1].read_text(errors="replace")
    tail = [line[:200] for line in text.splitlines() if line[:1] in "EFe" and not line.startswith("I")][-3:]
    return {"kind": "coordinator", "survivor": survivor, "survivor_aborted": "Fatal Python error" in text
            or survivor["status"] in (-6, 134), "survivor_tail": tail,
            "bitwise_equal": same(multi_result(workdir), want)}


# ---------------------------------------------------------------- input files, results, links

INPUT_KINDS, INPUT_CASES = ("npy", "parquet", "csv"), ("mid_run", "between", "same_size", "finished")
INPUT_ROWS = 100_000  # x 8 float32 columns, 512 rows a step: ~200 steps, a save every 10


def write_input(kind: str, path: pathlib.Path, x: np.ndarray) -> None:
    """``x`` as a ``kind`` file (Parquet plain and uncompressed: the same values in another order, the same bytes)."""
    if kind == "npy":
        np.save(path, x)
        return
    import pandas as pd

    frame = pd.DataFrame(x, columns=[f"c{j}" for j in range(x.shape[1])])
    if kind == "parquet":
        frame.to_parquet(path, row_group_size=4096, compression=None, use_dictionary=False)
    else:
        frame.to_csv(path, index=False)


def input_rows(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(1.0, 2.0, size=(INPUT_ROWS, FEATURES)).astype(np.float32)


def input_cmd(workdir: pathlib.Path, kind: str, path: pathlib.Path, *extra: str) -> list[str]:
    dtype = () if kind == "npy" else ("--config.data.dtype=float32",)
    return [sys.executable, "-m", "launch.main", "--config=configs/covariance.py:quick", f"--config.data.kind={kind}",
            f"--config.data.path={path}", *dtype, "--config.microbatch=64", "--config.steps_per_call=2",
            "--config.checkpoint.every_steps=10", "--config.checkpoint.per_job=100000",
            "--config.log_every_seconds=600", f"--workdir={workdir}", *extra, f"--jax_num_cpu_devices={DEVICES}",
            "--jax_platforms=cpu"]


def replace_input(kind: str, path: pathlib.Path, rng: random.Random, others: dict, same_size: bool = False) -> str:
    """Other rows at ``path``, copied from files written beforehand (so the change is instant): in
    place or renamed over it, or (``same_size``) its rows in reverse order with its size and
    modification time put back; returns how."""
    before = path.stat()
    if same_size:
        shutil.copyfile(others[kind, "reversed"], path)
        assert path.stat().st_size == before.st_size, (kind, path.stat().st_size, before.st_size)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        return "same size and time"
    if rng.random() < 0.5:
        shutil.copyfile(others[kind, "other"], path)
        return "rewritten"
    fresh = path.with_name(f"new-{path.name}")
    shutil.copyfile(others[kind, "other"], fresh)
    os.replace(fresh, path)
    return "renamed over"


def other_inputs(kind: str, original: pathlib.Path) -> dict:
    """The replacements of ``original``: other rows, and its rows reversed (the same size)."""
    other, reversed_ = original.with_name(f"other.{kind}"), original.with_name(f"reversed.{kind}")
    write_input(kind, other, input_rows(1))
    if kind == "csv":
        lines = original.read_text().splitlines(keepends=True)
        reversed_.write_text(lines[0] + "".join(reversed(lines[1:])))
    else:
        write_input(kind, reversed_, input_rows(0)[::-1].copy())
    return {(kind, "other"): other, (kind, "reversed"): reversed_}


def input_episode(base: pathlib.Path, i: int, kind: str, case: str, rng: random.Random, originals: dict,
                  others: dict, wants: dict) -> dict:
    """One replaced input: the run that meets it must stop in one line naming the file; with the
    original back (``cp -p``) the same command resumes (or is already done) and is bitwise right."""
    name = f"inputs-{kind}-{case}-{i}"
    workdir, data, log = base / name, base / f"{name}.{kind}", base / f"{name}.log"
    shutil.copy2(originals[kind], data)
    cmd = input_cmd(workdir, kind, data, *(("--config.checkpoint.verify_data=digest",) if case == "same_size" else ()))
    proc = launch(cmd, log)
    how, finished_first = None, False
    if case == "finished":
        first = ended(proc, log)
    else:
        wait_for(lambda: len(complete(workdir / "checkpoints")) >= 1, proc, poll=0.001)
        if case == "mid_run":
            finished_first = proc.poll() is not None  # too late to change anything under it
            how = replace_input(kind, data, rng, others)
            first = ended(proc, log)
        else:
            os.killpg(proc.pid, signal.SIGKILL)
            first = {"status": proc.wait()}
    if case != "mid_run":
        how = replace_input(kind, data, rng, others, same_size=case == "same_size")
        log = base / f"{name}-changed.log"
        first = ended(launch(cmd, log), log)
    named = first["error"] is not None and data.name in first["error"]
    shutil.copy2(originals[kind], data)  # the original back, with its time
    got, summary = cli_result(workdir, cmd=cmd)
    return {"kind": kind, "case": case, "how": how, "finished_first": finished_first, "status": first["status"],
            "error": first["error"],
            "one_line_named": first["status"] == 2 and first["one_line"] and named,
            "resumed_from_cursor": summary.get("resumed_from_cursor"), "bitwise_equal": same(got, wants[kind])}


def result_episode(base: pathlib.Path, i: int, damage: str, original: pathlib.Path, want: dict) -> dict:
    """A finished job's result.npz damaged; the rerun must rebuild it from the final checkpoint."""
    workdir = base / f"result-{damage}-{i}"
    cmd = input_cmd(workdir, "npy", original)
    cli_result(workdir, cmd=cmd)
    result = workdir / "result.npz"
    if damage == "truncated":
        result.write_bytes(result.read_bytes()[: result.stat().st_size // 2])
    elif damage == "another_result":
        np.savez(result, **{k: np.zeros_like(v) for k, v in want.items()})
    else:
        result.unlink()
    got, summary = cli_result(workdir, cmd=cmd)
    return {"kind": "result", "damage": damage, "rebuilt_without_folding": summary["rows_this_run"] == 0,
            "bitwise_equal": same(got, want)}


def symlink_episode(base: pathlib.Path, i: int, original: pathlib.Path, want: dict) -> dict:
    """Links to the user's own file left at the workdir's names: never written through."""
    workdir, log = base / f"symlinks-{i}", base / f"symlinks-{i}.log"
    victim = base / f"victim-{i}.txt"
    victim.write_text("the user's own file")
    workdir.mkdir()
    (workdir / "lock.json").symlink_to(victim)
    cmd = input_cmd(workdir, "npy", original)
    lock = ended(launch(cmd, log), log)
    (workdir / "lock.json").unlink()
    for name in ("result.npz", "summary.json", "result.npz.tmp", "summary.json.tmp"):
        (workdir / name).symlink_to(victim)
    got, _ = cli_result(workdir, cmd=cmd)
    return {"kind": "symlinks", "lock_status": lock["status"], "lock_error": lock["error"],
            "lock_one_line": lock["status"] == 2 and lock["one_line"] and "symbolic link" in (lock["error"] or ""),
            "victim_untouched": victim.read_text() == "the user's own file",
            "outputs_not_links": not any((workdir / n).is_symlink() for n in ("result.npz", "summary.json")),
            "bitwise_equal": same(got, want)}


def run_input_faults(faults: list[str], trials: int, rng: random.Random) -> dict:
    """The input, result and symlink faults; one tally per fault."""
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="input-faults-") as tmp:
        base = pathlib.Path(tmp)
        kinds = INPUT_KINDS if "inputs" in faults else ("npy",)
        originals, others, wants = {}, {}, {}
        for kind in kinds:
            originals[kind] = base / f"original.{kind}"
            write_input(kind, originals[kind], input_rows(0))
            others.update(other_inputs(kind, originals[kind]))
            wants[kind], _ = cli_result(base / f"reference-{kind}", cmd=input_cmd(base / f"reference-{kind}", kind,
                                                                                     originals[kind]))
        if "inputs" in faults:
            episodes = [input_episode(base, i, kind, case, rng, originals, others, wants)
                        for i in range(trials) for kind in INPUT_KINDS for case in INPUT_CASES]
            for e in episodes:
                print(f"inputs: {json.dumps(e)}", flush=True)
            out["inputs"] = {"trials": len(episodes),
                             "one_line_named": sum(e["one_line_named"] for e in episodes),
                             "job_finished_before_the_change": sum(e["finished_first"] for e in episodes),
                             "resumed_after_the_original_was_back": sum(e["resumed_from_cursor"] is not None
                                                                        for e in episodes if e["case"] != "finished"),
                             "bitwise_equal": sum(e["bitwise_equal"] for e in episodes),
                             "by_case": {f"{k} {c}": sum(e["one_line_named"] for e in episodes
                                                         if (e["kind"], e["case"]) == (k, c))
                                         for k in INPUT_KINDS for c in INPUT_CASES},
                             "episodes": episodes}
        if "result" in faults:
            episodes = [result_episode(base, i, damage, originals["npy"], wants["npy"])
                        for i in range(trials) for damage in ("truncated", "another_result", "deleted")]
            for e in episodes:
                print(f"result: {json.dumps(e)}", flush=True)
            out["result"] = {"trials": len(episodes),
                             "rebuilt_without_folding": sum(e["rebuilt_without_folding"] for e in episodes),
                             "bitwise_equal": sum(e["bitwise_equal"] for e in episodes), "episodes": episodes}
        if "symlinks" in faults:
            episodes = [symlink_episode(base, i, originals["npy"], wants["npy"]) for i in range(trials)]
            for e in episodes:
                print(f"symlinks: {json.dumps(e)}", flush=True)
            out["symlinks"] = {"trials": trials, "lock_one_line": sum(e["lock_one_line"] for e in episodes),
                               "victim_untouched": sum(e["victim_untouched"] for e in episodes),
                               "outputs_not_links": sum(e["outputs_not_links"] for e in episodes),
                               "bitwise_equal": sum(e["bitwise_equal"] for e in episodes), "episodes": episodes}
    return out


def run_cli_faults(faults: list[str], trials: int, sigterms: int, coordinators: int, rng: random.Random) -> dict:
    """Every fault of the CLI job; returns one tally per fault."""
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="cli-faults-") as tmp:
        base = pathlib.Path(tmp)
        want = None
        if set(faults) & {"disk_full", "erofs", "concurrent", "set_aside", "early_sigterm"}:
            want, _ = cli_result(base / "reference")
        for kind in ("disk_full", "erofs"):
            if kind in faults and os.geteuid() != 0:
                out[kind] = {"skipped": "mounting a tmpfs needs root"}
            elif kind in faults:
                episodes = [storage_episode(base, i, kind, rng, want) for i in range(trials)]
                for e in episodes:
                    print(f"{kind}: {json.dumps(e)}", flush=True)
                out[kind] = {"trials": trials, "status_5": sum(e["status"] == 5 for e in episodes),
                             "status_5_or_0": sum(e["status"] in (0, 5) for e in episodes),
                             "one_line": sum(e["one_line"] for e in episodes),
                             "resumed": sum(e["resumed_from_cursor"] is not None for e in episodes),
                             "bitwise_equal": sum(e["bitwise_equal"] for e in episodes), "episodes": episodes}
        if "concurrent" in faults:
            episodes = [concurrent_episode(base, i, rng, want) for i in range(trials)]
            for e in episodes:
                print(f"concurrent: {json.dumps(e)}", flush=True)
            out["concurrent"] = {"trials": trials, "second_jobs_refused": sum(e["seconds_refused"] for e in episodes),
                                 "second_jobs": 2 * trials, "first_bitwise_equal": sum(e["bitwise_equal"]
                                                                                       for e in episodes),
                                 "episodes": episodes}
        if "set_aside" in faults:
            episodes = [set_aside_episode(base, i, rng, want) for i in range(trials)]
            for e in episodes:
                print(f"set_aside: {json.dumps(e)}", flush=True)
            out["set_aside"] = {"trials": trials, "killed": sum(e["killed_status"] == -9 for e in episodes),
                                "bitwise_equal": sum(e["bitwise_equal"] for e in episodes), "episodes": episodes}
        if "early_sigterm" in faults:
            episodes = [early_sigterm_episode(base, i, rng, want) for i in range(trials)]
            for e in episodes:
                print(f"early_sigterm: {json.dumps(e)}", flush=True)
            out["early_sigterm"] = {
                "trials": trials, "line_and_status_0": sum(e["line_and_status_0"] for e in episodes),
                "python_start_143": sum(e["status"] == 143 for e in episodes),
                "said": {w: sum(e["said"] == w for e in episodes) for w in ("before the first step", "saved", "done")},
                "bitwise_equal": sum(e["bitwise_equal"] for e in episodes), "episodes": episodes}
        if "stopped" in faults:
            episodes = [stopped_episode(base, i, rng) for i in range(trials)]
            for e in episodes:
                print(f"stopped: {json.dumps(e)}", flush=True)
            out["stopped"] = {"trials": trials, "jax_abort": sum(e["jax_abort"] for e in episodes),
                              "status_4_one_line_named": sum(e["status_4_one_line_named"] for e in episodes),
                              "episodes": episodes}
        if "disagree" in faults:
            episodes = [disagree_episode(base, i, flag, field) for i, (flag, field) in enumerate(DISAGREEMENTS)]
            for e in episodes:
                print(f"disagree: {json.dumps(e)}", flush=True)
            out["disagree"] = {"trials": len(episodes), **{k: sum(e[k] for e in episodes) for k in (
                "status_2_one_line", "field_named", "nothing_written")}, "episodes": episodes}
        if set(faults) & {"sigterm", "coordinator"}:
            procs, logs = multi_run(base / "reference-2x2", "p")
            if any(ended(p, log)["status"] for p, log in zip(procs, logs, strict=True)):
                raise RuntimeError("the 2-process reference failed")
            with np.load(base / "reference-2x2" / "result.npz") as f:
                want2 = {k: f[k] for k in f.files}
        if "sigterm" in faults:
            with cpu_load():
                episodes = [sigterm_episode(base, i, rng, want2 if i % 10 == 9 else None) for i in range(sigterms)]
            for e in episodes:
                print(f"sigterm: {json.dumps(e)}", flush=True)
            out["sigterm"] = {"trials": sigterms, "saved_and_exit_0": sum(e["saved_and_exit_0"] for e in episodes),
                              "reruns_bitwise_equal": sum(e.get("bitwise_equal", False) for e in episodes),
                              "reruns": sum("bitwise_equal" in e for e in episodes),
                              "seconds_max": max(e["seconds"] for e in episodes), "episodes": episodes}
        if "coordinator" in faults:
            episodes = [coordinator_episode(base, i, want2) for i in range(coordinators)]
            for e in episodes:
                print(f"coordinator: {json.dumps(e)}", flush=True)
            out["coordinator"] = {
                "trials": coordinators,
                "survivor_one_line_status_4": sum(e["survivor"]["status"] == 4 and e["survivor"]["one_line"]
                                                  for e in episodes),
                "survivor_aborted": sum(e["survivor_aborted"] for e in episodes),
                "bitwise_equal": sum(e["bitwise_equal"] for e in episodes), "episodes": episodes}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    parser.add_argument("--kills", type=int, default=20, help="kill-and-rerun episodes")
    parser.add_argument("--flips", type=int, default=60, help="flipped-byte restores")
    parser.add_argument("--trials", type=int, default=6,
                        help="episodes of each storage, lease and set-aside fault, input kind x case, result damage, "
                        "and of symlinks")
    parser.add_argument("--sigterms", type=int, default=50, help="SIGTERMs to one of 2 processes under load")
    parser.add_argument("--coordinators", type=int, default=10, help="SIGKILLs of process 0 during a save")
    parser.add_argument("--rows", type=int, default=ROWS, help="rows of the kill job (512 per step)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random moments")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results" / "faults.json")
    parser.add_argument("--child", metavar="WORKDIR", help=argparse.SUPPRESS)
    parser.add_argument("--kill-in-set-aside", choices=("before", "after"), help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.child:
        child(args.child, args.rows)
        return
    if args.kill_in_set_aside:
        kill_in_set_aside(args.kill_in_set_aside, [a for a in rest if a != "--"])
        return
    faults = [f for f in args.faults.split(",") if f]
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        parser.error(f"unknown faults {unknown}; pick from {', '.join(FAULTS)}")
    rng = random.Random(args.seed)
    tally: dict = {"command": " ".join(["python bench/faults.py", *sys.argv[1:]])}
    ok = True
    if "kill" in faults:
        kills = run_faults(args.kills, args.rows, args.seed)
        tally.update({**kills, "command": tally["command"]})
        ok &= kills["bitwise_equal"] == kills["rows_counted_once"] == kills["kills"]
        print(f"bitwise equal {kills['bitwise_equal']}/{kills['kills']}; every row counted once "
              f"{kills['rows_counted_once']}/{kills['kills']}; killed during a save {kills['killed_during_save']}; "
              f"resumed from a checkpoint {kills['resumed_from_a_checkpoint']}/{kills['kills']}", flush=True)
    others = {}
    if "flip" in faults:
        others["flip"] = run_flips(args.flips, rng)
        ok &= others["flip"]["silent_wrong"] == 0
    others.update(run_cli_faults(faults, args.trials, args.sigterms, args.coordinators, rng))
    if set(faults) & {"inputs", "result", "symlinks"}:
        others.update(run_input_faults(faults, args.trials, rng))
    if others:
        tally["faults"] = others
    for name, t in others.items():
        print(f"{name}: {json.dumps({k: v for k, v in t.items() if k != 'episodes'})}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(tally, indent=2) + "\n")
    print(f"wrote {args.out}")
    sys.exit(0 if ok and all(_passed(name, t) for name, t in others.items()) else 1)


def _passed(name: str, t: dict) -> bool:
    """Whether every episode of a fault ended as promised."""
    if "skipped" in t:
        return True
    n = t["trials"]
    return {
        "flip": t.get("silent_wrong") == 0,
        "disk_full": t.get("status_5_or_0") == t.get("one_line") == t.get("bitwise_equal") == n,
        "erofs": t.get("status_5_or_0") == t.get("one_line") == t.get("bitwise_equal") == n,
        "concurrent": t.get("second_jobs_refused") == 2 * n and t.get("first_bitwise_equal") == n,
        "set_aside": t.get("bitwise_equal") == n,
        "sigterm": t.get("saved_and_exit_0") == n and t.get("reruns_bitwise_equal") == t.get("reruns"),
        "coordinator": t.get("bitwise_equal") == n,
        "stopped": t.get("status_4_one_line_named") == n,
        "disagree": t.get("status_2_one_line") == t.get("field_named") == t.get("nothing_written") == n,
        "early_sigterm": t.get("line_and_status_0", 0) + t.get("python_start_143", 0) == t.get("bitwise_equal") == n,
        "inputs": t.get("one_line_named") == t.get("bitwise_equal") == n,
        "result": t.get("rebuilt_without_folding") == t.get("bitwise_equal") == n,
        "symlinks": t.get("lock_one_line") == t.get("victim_untouched") == t.get("outputs_not_links")
        == t.get("bitwise_equal") == n,
    }[name]


if __name__ == "__main__":
    main()
