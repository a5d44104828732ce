"""What bitwise reproducibility costs on CPU: ``logical_shards`` runs (matrix products in a
fixed summation order, ``sharded_scan/fixed_order.py``) beside the same jobs without it.

    python bench/fixed_order.py           # 8 simulated devices, best of 3 after a warm-up run
    python bench/fixed_order.py --only "d=96" --scale 0.25   # the d=96 jobs on a quarter of the rows
    python bench/fixed_order.py --merge-compile   # the solvers' pair merge compiled in a fresh process each
    python bench/fixed_order.py --add --only "d=256"   # one steady micro-batch's add, CPU-ms per 256 rows
    python bench/fixed_order.py --shard --only "LinearRegression d=256"   # a shard's first adds, one by one
    python bench/fixed_order.py --merge-compile --against /path/to/other/checkout   # and its, alternating

Prints rows/s for each job both ways and the ratio, all timed in this one process, the two
runs of a job interleaved so that machine noise hits them alike; and the ratio of the process's CPU
seconds (all threads; best of the repeats), which a machine shared with other work moves less.

    PYTHONPATH=/path/to/other/checkout python bench/fixed_order.py   # the same jobs on other code
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

import sharded_scan as ss  # noqa: E402

JOBS = {  # name: (combiner, features, rows, with a target); issue 45's target: >= 0.5x at d=96 and d=256
    "Gram d=96": (ss.Gram(), 96, 300_000, False),
    "Gram d=256": (ss.Gram(), 256, 100_000, False),
    "Covariance d=96": (ss.Covariance(), 96, 300_000, False),
    "Covariance d=256": (ss.Covariance(), 256, 100_000, False),
    "LinearRegression d=32": (ss.LinearRegression(), 32, 200_000, True),
    "LinearRegression d=96": (ss.LinearRegression(), 96, 200_000, True),
    "LinearRegression d=256": (ss.LinearRegression(), 256, 60_000, True),
    "PCA(3) d=64": (ss.PCA(3), 64, 100_000, False),
}


# Issue 45's target: the solvers' pair merge under logical_shards compiles in under 1 CPU-s.
MERGE_JOBS = {"LinearRegression d=96": ("LinearRegression()", 96),
              "LinearRegression d=256": ("LinearRegression()", 256), "PCA(3) d=96": ("PCA(3)", 96)}
MERGE_CHILD = """
import sys, time
import jax
jax.config.update("jax_num_cpu_devices", 8)
import numpy as np
import sharded_scan as ss
from sharded_scan import program
combiner, d = eval("ss." + sys.argv[1]), int(sys.argv[2])
row = jax.ShapeDtypeStruct((d,), np.float32)
spec = (row, jax.ShapeDtypeStruct((), np.float32)) if isinstance(combiner, ss.LinearRegression) else row
options = ss.RunOptions(mesh="data:8", logical_shards=8, compilation_cache=None)
lowered = program.program_for_spec(combiner, spec, 16421, options).lower_merge()
start = time.process_time()
lowered.compile()
print(time.process_time() - start)
"""


def merge_compile(repeats: int, only: str, against: str | None = None) -> None:
    """Each solver's pair merge under ``logical_shards=8`` compiled in a fresh process (no compilation cache, as a
    first process pays), CPU seconds of the compile alone: the least and the most over ``repeats`` processes.
    ``against``: another checkout, its processes alternating with this one's (one row each)."""
    trees = {"": None} if against is None else {" (this)": None, f" ({os.path.basename(against.rstrip('/'))})": against}
    print(f"{'pair merge, logical_shards=8':40s} {'compile CPU-s: least':>21s} {'most':>6s}")
    for name, (combiner, d) in MERGE_JOBS.items():
        if only not in name:
            continue
        seconds = {tree: [] for tree in trees}
        for _ in range(repeats):
            for tree, path in trees.items():
                env = None if path is None else {**os.environ, "PYTHONPATH": path}
                seconds[tree].append(float(subprocess.run(
                    [sys.executable, "-c", MERGE_CHILD, combiner, str(d)], check=True, capture_output=True,
                    text=True, env=env).stdout.split()[-1]))
        for tree, values in seconds.items():
            print(f"{name + tree:40s} {min(values):21.2f} {max(values):6.2f}", flush=True)


