"""Parquet and CSV end to end against pyarrow reading the same files alone. One table from one run.

    python -m bench.tabular_streaming            # 256 MiB snappy Parquet, 48 MiB CSV; a few minutes on 2 cores
    python -m bench.tabular_streaming --quick    # 32 MiB Parquet, 6 MiB CSV, 3 repeats; ~10 s
    git show REV:sharded_scan/sources/tabular.py > /tmp/old_tabular.py
    python -m bench.tabular_streaming --baseline /tmp/old_tabular.py   # also that version's source and run

The files: 32 numeric columns (16 float32, 16 float64; normal values), read as float32
(``dtype="float32"``, the explicit opt-in to 32 bits). Parquet: snappy, no
dictionary, 128Ki-row row groups, in 4 files of one directory. CSV: one file written by
``pyarrow.csv`` (float32 values print shorter than float64 ones). Both were just written,
so they read from the page cache: this is decoding speed, not disk speed.

For each case it times, interleaved (every timing once per repeat, in turn), best of repeats:
  arrow     ``pyarrow.dataset.dataset(path).to_batches(columns=...)`` read alone, the batches
            dropped (pyarrow's own threads);
  ceiling   the same, each batch also converted to one ``(rows, 32)`` float32 numpy array:
            the I/O ceiling for us, who must hand numpy rows to the devices;
  read      the source's own reads of every step of the default layout (``source.read``);
  source    the source alone through the engine's reader (``read_local``: the same, the last step
            zero-padded to a whole step, which copies it), no placement, no compute;
  compute   the engine's step over the same rows, all placed on the devices beforehand;
  loop      the engine's loop (``device_batches`` with ``prefetch=2`` + step) alone;
  run       ``sharded_scan.run(Moments(), source)``, default options and mesh (8 simulated CPU
            devices), warm: its program was compiled by an earlier run (the first run's time,
            compile included, is ``run_cold_s`` in the JSON);
  overlap   max(source, compute) / loop, as in ``bench/streaming.py``.
Ratios: run's rows/s over the ceiling's (the target is >= 0.85) and over arrow's. JSON goes to
``bench/results/tabular_streaming.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before the backend starts

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.csv  # noqa: E402, F401 - loads the submodule
import pyarrow.dataset  # noqa: E402, F401
import pyarrow.parquet as pq  # noqa: E402

import sharded_scan as ss  # noqa: E402
from bench.streaming import ROOT, Bench, timed  # noqa: E402
from sharded_scan.sources import CsvSource, ParquetSource, Source  # noqa: E402
from sharded_scan.sources.base import aligned_empty  # noqa: E402

COLUMNS = [f"f{j}" for j in range(16)] + [f"d{j}" for j in range(16)]  # float32, float64
ROW_GROUP = 1 << 17
FILES = 4
RESULTS = os.path.join(ROOT, "bench", "results", "tabular_streaming.json")


def _block(rows: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table({name: rng.normal(size=rows).astype(np.float32 if name[0] == "f" else np.float64)
                     for name in COLUMNS})


def write_parquet(directory: str, mib: int) -> int:
    """``mib`` MiB of rows in ``FILES`` snappy files; returns the row count."""
    os.makedirs(directory)
    rows = mib * 2**20 // (16 * 4 + 16 * 8) // FILES
    for f in range(FILES):
        pq.write_table(_block(rows, f), os.path.join(directory, f"part-{f}.parquet"), compression="snappy",
                       row_group_size=ROW_GROUP, use_dictionary=False)
    return rows * FILES


def write_csv(path: str, mib: int) -> int:
    """About ``mib`` MiB of CSV text; returns the row count."""
    rows_per_block, rows = 1 << 12, 0
    with pa.csv.CSVWriter(path, _block(1, 0).schema) as writer:
        while os.path.getsize(path) < mib * 2**20:
            writer.write_table(_block(rows_per_block, rows))
            rows += rows_per_block
    return rows


def arrow_read(path: str, fmt: str, convert: bool) -> int:
    """pyarrow's dataset scan of the columns; with ``convert`` each batch also becomes one float32 array."""
    rows = 0
    for batch in pa.dataset.dataset(path, format=fmt).to_batches(columns=COLUMNS):
        rows += batch.num_rows
        if convert:
            out = aligned_empty((batch.num_rows, len(COLUMNS)), np.float32)
            for j in range(len(COLUMNS)):
                np.copyto(out[:, j], batch.column(j).to_numpy(), casting="unsafe")
    return rows


def read_only(source: Source, layout: Any) -> None:
    """``source.read`` of this process's rows of every step, without ``read_local``'s zero padding of the last."""
    source.seek(0)
    for cursor in range(0, layout.num_rows, layout.rows_per_step):
        start, stop = layout.local_range(cursor)
        source.read(min(start, source.num_rows), min(stop, source.num_rows))


