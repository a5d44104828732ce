"""Parquet decode: pyarrow against Polars, per thread and from 1 thread to every core, and a Moments run with
each as ``ParquetSource``'s decoder, in one process.

    python -m bench.decode              # 4·10^6 rows x 8 float32 columns, row groups of 2^17 rows, best of 5
    python -m bench.decode --quick      # 2^19 rows, best of 3

Rows printed (MB: the decoded float32 bytes, rows x 8 x 4; seconds: the best wall, the best process CPU and
the best CPU of the calling thread, the serial part of a read, over the rounds):

- ``pyarrow read_table`` / ``polars read_parquet``: each library's own whole-file read on its own threads;
  ``pyarrow iter_batches``: pyarrow's streaming read (``pre_buffer``, its threads);
- ``pyarrow row groups, t threads`` / ``polars row groups, t threads``: every row group decoded on a pool of
  ``t`` threads, as ``ParquetSource`` decodes them (pyarrow: ``ParquetFile.read_row_group``, one thread
  each; Polars: ``scan_parquet(...).slice(row group)``), MB/s and MB/s per thread, t = 1, 2, 4, ... cores;
- ``source reads``: ``ParquetSource(decoder=...)`` read step by step into ``(rows, 8)`` host arrays, decode
  and cast, no JAX;
- ``moments run``: ``ss.run(ss.Moments(), ParquetSource(..., decoder=...))``, decode to result.

``--csv``: a CSV file of the same rows with a string column (``python -m bench.decode --csv [--quick]``): each
library's own whole-file read (pyarrow on 1 thread and on its pool, Polars on its pool, of the float columns and
of the string column), and ``CsvSource(decoder=...)`` read step by step, floats and strings; MB: the file's bytes.
JSON: ``bench/results/decode_csv[_quick].json``.

Polars' own pool has ``POLARS_MAX_THREADS`` threads (default: the cores), fixed when it is imported: its rows
with ``t`` threads are ``t`` concurrent queries on that pool. JSON goes to ``bench/results/decode[_quick].json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import sharded_scan as ss
from sharded_scan.sources import CsvSource, ParquetSource
from sharded_scan.sources.tabular import host_cores

try:
    import polars as pl
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq
except ImportError as e:  # pragma: no cover - the bench extra
    raise SystemExit(f"{e}: pip install -e '.[bench]' (polars, pyarrow)") from None

COLUMNS = [f"f{i}" for i in range(8)]
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def write_file(path: str, rows: int) -> None:
    rng = np.random.default_rng(0)
    pq.write_table(pa.table({c: (rng.standard_normal(rows) + i).astype(np.float32) for i, c in enumerate(COLUMNS)}),
                   path, row_group_size=1 << 17)


def timed(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, tuple[float, float, float]]:
    """Best wall, best process CPU and best calling thread's CPU seconds of each call over ``repeats``
    interleaved rounds."""
    best = dict.fromkeys(calls, (float("inf"),) * 3)
    for _ in range(repeats):
        for name, call in calls.items():
            wall, cpu, caller = time.perf_counter(), time.process_time(), time.thread_time()
            call()
            got = (time.perf_counter() - wall, time.process_time() - cpu, time.thread_time() - caller)
            best[name] = tuple(min(b, g) for b, g in zip(best[name], got, strict=True))
    return best


def row_groups(path: str) -> list[tuple[int, int]]:
    meta = pq.ParquetFile(path).metadata
    at = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
    return [(int(at[g]), int(at[g + 1] - at[g])) for g in range(meta.num_row_groups)]


def pool_calls(path: str, threads: list[int]) -> dict[str, Callable[[], object]]:
    groups = row_groups(path)

    def arrow_group(g: int) -> object:
        return pq.ParquetFile(path).read_row_group(g, columns=COLUMNS, use_threads=False)

    def polars_group(g: int) -> object:
        first, rows = groups[g]
        return pl.scan_parquet(path).select(COLUMNS).slice(first, rows).collect()

    calls = {}
    for t in threads:
        pool = ThreadPoolExecutor(t)
        calls[f"pyarrow row groups, {t} threads"] = lambda p=pool: list(p.map(arrow_group, range(len(groups))))
        calls[f"polars row groups, {t} threads"] = lambda p=pool: list(p.map(polars_group, range(len(groups))))
    return calls


def read_all(source: ParquetSource, step: int) -> None:
    source.seek(0)
    for start in range(0, source.num_rows, step):
        source.read(start, min(start + step, source.num_rows))


def csv_main(rows: int, repeats: int, quick: bool) -> None:
    """The ``--csv`` rows: each library's own read and ``CsvSource`` per decoder, numbers and strings."""
    cores = host_cores()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "decode.csv")
        rng = np.random.default_rng(0)
        words = np.array(["Oslo", "Köln", "São Paulo", "New York, NY", "x" * 20], object)
        pl.DataFrame({**{c: rng.standard_normal(rows).astype(np.float32) for c in COLUMNS},
                      "city": words[rng.integers(0, len(words), rows)]}).write_csv(path)
        megabytes = os.path.getsize(path) / 1e6
        step = 1 << 17
        sources = {(d, kind): CsvSource(path, columns=COLUMNS if kind == "floats" else "city", decoder=d)
                   for d in ("pyarrow", "polars") for kind in ("floats", "strings")}
        floats = {c: pl.Float64 for c in COLUMNS}
        calls = {
            "pyarrow read_csv, 1 thread, floats": lambda: pcsv.read_csv(path, read_options=pcsv.ReadOptions(
                use_threads=False), convert_options=pcsv.ConvertOptions(include_columns=COLUMNS)),
            f"pyarrow read_csv, {cores} threads, floats": lambda: pcsv.read_csv(
                path, convert_options=pcsv.ConvertOptions(include_columns=COLUMNS)),
            f"polars read_csv, {cores} threads, floats": lambda: pl.read_csv(path, columns=COLUMNS,
                                                                            schema_overrides=floats),
            "pyarrow read_csv, 1 thread, strings": lambda: pcsv.read_csv(path, read_options=pcsv.ReadOptions(
                use_threads=False), convert_options=pcsv.ConvertOptions(include_columns=["city"])),
            f"pyarrow read_csv, {cores} threads, strings": lambda: pcsv.read_csv(
                path, convert_options=pcsv.ConvertOptions(include_columns=["city"])),
            f"polars read_csv, {cores} threads, strings": lambda: pl.read_csv(path, columns=["city"]),
            **{f"source reads, {d}, {kind}": (lambda s=s: read_all(s, step)) for (d, kind), s in sources.items()},
        }
        load = os.getloadavg()[0]
        seconds = timed(calls, repeats)
    print(f"{rows:,} rows x ({len(COLUMNS)} float32 + 1 string) as CSV ({megabytes:.0f} MB), {cores} cores, "
          f"load {load:.1f}, best of {repeats}")
    print_table(seconds, megabytes, 40)
    for kind in ("floats", "strings"):
        a, b = seconds[f"source reads, pyarrow, {kind}"], seconds[f"source reads, polars, {kind}"]
        print(f"  source reads, {kind}: polars {a[0] / b[0]:.2f}x the speed of pyarrow (wall), {a[1] / b[1]:.2f}x "
              f"(CPU), {a[2] / b[2]:.2f}x (the reading thread's CPU)")
    os.makedirs(RESULTS, exist_ok=True)
    out = os.path.join(RESULTS, f"decode_csv{'_quick' if quick else ''}.json")
    with open(out, "w") as f:
        kinds = ("wall", "cpu", "caller_cpu")
        json.dump({"rows": rows, "cores": cores, "load": load, "repeats": repeats, "machine": platform.machine(),
                   "seconds": {k: dict(zip(kinds, v, strict=True)) for k, v in seconds.items()}}, f, indent=1)
    print(f"wrote {out}")


