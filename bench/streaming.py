"""Does prefetching overlap reading with compute? One table from one run.

    python -m bench.streaming            # full: a 2 GiB .npy, a few minutes on 2 cores
    python -m bench.streaming --quick    # small files, seconds

For each case it times, over the same steps and layout the engine uses:
  source    reading every row of this process (``read_local``), no compute, no placement;
  compute   the engine's step over the same rows, all placed on the devices beforehand;
  e2e p=0   the engine's loop (``device_batches`` + step) with ``prefetch=0``;
  e2e p=2   the same with the default ``prefetch=2``;
  overlap   max(source, compute) / e2e: 1.0 is perfect overlap, 0.5 is none when balanced.
Cases: a generated ``.npy`` (``NpySource``; it was just written, so it reads from the page
cache), a source that sleeps a fixed time per chunk, set to the measured compute
time per step, so reading ~= compute, and a 512 MiB ``.npy`` at the default chunking (no
``microbatch``/``steps_per_call``) whose reads sleep in proportion to their rows so that reading
the file takes as long as the compute (``SlowSource``: a job of a few hundred MiB, where the
first step's read is the one prefetching cannot hide). Peak resident memory (``VmHWM``) is measured in
a fresh subprocess streaming files of 1x and 4x size. JSON goes to
``bench/results/streaming.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from sharded_scan import Combiner, Gram, RunOptions
from sharded_scan.layout import default_steps_per_call, resolve_chunking
from sharded_scan.prefetch import device_batches, place, read_local
from sharded_scan.program import build_program
from sharded_scan.sources import NpySource, Source

FEATURES = 256
MICROBATCH = 4096
STEPS_PER_CALL = 4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results", "streaming.json")
ON_DEVICE_BYTES = 6 << 30  # compute-only places every step first when they fit in this


class DelayedSource(Source):
    """``num_rows`` rows of one fixed chunk, each read sleeping ``delay`` seconds (like slow storage)."""

    def __init__(self, num_rows: int, chunk: np.ndarray, delay: float):
        self._num_rows, self._chunk, self.delay = num_rows, chunk, delay

    @property
    def num_rows(self) -> int:
        return self._num_rows

    @property
    def spec(self):
        return jax.ShapeDtypeStruct(self._chunk.shape[1:], self._chunk.dtype)

    def read(self, start: int, stop: int) -> np.ndarray:
        time.sleep(self.delay)
        return self._chunk[: stop - start]  # a view: the time spent is the delay alone


class SlowSource(Source):
    """``inner``'s rows, each read sleeping ``seconds_per_row`` a row first (storage slower than the page cache)."""

    def __init__(self, inner: Source, seconds_per_row: float):
        self.inner, self.seconds_per_row = inner, seconds_per_row

    @property
    def num_rows(self) -> int:
        return self.inner.num_rows

    @property
    def spec(self):
        return self.inner.spec

    def read(self, start: int, stop: int, pad_to: int | None = None):
        time.sleep((stop - start) * self.seconds_per_row)
        return self.inner.read(start, stop, pad_to=pad_to)


def write_npy(path: str, num_rows: int, features: int = FEATURES) -> None:
    """Writes a float32 ``(num_rows, features)`` .npy chunk by chunk (never whole in memory)."""
    block = np.random.default_rng(0).normal(size=(1 << 16, features)).astype(np.float32)
    with open(path, "wb") as f:
        descr = np.lib.format.dtype_to_descr(block.dtype)
        np.lib.format.write_array_header_1_0(f, {"descr": descr, "fortran_order": False, "shape": (num_rows, features)})
        for i, start in enumerate(range(0, num_rows, len(block))):
            (block[: min(len(block), num_rows - start)] + np.float32(i * 1e-3)).tofile(f)


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