def add_cost(repeats: int, only: str) -> None:
    """A steady accumulator's ``add`` alone (one device, jitted): under ``fixed_order`` (what ``logical_shards`` runs on
    CPU) on a 256-row micro-batch, without it on the default micro-batch (about 4 MiB of rows), CPU-ms per 256 rows,
    best of ``repeats`` rounds, the two interleaved; the accumulator first folds 40 micro-batches (4 plain ones)."""
    from sharded_scan import layout
    from sharded_scan.fixed_order import fixed_order

    print(f"{'add, CPU-ms a 256 rows':24s} {'plain':>7s} {'rows':>6s} {'fixed_order':>12s} {'ratio':>6s}")
    rng = np.random.default_rng(0)
    for name, (combiner, d, _, target) in JOBS.items():
        if only not in name:
            continue
        row = jax.ShapeDtypeStruct((d,), np.float32)
        spec = (row, jax.ShapeDtypeStruct((), np.float32)) if target else row

        def batch(rows, d=d, target=target):
            x = (3 + rng.normal(size=(rows, d))).astype(np.float32)
            return ((x, x[:, 0] + 1) if target else x), np.ones(rows, bool)

        def step(acc, data, mask, combiner=combiner):
            return combiner.add(acc, data, mask)

        ways = {"plain": (jax.jit(step), layout.default_microbatch(spec), 4),
                "fixed": (jax.jit(fixed_order(step)), layout.REPRODUCIBLE_MICROBATCH, 40)}
        state, best = {}, dict.fromkeys(ways, float("inf"))
        for way, (fn, rows, warm) in ways.items():
            acc = combiner.init(spec)
            for _ in range(warm):
                acc = fn(acc, *batch(rows))
            state[way] = (acc, batch(rows))
            jax.block_until_ready(fn(acc, *state[way][1]))
        for _ in range(repeats):
            for way, (fn, rows, _) in ways.items():
                acc, (data, mask) = state[way]
                calls = max(4096 // rows, 1) * 16
                start = time.process_time()
                for _ in range(calls):
                    out = fn(acc, data, mask)
                jax.block_until_ready(out)
                best[way] = min(best[way], (time.process_time() - start) / calls * 256 / rows * 1e3)
        print(f"{name:24s} {best['plain']:7.3f} {ways['plain'][1]:6d} {best['fixed']:12.3f} "
              f"{best['plain'] / best['fixed']:6.2f}", flush=True)


def shard_adds(repeats: int, only: str, count: int = 30) -> None:
    """A fresh accumulator's first ``count`` adds under ``fixed_order`` (256-row micro-batches, one device, jitted),
    each timed alone (CPU-ms, best of ``repeats``): where a shard's time goes as it grows up and its basis settles."""
    from sharded_scan import layout
    from sharded_scan.fixed_order import fixed_order

    rng = np.random.default_rng(0)
    rows = layout.REPRODUCIBLE_MICROBATCH
    mask = np.ones(rows, bool)
    for name, (combiner, d, _, target) in JOBS.items():
        if only not in name:
            continue
        row = jax.ShapeDtypeStruct((d,), np.float32)
        acc = combiner.init((row, jax.ShapeDtypeStruct((), np.float32)) if target else row)
        fn = jax.jit(fixed_order(lambda acc, data, mask, combiner=combiner: combiner.add(acc, data, mask)))
        times = []
        for _ in range(count):
            x = (3 + rng.normal(size=(rows, d))).astype(np.float32)
            data = (x, x[:, 0] + 1) if target else x
            new = jax.block_until_ready(fn(acc, data, mask))
            best = float("inf")
            for _ in range(repeats):
                start = time.process_time()
                jax.block_until_ready(fn(acc, data, mask))
                best = min(best, time.process_time() - start)
            times.append(best * 1e3)
            acc = new
        print(f"{name}: {sum(times):.1f} CPU-ms in {count} adds:", " ".join(f"{t:.1f}" for t in times), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="", help="run the jobs whose name holds this text")
    parser.add_argument("--scale", type=float, default=1.0, help="times each job's rows")
    parser.add_argument("--merge-compile", action="store_true",
                        help="print the solvers' pair merge compile CPU-s instead (a fresh process each)")
    parser.add_argument("--add", action="store_true",
                        help="print one steady micro-batch's add, CPU-ms per 256 rows, with and without fixed_order")
    parser.add_argument("--shard", action="store_true",
                        help="print a fresh shard's first 30 adds under fixed_order, CPU-ms each")
    parser.add_argument("--against", default=None,
                        help="with --merge-compile: another checkout's merges too, its processes alternating")
    args = parser.parse_args()
    if args.shard:
        shard_adds(args.repeats, args.only)
        return
    if args.add:
        add_cost(args.repeats, args.only)
        return
    if args.merge_compile:
        merge_compile(args.repeats, args.only, args.against)
        return
    rng = np.random.default_rng(0)
    print(f"{'job':24s} {'rows/s':>12s} {'rows/s logical_shards=8':>24s} {'ratio':>7s} {'cpu ratio':>9s}")
    for name, (combiner, d, n, target) in JOBS.items():
        if args.only not in name:
            continue
        n = max(int(n * args.scale), 4096)
        x = (3 + rng.normal(size=(n, d))).astype(np.float32)
        data = (x, x[:, 0] + 1) if target else x
        best = {None: float("inf"), 8: float("inf")}
        cpu = dict(best)
        for shards in best:  # warm-up: compiles
            ss.run(combiner, data, logical_shards=shards)
        for _ in range(args.repeats):
            for shards in best:
                start, start_cpu = time.perf_counter(), time.process_time()
                ss.run(combiner, data, logical_shards=shards)
                best[shards] = min(best[shards], time.perf_counter() - start)
                cpu[shards] = min(cpu[shards], time.process_time() - start_cpu)
        print(f"{name:24s} {n / best[None]:12.3g} {n / best[8]:24.3g} {best[None] / best[8]:7.2f} "
              f"{cpu[None] / cpu[8]:9.2f}", flush=True)


if __name__ == "__main__":
    main()
