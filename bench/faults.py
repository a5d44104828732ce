"""Kill anywhere: SIGKILL a checkpointed job at random moments, rerun it, compare bitwise.

    python bench/faults.py               # 20 kills, a third of them while a save is in flight
    python bench/faults.py --kills 3 --rows 40000   # what tests/test_faults.py runs

Each kill is one episode in a fresh directory: start the job (a child process running
``sharded_scan.run`` with a checkpoint every few steps), SIGKILL it at a random moment
of its run (or the moment a checkpoint's temporary directory appears, for the "save"
episodes), rerun the same job to the end and compare its result with an uninterrupted
run's: bitwise, and the row count must equal the dataset's (every row counted once).
Prints the tally and writes bench/results/faults.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
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


def child(workdir: str, rows: int) -> None:
    """The job: Covariance of ``rows`` fixed rows on 4 CPU devices, checkpointed under ``workdir/ck``."""
    import jax

    jax.config.update("jax_num_cpu_devices", DEVICES)
    jax.config.update("jax_platforms", "cpu")
    import sharded_scan as ss

    x = np.random.default_rng(0).normal(1.0, 2.0, size=(rows, FEATURES)).astype(np.float32)
    options = ss.CheckpointOptions(os.path.join(workdir, "ck"), every_steps=EVERY_STEPS, keep=KEEP)
    result, report = ss.run_with_report(ss.Covariance(), x, checkpoint=options, **JOB)
    np.savez(os.path.join(workdir, "result.tmp.npz"), **result._asdict())
    os.replace(os.path.join(workdir, "result.tmp.npz"), os.path.join(workdir, "result.npz"))
    with open(os.path.join(workdir, "report.json"), "w") as f:
        json.dump(report._asdict(), f)


def start(workdir: pathlib.Path, rows: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env.pop("JAX_NUM_CPU_DEVICES", None)
    log = open(workdir / "log.txt", "a")  # noqa: SIM115 - the child holds it
    proc = subprocess.Popen(
        [sys.executable, __file__, f"--rows={rows}", "--child", str(workdir)],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
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
    return sorted(int(p.name) for p in ck.iterdir() if p.name.isdigit()) if ck.is_dir() else []


def kill_once(workdir: pathlib.Path, rows: int, at: float | None, timeout: float) -> dict:
    """Starts the job and SIGKILLs it ``at`` seconds in, or (None) during a save after the first."""
    ck = workdir / "ck"
    proc = start(workdir, rows)
    began = time.monotonic()
    try:
        while proc.poll() is None and time.monotonic() - began < timeout:
            now = time.monotonic() - began
            if (at is not None and now >= at) or (at is None and saving(ck) and complete(ck)):
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


def same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def run_faults(
    kills: int, rows: int = ROWS, seed: int = 0, timeout: float = 300.0, out: pathlib.Path | None = None
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
            at = None if i % 3 == 2 else rng.uniform(0.0, duration)  # every third kill aims at a save
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
        "command": "python bench/faults.py" + (f" --kills {kills}" if kills != 20 else "")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20, help="kill-and-rerun episodes")
    parser.add_argument("--rows", type=int, default=ROWS, help="rows of the job (512 per step)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random kill moments")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results" / "faults.json")
    parser.add_argument("--child", metavar="WORKDIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.rows)
        return
    t = run_faults(args.kills, args.rows, args.seed, out=args.out)
    print(
        f"bitwise equal {t['bitwise_equal']}/{t['kills']}; every row counted once {t['rows_counted_once']}/"
        f"{t['kills']}; killed during a save {t['killed_during_save']}; resumed from a checkpoint "
        f"{t['resumed_from_a_checkpoint']}/{t['kills']}; wrote {args.out}"
    )
    sys.exit(0 if t["bitwise_equal"] == t["rows_counted_once"] == t["kills"] else 1)


if __name__ == "__main__":
    main()