class Bench:
    """The engine's step for one source and layout, compiled once and reused by every timing."""

    def __init__(self, source: Source, combiner: Combiner | None = None, options: RunOptions | None = None):
        if options is None:
            options = RunOptions(microbatch=MICROBATCH, steps_per_call=STEPS_PER_CALL, compensated=False)
        self.program = build_program(Gram() if combiner is None else combiner, source, options)
        self.source, self.mesh, self.layout = source, self.program.mesh, self.program.layout
        self._row_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(source.spec))
        self._placed: list | None = None
        self.fold(self._pool(1), 1)  # compile

    def _pool(self, k: int) -> list:
        self.source.seek(0)  # a sequential source (CSV) reads forward from here
        return [place(read_local(self.source, self.layout, c * self.layout.rows_per_step), self.layout, self.mesh)
                for c in range(k)]

    def fold(self, batches, steps: int | None = None) -> None:
        """The engine's loop: one step in flight, blocking on the partials after each."""
        partials = self.program.init()
        if steps is not None:  # cycle pre-placed batches
            pool = batches
            batches = (pool[i % len(pool)] for i in range(steps))
            rows = self.layout.rows_per_step
        for item in batches:
            batch, num_valid = (item, rows) if steps is not None else (item.batch, item.num_valid)
            partials = self.program.step(partials, batch, num_valid)
            jax.block_until_ready(partials)

    def source_only(self) -> float:
        def read_all():
            self.source.seek(0)
            for c in range(0, self.layout.num_rows, self.layout.rows_per_step):
                read_local(self.source, self.layout, c)  # dropped at once, as the engine's loop does

        return timed(read_all)

    def compute_only(self) -> float:
        """Every step's rows placed on the devices first (cycling 3 steps if they would not fit)."""
        if self._placed is None:
            fits = self.layout.num_steps() * self.layout.rows_per_step * self._row_bytes <= ON_DEVICE_BYTES
            self._placed = self._pool(self.layout.num_steps() if fits else min(3, self.layout.num_steps()))
        return timed(lambda: self.fold(self._placed, self.layout.num_steps()))

    def end_to_end(self, prefetch: int) -> float:
        return timed(lambda: self.fold(device_batches(self.source, self.layout, self.mesh, 0, prefetch)))


def measure(
    name: str, source: Source, repeats: int, compute: list[float] | None = None, options: RunOptions | None = None,
) -> dict[str, Any]:
    """Best of ``repeats`` per timing, taken round-robin so load from other jobs hits all alike."""
    b = Bench(source, options=options)
    times: dict[str, list[float]] = {"source_s": [], "compute_s": list(compute or []), "e2e_p0_s": [], "e2e_p2_s": []}
    for _ in range(repeats):
        times["source_s"].append(b.source_only())
        if compute is None:
            times["compute_s"].append(b.compute_only())
        times["e2e_p0_s"].append(b.end_to_end(0))
        times["e2e_p2_s"].append(b.end_to_end(2))
    row = {"case": name, "rows": source.num_rows, "steps": b.layout.num_steps(),
           "microbatch": b.layout.microbatch, "steps_per_call": b.layout.steps_per_call,
           "gib": source.num_rows * math.prod(source.spec.shape) * source.spec.dtype.itemsize / 2**30,
           "all_s": times, **{k: min(v) for k, v in times.items()}}
    slowest = max(row["source_s"], row["compute_s"])
    row["overlap_p0"], row["overlap_p2"] = slowest / row["e2e_p0_s"], slowest / row["e2e_p2_s"]
    return row


