"""sharded_scan against its peers, side by side in one process run.

    python bench/run.py            # 256 MiB per workload, best of 5, the tuning sweep (~10 min)
    python bench/run.py --quick    # 24 MiB, best of 2, a small sweep (7 min in one run on 2 shared cores)

Prints one table (rate, and sharded_scan's ratio to the best peer), then the analyzers'
(quantiles, distinct counts, top-k: rows/s and error of every caller, ``bench/analyzers.py``),
the GROUP BY rows (``GroupBy`` against pandas, Polars and DuckDB, ``bench/groupby.py``)
and writes
``bench/results/bench[_quick].json`` and ``.png``. Every caller of a workload is timed
in the same process, interleaved (one run of each in turn, ``--repeats`` rounds, the
best kept), so machine noise hits them alike; compare ratios, not absolute rates.

numpy reads ``OPENBLAS_CORETYPE``/``OPENBLAS_L2_SIZE`` when it is imported; by default
this script removes both from its own environment first so that OpenBLAS picks its
kernels for this CPU (the strongest numpy peer); ``--keep-openblas-env`` keeps them.
"""

from __future__ import annotations

import os
import sys

OPENBLAS_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
KEEP_ENV = "--keep-openblas-env" in sys.argv
REMOVED_ENV = {} if KEEP_ENV else {k: os.environ.pop(k) for k in OPENBLAS_VARS if k in os.environ}
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402  (numpy must not load before the environment is settled)
import json  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from bench import analyzers, groupby, tuning  # noqa: E402
from bench.workloads import Workload, comparable, make_workloads, reference  # noqa: E402
from sharded_scan import layout  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
OURS = "sharded_scan"


def measure(w: Workload, repeats: int) -> dict:
    """Checks every caller against float64 (one warm-up run each), then times them."""
    calls = w.calls()
    want = reference(w)
    errors = {}
    for name, call in calls.items():
        got = comparable(w, call())
        errors[name] = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
    seconds = tuning.interleaved_best(calls, repeats)
    rates = {name: w.work / t / (1e9 if w.unit == "GFLOP/s" else 2**30) for name, t in seconds.items()}
    peers = {k: v for k, v in rates.items() if k != OURS}
    best_peer = max(peers, key=peers.get)
    return {
        "workload": w.name, "unit": w.unit, "rows": w.n, "d": w.d, "bytes": int(w.x.nbytes),
        "seconds": seconds, "rate": rates, "rel_err": errors,
        "best_peer": best_peer, "ratio": rates[OURS] / peers[best_peer],
    }