def measure(name: str, path: str, fmt: str, source: Source, file_bytes: int, repeats: int,
            baseline: Source | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    ss.run(ss.Moments(), source)  # compiles the run's programs
    run_cold = time.perf_counter() - started
    bench = Bench(source, ss.Moments(), ss.RunOptions())  # the default layout, compiled alike
    timings: dict[str, Callable[[], Any]] = {
        "arrow_s": lambda: arrow_read(path, fmt, False),
        "ceiling_s": lambda: arrow_read(path, fmt, True),
        "read_s": lambda: read_only(source, bench.layout),
        "source_s": bench.source_only,
        "compute_s": bench.compute_only,
        "loop_s": lambda: bench.end_to_end(2),
        "run_s": lambda: ss.run(ss.Moments(), source),
    }
    if baseline is not None:  # the same files through another version's source, in the same rounds
        old = Bench(baseline, ss.Moments(), ss.RunOptions())
        timings |= {"baseline_source_s": old.source_only, "baseline_run_s": lambda: ss.run(ss.Moments(), baseline)}
    times: dict[str, list[float]] = {k: [] for k in timings}
    for _ in range(repeats):
        for key, fn in timings.items():
            elapsed = fn() if key in ("source_s", "compute_s", "loop_s", "baseline_source_s") else timed(fn)
            times[key].append(elapsed)
    best = {k: min(v) for k, v in times.items()}
    rows = source.num_rows
    row = {"case": name, "file_mib": file_bytes / 2**20, "rows": rows, "steps": bench.layout.num_steps(),
           "rows_per_step": bench.layout.rows_per_step, "run_cold_s": run_cold, "all_s": times, **best,
           **{k[:-2] + "_rows_per_s": rows / v for k, v in best.items()},
           **{k[:-2] + "_file_mb_per_s": file_bytes / 1e6 / v for k, v in best.items()}}
    row["ratio_ceiling"] = best["ceiling_s"] / best["run_s"]
    row["ratio_arrow"] = best["arrow_s"] / best["run_s"]
    row["overlap"] = max(best["source_s"], best["compute_s"]) / best["loop_s"]
    return row


def _load(path: str) -> ModuleType:
    """A module from a file: another version of ``sharded_scan/sources/tabular.py``."""
    spec = importlib.util.spec_from_file_location("tabular_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small files, 3 repeats")
    parser.add_argument("--dir", default=None, help="where to write the generated files (a temp dir by default)")
    parser.add_argument("--repeats", type=int, default=None, help="round-robin repeats (default 7; --quick 3)")
    parser.add_argument("--only", default="parquet,csv", help="cases to run, comma-separated")
    parser.add_argument("--baseline", default=None, help="another version's sharded_scan/sources/tabular.py "
                        "(e.g. from git show REV:...), timed beside this one on the same files")
    args = parser.parse_args()
    old = _load(args.baseline) if args.baseline else None
    repeats = args.repeats or (3 if args.quick else 7)
    parquet_mib, csv_mib = (32, 6) if args.quick else (256, 48)
    only = args.only.split(",")
    cases = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-tabular-") as tmp:
        if "parquet" in only:
            path = os.path.join(tmp, "parquet")
            write_parquet(path, parquet_mib)
            size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
            source = ParquetSource(path, columns=COLUMNS, dtype="float32")
            baseline = old.ParquetSource(path, columns=COLUMNS, dtype="float32") if old else None
            cases.append(measure("parquet", path, "parquet", source, size, repeats, baseline))
        if "csv" in only:
            path = os.path.join(tmp, "data.csv")
            write_csv(path, csv_mib)
            started = time.perf_counter()
            source = CsvSource(path, columns=COLUMNS, dtype="float32")
            built = time.perf_counter() - started
            baseline = old.CsvSource(path, columns=COLUMNS, dtype="float32") if old else None
            cases.append(measure("csv", path, "csv", source, os.path.getsize(path), repeats, baseline))
            cases[-1]["source_built_s"] = built  # the counting pass, before any run

    print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}, cores: {os.cpu_count()}, pyarrow "
          f"{pa.__version__}, {len(COLUMNS)} columns as float32, Moments, default options, best of {repeats}")
    keys = ("arrow", "ceiling", "read", "source", "compute", "loop", "run")
    print(f"{'case':<9}{'MiB':>6}{'rows':>9}{'steps':>6}" + "".join(f"{k + ' s':>10}" for k in keys)
          + f"{'run/ceil':>10}{'run/arrow':>10}{'overlap':>9}")
    for r in cases:
        print(f"{r['case']:<9}{r['file_mib']:>6.0f}{r['rows']:>9}{r['steps']:>6}"
              + "".join(f"{r[k + '_s']:>10.3f}" for k in keys)
              + f"{r['ratio_ceiling']:>10.2f}{r['ratio_arrow']:>10.2f}{r['overlap']:>9.2f}")
    print("rows/s (file MB/s):")
    for r in cases:
        print(f"  {r['case']:<8}" + "  ".join(
            f"{k} {r[k + '_rows_per_s'] / 1e6:.2f}M ({r[k + '_file_mb_per_s']:.0f})" for k in keys))
    for r in cases:
        if "baseline_run_s" in r:
            print(f"  {r['case']:<8}baseline {args.baseline}: source {r['baseline_source_s']:.3f} s, run "
                  f"{r['baseline_run_s']:.3f} s (run/ceil {r['ceiling_s'] / r['baseline_run_s']:.2f}); this: source "
                  f"{r['baseline_source_s'] / r['source_s']:.2f}x, run {r['baseline_run_s'] / r['run_s']:.2f}x faster")
    write_results(RESULTS, args.quick, {"repeats": repeats, "columns": COLUMNS, "row_group_rows": ROW_GROUP,
                                        "parquet_files": FILES, "baseline": args.baseline, "cases": cases})


def write_results(path: str, quick: bool, fields: dict[str, Any]) -> None:
    """Writes a tabular bench's figures with the machine they come from (``_quick`` beside ``path``)."""
    result = {"quick": quick, "host": platform.node(), "jax": jax.__version__, "pyarrow": pa.__version__,
              "devices": jax.device_count(), "cores": os.cpu_count(), **fields}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    out = path if not quick else path.replace(".json", "_quick.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