def defaults_cases(tmp: str, mebibytes: int, repeats: int) -> list[dict[str, Any]]:
    """A ``mebibytes`` .npy at the default chunking, its reads waiting as long as the compute takes (then
    copying from the page cache);
    and the same at the default steps before they were capped to a share of the job (``job_steps_cap``)."""
    path = os.path.join(tmp, "defaults.npy")
    write_npy(path, (mebibytes << 20) // (FEATURES * 4))
    fast, options = NpySource(path), RunOptions(compensated=False)
    bench = Bench(fast, options=options)
    compute = [bench.compute_only() for _ in range(repeats)]
    del bench  # its placed rows
    slow = SlowSource(fast, min(compute) / fast.num_rows)
    before = default_steps_per_call(fast.spec, resolve_chunking(fast.spec)[0])  # the default step, uncapped
    uncapped = RunOptions(compensated=False, steps_per_call=before)
    return [measure(f"npy {mebibytes} MiB, defaults", slow, repeats, compute, options),
            measure(f"npy {mebibytes} MiB, uncapped", slow, repeats, None, uncapped)]


def peak_rss(path: str) -> float:
    """Peak resident MiB of a fresh process that streams ``path`` through the engine's loop."""
    out = subprocess.run([sys.executable, "-m", "bench.streaming", "--rss_of", path],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return float(out.stdout.strip().splitlines()[-1])


def _rss_child(path: str) -> None:
    Bench(NpySource(path)).end_to_end(2)
    # VmHWM, not ru_maxrss: on Linux ru_maxrss keeps the parent's peak across fork + exec.
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    print(kib / 1024)


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}, cores: {os.cpu_count()}, "
          f"rows of {FEATURES} float32, Gram")
    header = f"{'case':<26}{'GiB':>6}{'steps':>7}{'rows/step':>10}{'source s':>10}{'compute s':>11}{'e2e p=0':>9}"
    print(header + f"{'e2e p=2':>9}{'overlap p=0':>13}{'overlap p=2':>13}")
    for r in rows:
        per_step = r["microbatch"] * r["steps_per_call"] * jax.device_count()
        print(f"{r['case']:<26}{r['gib']:>6.2f}{r['steps']:>7}{per_step:>10}{r['source_s']:>10.2f}"
              f"{r['compute_s']:>11.2f}{r['e2e_p0_s']:>9.2f}{r['e2e_p2_s']:>9.2f}{r['overlap_p0']:>13.2f}"
              f"{r['overlap_p2']:>13.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small files, one repeat")
    parser.add_argument("--dir", default=None, help="where to write the generated files (a temp dir by default)")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8, as bench/run.py)")
    parser.add_argument("--defaults_only", action="store_true", help="only the case at the default chunking")
    parser.add_argument("--rss_of", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", args.devices)  # before the backend starts
    if args.rss_of:
        return _rss_child(args.rss_of)
    if args.defaults_only:
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-streaming-") as tmp:
            return print_rows(defaults_cases(tmp, 64 if args.quick else 512, 1 if args.quick else 4))

    row_bytes = FEATURES * 4
    big = (256 if args.quick else 2048) * 2**20 // row_bytes     # rows of the 4x (and overlap) file
    repeats = 1 if args.quick else 4
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-streaming-") as tmp:
        big_path, small_path = os.path.join(tmp, "4x.npy"), os.path.join(tmp, "1x.npy")
        write_npy(big_path, big)
        write_npy(small_path, big // 4)
        # Peak memory first, in fresh processes, before this one holds placed rows.
        rss = {"1x": peak_rss(small_path), "4x": peak_rss(big_path)}
        sizes = {"1x": os.path.getsize(small_path) / 2**30, "4x": os.path.getsize(big_path) / 2**30}
        rows = [measure("npy", NpySource(big_path), repeats)]

        # Balanced: the same compute per step as the .npy case, a read delay equal to it.
        chunk = NpySource(small_path).read(0, Bench(NpySource(small_path)).layout.rows_per_step)
        steps = 64 if args.quick else 200
        probe = Bench(DelayedSource(steps * len(chunk), chunk, 0.0))
        compute = [probe.compute_only() for _ in range(repeats)]
        delay = min(compute) / steps
        rows.append(measure(f"delay {1e3 * delay:.1f} ms/chunk", DelayedSource(steps * len(chunk), chunk, delay),
                            repeats, compute))
        rows += defaults_cases(tmp, 64 if args.quick else 512, repeats)

    print_rows(rows)
    ratio = rss["4x"] / rss["1x"]
    print(f"peak RSS streaming .npy (prefetch=2): 1x {sizes['1x']:.2f} GiB -> {rss['1x']:.0f} MiB, "
          f"4x {sizes['4x']:.2f} GiB -> {rss['4x']:.0f} MiB (ratio {ratio:.3f})")
    result = {"quick": args.quick, "host": platform.node(), "jax": jax.__version__, "cases": rows,
              "peak_rss_mib": rss, "file_gib": sizes, "rss_ratio": ratio,
              "features": FEATURES, "microbatch": MICROBATCH, "steps_per_call": STEPS_PER_CALL}
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