def table(rows: list[dict]) -> str:
    callers = list(rows[0]["rate"])
    head = ["workload", "unit", *callers, "best peer", "ratio"]
    lines = [head]
    for r in rows:
        lines.append(
            [r["workload"], r["unit"], *(f"{r['rate'][c]:.1f}" for c in callers), r["best_peer"], f"{r['ratio']:.2f}x"]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    cells = [["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |"] for line in lines]
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([cells[0][0], rule, *(c[0] for c in cells[1:])])


def plot(rows: list[dict], path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    callers = list(rows[0]["rate"])
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(callers)
    for i, c in enumerate(callers):
        best = [r["rate"][c] / max(r["rate"].values()) for r in rows]
        ax.bar(np.arange(len(rows)) + i * width, best, width, label=c)
    ax.set_xticks(np.arange(len(rows)) + 0.4 - width / 2, [f"{r['workload']}\n{r['ratio']:.2f}x" for r in rows])
    ax.set_ylabel("rate / fastest caller")
    ax.set_title(title)
    ax.legend(ncol=len(callers), fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small data, few repeats, small sweep (7 min in one run)")
    parser.add_argument("--megabytes", type=int, help="input size per workload (default 256, quick 24)")
    parser.add_argument("--analyzer-rows", type=int, help="rows per analyzer (4 columns; 2^22, quick 2^18)")
    parser.add_argument("--groupby-rows", type=int, help="rows per GROUP BY workload (10^6, quick 2^17)")
    parser.add_argument("--repeats", type=int, help="timed rounds per workload (default 5, quick 2)")
    parser.add_argument("--only", help="comma-separated workload names")
    parser.add_argument("--no-sweep", action="store_true", help="skip the tuning sweep")
    parser.add_argument("--keep-openblas-env", action="store_true", help="keep OPENBLAS_* for numpy")
    parser.add_argument("--min-job-steps", type=int,
                        help="the step cap's fewest steps a job (layout.MIN_JOB_STEPS); 1 times the uncapped layout")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args()
    if args.min_job_steps is not None:
        layout.MIN_JOB_STEPS = args.min_job_steps  # read by job_steps_cap at each run
    megabytes = args.megabytes or (24 if args.quick else 256)
    repeats = args.repeats or (2 if args.quick else 5)
    started = time.perf_counter()

    rows = []
    only = set(args.only.split(",")) if args.only else None
    workloads = make_workloads(megabytes, only)
    for w in workloads:
        rows.append(measure(w, repeats))
        print(f"  {w.name}: {rows[-1]['ratio']:.2f}x {rows[-1]['best_peer']}", flush=True)
        if w.cleanup:
            w.cleanup()
    analyzer_rows = []
    for a in analyzers.make_analyzers(args.analyzer_rows or (1 << 18 if args.quick else 1 << 22), only):
        analyzer_rows.append(analyzers.measure(a, min(repeats, 3)))
        print(f"  {a.name}: {analyzer_rows[-1]['ratio']:.2f}x {analyzer_rows[-1]['best_peer']}", flush=True)
    groupby_rows = groupby.run(args.groupby_rows or ((1 << 17) if args.quick else 10**6), min(repeats, 3), only)
    report = {
        "command": " ".join(["python", "bench/run.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "devices": jax.device_count(), "platform": platform.platform()},
        "versions": {"jax": jax.__version__, "numpy": np.__version__},
        "openblas_env_removed": REMOVED_ENV,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "megabytes": megabytes, "repeats": repeats,
        "results": rows,
        "analyzers": analyzer_rows,
        "groupby": groupby_rows,
    }
    if not args.no_sweep:
        report["sweep"] = tuning.sweep(quick=args.quick, repeats=repeats)
        report["host_overhead"] = tuning.host_overhead(quick=args.quick)
    report["communication"] = tuning.communication()
    report["gradient_iterations"] = tuning.gradient_iterations(quick=args.quick, repeats=repeats)
    report["logical_shards_cost"] = tuning.logical_shards_cost(quick=args.quick, repeats=repeats)
    report["seconds"] = time.perf_counter() - started

    print()
    if rows:
        print(table(rows))
    if analyzer_rows:
        print("\n" + analyzers.table(analyzer_rows))
    if groupby_rows:
        print("\n" + groupby.table(groupby_rows))
    if "sweep" in report:
        print("\n" + tuning.describe(report["sweep"], report["host_overhead"]))
    grad = report["gradient_iterations"]
    print(f"\nGradient, {grad['rows']} rows: {grad['seconds']['new params']:.3f} s an iteration with new params, "
          f"{grad['seconds']['same combiner']:.3f} s rerunning the same combiner ({grad['ratio']:.2f}x)")
    for c in report["logical_shards_cost"]:
        print(f"{c['combiner']} d={c['d']}: logical_shards=8 takes {c['ratio']:.2f}x the time of the default run "
              f"({c['seconds']['logical_shards=8']:.3f} s vs {c['seconds']['default']:.3f} s, {c['rows']} rows)")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "bench_quick" if args.quick else "bench"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=float))
    if rows:
        plot(rows, args.out / f"{stem}.png", f"{report['command']}  ({megabytes} MiB, best of {repeats})")
    print(f"\nwrote {args.out / stem}.json{' and .png' if rows else ''} in {report['seconds']:.0f} s")


if __name__ == "__main__":
    main()