def print_table(seconds: dict, megabytes: float, width: int) -> None:
    """One line a call: wall, CPU and the calling thread's CPU seconds, MB/s, and MB/s a thread where the
    call's name says its threads (``"..., N thread(s)"``)."""
    print(f"  {'':<{width}}{'wall s':>8}{'CPU s':>8}{'caller s':>9}{'MB/s':>8}{'MB/s/thread':>13}")
    for name, (wall, cpu, caller) in seconds.items():
        t = int(name.split(", ")[1].split()[0]) if "thread" in name else None
        per = f"{megabytes / wall / t:13.0f}" if t else ""
        print(f"  {name:<{width}}{wall:8.3f}{cpu:8.3f}{caller:9.3f}{megabytes / wall:8.0f}{per}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2^19 rows, best of 3")
    parser.add_argument("--csv", action="store_true", help="CSV: pyarrow and Polars, CsvSource")
    parser.add_argument("--rows", type=int, help="rows of the file (default 4·10^6, CSV 10^6; quick 2^19)")
    parser.add_argument("--repeats", type=int, help="timed rounds (default 5; quick 3)")
    args = parser.parse_args()
    rows = args.rows or (1 << 19 if args.quick else 1_000_000 if args.csv else 4_000_000)
    repeats = args.repeats or (3 if args.quick else 5)
    if args.csv:
        return csv_main(rows, repeats, args.quick)
    cores = host_cores()
    threads = sorted({1, cores} | {t for t in (2, 4, 8, 16, 32, 64) if t < cores})
    megabytes = rows * len(COLUMNS) * 4 / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "decode.parquet")
        write_file(path, rows)
        step = 1 << 17
        sources = {d: ParquetSource(path, columns=COLUMNS, decoder=d) for d in ("pyarrow", "polars")}
        calls = {
            "pyarrow read_table": lambda: pq.read_table(path, columns=COLUMNS),
            "polars read_parquet": lambda: pl.read_parquet(path, columns=COLUMNS),
            "pyarrow iter_batches": lambda: list(pq.ParquetFile(path, pre_buffer=True).iter_batches(
                1 << 17, columns=COLUMNS, use_threads=True)),
            **pool_calls(path, threads),
            **{f"source reads, {d}": (lambda s=s: read_all(s, step)) for d, s in sources.items()},
            **{f"moments run, {d}": (lambda d=d: ss.run(ss.Moments(), ParquetSource(path, columns=COLUMNS,
                                                                                    decoder=d)).mean)
               for d in sources},
        }
        answers = {d: calls[f"moments run, {d}"]() for d in sources}  # warm: compiled, file cached
        np.testing.assert_array_equal(answers["pyarrow"], answers["polars"])
        load = os.getloadavg()[0]
        seconds = timed(calls, repeats)
    print(f"{rows:,} rows x {len(COLUMNS)} float32 ({megabytes:.0f} MB decoded), {cores} cores, load {load:.1f}, "
          f"best of {repeats}")
    print_table(seconds, megabytes, 34)
    for prefix in ("source reads", "moments run"):
        a, b = seconds[f"{prefix}, pyarrow"], seconds[f"{prefix}, polars"]
        serial = f", {a[2] / b[2]:.2f}x (the reading thread's CPU)" if prefix == "source reads" else ""
        print(f"  {prefix}: polars {a[0] / b[0]:.2f}x the speed of pyarrow (wall), {a[1] / b[1]:.2f}x (CPU){serial}")
    os.makedirs(RESULTS, exist_ok=True)
    out = os.path.join(RESULTS, f"decode{'_quick' if args.quick else ''}.json")
    with open(out, "w") as f:
        kinds = ("wall", "cpu", "caller_cpu")
        json.dump({"rows": rows, "cores": cores, "load": load, "repeats": repeats, "machine": platform.machine(),
                   "seconds": {k: dict(zip(kinds, v, strict=True)) for k, v in seconds.items()}}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
