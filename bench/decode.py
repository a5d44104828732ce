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
  and cast, no JAX; ``source reads, polars, t threads``: its decoding pool of ``t`` threads (as on a host of
  ``t`` cores: ``tabular.host_cores`` set to ``t`` while the source is made and read), ``source reads, pyarrow,
  t threads``: pyarrow's CPU pool of ``t`` threads (``pyarrow.set_cpu_count``), t = 1, 2, 4, ... cores;
- ``moments run``: ``ss.run(ss.Moments(), ParquetSource(..., decoder=...))``, decode to result.

``--parts``: where ``ParquetSource``'s Polars decode stops scaling, its parts timed apart on pools of 1 to all
cores' threads (``parts_main``). JSON: ``bench/results/decode_parts[_quick].json``.

``--csv``: a CSV file of the same rows with a string column (``python -m bench.decode --csv [--quick]``): each
library's own whole-file read (pyarrow on 1 thread and on its pool, Polars on its pool, of the float columns and
of the string column), and ``CsvSource(decoder=...)`` read step by step, floats and strings; MB: the file's bytes.
JSON: ``bench/results/decode_csv[_quick].json``.

Polars' own pool has ``POLARS_MAX_THREADS`` threads (default: the cores), fixed when it is imported: its rows
with ``t`` threads are ``t`` concurrent queries on that pool. JSON goes to ``bench/results/decode[_quick].json``
(``--out DIR``: there instead). With one of the two libraries installed the other's rows are left out (Polars
alone: no ``ParquetSource`` rows, which read through pyarrow). ``--only a,b``: only the rows whose names start so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import sharded_scan as ss
from sharded_scan.sources import CsvSource, ParquetSource, tabular
from sharded_scan.sources.tabular import host_cores

try:
    import polars as pl
except ImportError:  # pragma: no cover - the bench extra
    pl = None
try:
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq
except ImportError:  # pragma: no cover - the bench extra
    pa = pcsv = pq = None
if pl is None and pa is None:  # pragma: no cover
    raise SystemExit("neither polars nor pyarrow: pip install -e '.[fast]' (polars, pyarrow)")

COLUMNS = [f"f{i}" for i in range(8)]
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


GROUP_ROWS = 1 << 17


def write_file(path: str, rows: int) -> None:
    rng = np.random.default_rng(0)
    columns = {c: (rng.standard_normal(rows) + i).astype(np.float32) for i, c in enumerate(COLUMNS)}
    if pq is not None:
        pq.write_table(pa.table(columns), path, row_group_size=GROUP_ROWS)
    else:
        pl.DataFrame(columns).write_parquet(path, row_group_size=GROUP_ROWS)


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


def row_groups(path: str, rows: int) -> list[tuple[int, int]]:
    if pq is None:  # Polars alone: the groups write_file wrote
        return [(first, min(GROUP_ROWS, rows - first)) for first in range(0, rows, GROUP_ROWS)]
    meta = pq.ParquetFile(path).metadata
    at = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
    return [(int(at[g]), int(at[g + 1] - at[g])) for g in range(meta.num_row_groups)]


def pool_calls(path: str, rows: int, threads: list[int]) -> dict[str, Callable[[], object]]:
    groups = row_groups(path, rows)

    def arrow_group(g: int) -> object:
        return pq.ParquetFile(path).read_row_group(g, columns=COLUMNS, use_threads=False)

    def polars_group(g: int) -> object:
        first, rows = groups[g]
        return pl.scan_parquet(path).select(COLUMNS).slice(first, rows).collect()

    calls = {}
    for t in threads:
        pool = ThreadPoolExecutor(t)
        if pq is not None:
            calls[f"pyarrow row groups, {t} threads"] = lambda p=pool: list(p.map(arrow_group, range(len(groups))))
        if pl is not None:
            calls[f"polars row groups, {t} threads"] = lambda p=pool: list(p.map(polars_group, range(len(groups))))
    return calls


@contextlib.contextmanager
def threads_of(decoder: str, t: int | None) -> Iterator[None]:
    """``ParquetSource``'s decoding threads set to ``t`` (None: as they are): Polars' decoding pool sized as on a
    host of ``t`` cores (``tabular.host_cores``, which sizes the pool and how far it reads ahead), pyarrow's CPU
    pool of ``t`` threads (``pyarrow.set_cpu_count``); restored after."""
    if t is None:
        yield
        return
    cores, arrow_cpus = tabular.host_cores, pa.cpu_count()
    tabular.host_cores = lambda: t
    if decoder == "pyarrow":
        pa.set_cpu_count(t)
    try:
        yield
    finally:
        tabular.host_cores = cores
        pa.set_cpu_count(arrow_cpus)


def source_calls(path: str, decoders: list[str], threads: list[int], step: int) -> dict[str, Callable[[], object]]:
    """``source reads, {decoder}`` (the pools as they are) and ``source reads, {decoder}, {t} threads``."""
    calls = {}
    for d in decoders:
        for t in [None, *threads]:
            with threads_of(d, t):
                source = ParquetSource(path, columns=COLUMNS, decoder=d)

            def read(s: ParquetSource = source, d: str = d, t: int | None = t) -> None:
                with threads_of(d, t):
                    read_all(s, step)
            calls[f"source reads, {d}" + (f", {t} threads" if t else "")] = read
    return calls


def read_all(source: ParquetSource, step: int) -> None:
    source.seek(0)
    for start in range(0, source.num_rows, step):
        source.read(start, min(start + step, source.num_rows))


def ratio(a: float, b: float) -> str:
    """``a / b`` as ``1.23x``; ``-`` where ``b`` is 0 (a clock that ticks in 10 ms, as in gVisor's sandbox)."""
    return f"{a / b:.2f}x" if b > 0 else "-"


def write_json(out_dir: str, name: str, fields: dict, seconds: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, name)
    with open(out, "w") as f:
        kinds = ("wall", "cpu", "caller_cpu")
        json.dump({**fields, "machine": platform.machine(), "versions": versions(),
                   "seconds": {k: dict(zip(kinds, v, strict=True)) for k, v in seconds.items()}}, f, indent=1)
    print(f"wrote {out}")


def versions() -> dict[str, str]:
    return {name: module.__version__ for name, module in (("pyarrow", pa), ("polars", pl)) if module is not None}


def only(calls: dict[str, Callable[[], object]], prefixes: list[str] | None) -> dict[str, Callable[[], object]]:
    return {k: v for k, v in calls.items() if not prefixes or k.startswith(tuple(prefixes))}


def csv_main(rows: int, repeats: int, quick: bool, out_dir: str, prefixes: list[str] | None) -> None:
    """The ``--csv`` rows: each library's own read and ``CsvSource`` per decoder, numbers and strings."""
    cores = host_cores()
    decoders = [d for d, module in (("pyarrow", pa), ("polars", pl)) if module is not None and pa is not None]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "decode.csv")
        rng = np.random.default_rng(0)
        words = np.array(["Oslo", "Köln", "São Paulo", "New York, NY", "x" * 20], object)
        columns = {**{c: rng.standard_normal(rows).astype(np.float32) for c in COLUMNS},
                   "city": words[rng.integers(0, len(words), rows)]}
        if pl is not None:
            pl.DataFrame(columns).write_csv(path)
        else:
            pcsv.write_csv(pa.table({**columns, "city": pa.array(columns["city"], pa.string())}), path)
        megabytes = os.path.getsize(path) / 1e6
        step = 1 << 17
        sources = {(d, kind): CsvSource(path, columns=COLUMNS if kind == "floats" else "city", decoder=d)
                   for d in decoders for kind in ("floats", "strings")}
        calls = {}
        if pa is not None:
            calls |= {
                "pyarrow read_csv, 1 thread, floats": lambda: pcsv.read_csv(path, read_options=pcsv.ReadOptions(
                    use_threads=False), convert_options=pcsv.ConvertOptions(include_columns=COLUMNS)),
                f"pyarrow read_csv, {cores} threads, floats": lambda: pcsv.read_csv(
                    path, convert_options=pcsv.ConvertOptions(include_columns=COLUMNS)),
                "pyarrow read_csv, 1 thread, strings": lambda: pcsv.read_csv(path, read_options=pcsv.ReadOptions(
                    use_threads=False), convert_options=pcsv.ConvertOptions(include_columns=["city"])),
                f"pyarrow read_csv, {cores} threads, strings": lambda: pcsv.read_csv(
                    path, convert_options=pcsv.ConvertOptions(include_columns=["city"])),
            }
        if pl is not None:
            floats = {c: pl.Float64 for c in COLUMNS}
            calls |= {
                f"polars read_csv, {cores} threads, floats": lambda: pl.read_csv(path, columns=COLUMNS,
                                                                                schema_overrides=floats),
                f"polars read_csv, {cores} threads, strings": lambda: pl.read_csv(path, columns=["city"]),
            }
        calls |= {f"source reads, {d}, {kind}": (lambda s=s: read_all(s, step)) for (d, kind), s in sources.items()}
        calls = only(calls, prefixes)
        load = os.getloadavg()[0]
        seconds = timed(calls, repeats)
    print(f"{rows:,} rows x ({len(COLUMNS)} float32 + 1 string) as CSV ({megabytes:.0f} MB), {cores} cores, "
          f"load {load:.1f}, best of {repeats}, {versions()}")
    print_table(seconds, megabytes, 40)
    for kind in ("floats", "strings"):
        a, b = seconds.get(f"source reads, pyarrow, {kind}"), seconds.get(f"source reads, polars, {kind}")
        if a and b:
            print(f"  source reads, {kind}: polars {ratio(a[0], b[0])} the speed of pyarrow (wall), "
                  f"{ratio(a[1], b[1])} (CPU), {ratio(a[2], b[2])} (the reading thread's CPU)")
    write_json(out_dir, f"decode_csv{'_quick' if quick else ''}.json",
               {"rows": rows, "cores": cores, "load": load, "repeats": repeats}, seconds)


def parts_main(rows: int, repeats: int, quick: bool, out_dir: str) -> None:
    """``--parts``: where ``ParquetSource``'s Polars decode stops scaling. Every row group on a pool of ``t``
    threads, t = 1, 2, 4, ... cores, through each part of ``ParquetSource._decode``'s Arrow route in turn (the
    query; then ``to_arrow``; then ``_fill``'s cast into the rows' layout), the whole ``_decode`` (numbers: the
    query, then ``_fill_arrays``'s cast of Polars' own arrays), pyarrow's ``read_row_group``
    with the same cast, and two casts Polars makes itself (``DataFrame.to_numpy(order="c")``; each column's
    ``Series.to_numpy`` into one row-major array)."""
    if pl is None or pa is None:
        raise SystemExit("--parts needs both polars and pyarrow")
    cores = host_cores()
    threads = sorted({1, cores} | {t for t in (2, 4, 8, 16, 32, 64) if t < cores})
    megabytes = rows * len(COLUMNS) * 4 / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "decode.parquet")
        write_file(path, rows)
        source = ParquetSource(path, columns=COLUMNS, decoder="polars")
        spans, selection = source._spans, source._selection

        def query(g: int) -> object:
            _, first, n = spans[g]
            return pl.scan_parquet(path).select(COLUMNS).slice(first, n).collect()

        def arrow(g: int) -> object:
            return query(g).to_arrow(compat_level=pl.CompatLevel.oldest())

        def cast(table: object) -> list[np.ndarray]:
            out = selection.empty(table.num_rows)
            tabular._fill(table, selection, 0, path, out, 0)
            return out

        def by_columns(g: int) -> np.ndarray:
            frame = query(g)
            out = np.empty((frame.height, len(COLUMNS)), np.float32)
            for k, c in enumerate(COLUMNS):
                out[:, k] = frame.get_column(c).to_numpy()
            return out

        parts = {"query": query, "query + to_arrow": arrow, "query + to_arrow + cast": lambda g: cast(arrow(g)),
                 "ParquetSource._decode": source._decode,
                 "pyarrow read_row_group + cast": lambda g: cast(pq.ParquetFile(path).read_row_group(
                     g, columns=COLUMNS, use_threads=False)),
                 "query + to_numpy(order='c')": lambda g: query(g).to_numpy(order="c"),
                 "query + Series.to_numpy a column": by_columns}
        calls = {}
        for t in threads:
            pool = ThreadPoolExecutor(t)
            for name, part in parts.items():
                calls[f"{name}, {t} threads"] = lambda p=pool, f=part: list(p.map(f, range(len(spans))))
        for call in calls.values():
            call()  # warm
        load = os.getloadavg()[0]
        seconds = timed(calls, repeats)
    print(f"{rows:,} rows x {len(COLUMNS)} float32 ({megabytes:.0f} MB decoded), {cores} cores, load {load:.1f}, "
          f"best of {repeats}, {versions()}")
    print_table(dict(sorted(seconds.items(), key=lambda kv: list(parts).index(kv[0].rsplit(", ", 1)[0]))),
                megabytes, 44)
    write_json(out_dir, f"decode_parts{'_quick' if quick else ''}.json",
               {"rows": rows, "cores": cores, "load": load, "repeats": repeats}, seconds)


def print_table(seconds: dict, megabytes: float, width: int) -> None:
    """One line a call: wall, CPU and the calling thread's CPU seconds, MB/s, and MB/s a thread where the
    call's name says its threads (``"..., N thread(s)"``)."""
    print(f"  {'':<{width}}{'wall s':>8}{'CPU s':>8}{'caller s':>9}{'MB/s':>8}{'MB/s/thread':>13}")
    for name, (wall, cpu, caller) in seconds.items():
        t = next((int(part.split()[0]) for part in name.split(", ") if part.endswith(("thread", "threads"))), None)
        per = f"{megabytes / wall / t:13.0f}" if t else ""
        print(f"  {name:<{width}}{wall:8.3f}{cpu:8.3f}{caller:9.3f}{megabytes / wall:8.0f}{per}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2^19 rows, best of 3")
    parser.add_argument("--csv", action="store_true", help="CSV: pyarrow and Polars, CsvSource")
    parser.add_argument("--rows", type=int, help="rows of the file (default 4·10^6, CSV 10^6; quick 2^19)")
    parser.add_argument("--repeats", type=int, help="timed rounds (default 5; quick 3)")
    parser.add_argument("--out", default=RESULTS, help="the folder of the JSON (default bench/results)")
    parser.add_argument("--parts", action="store_true", help="the parts of ParquetSource's Polars decode on a pool")
    parser.add_argument("--only", help="comma-separated prefixes of the rows to time (default: every row)")
    args = parser.parse_args()
    rows = args.rows or (1 << 19 if args.quick else 1_000_000 if args.csv else 4_000_000)
    repeats = args.repeats or (3 if args.quick else 5)
    prefixes = args.only.split(",") if args.only else None
    if args.csv:
        return csv_main(rows, repeats, args.quick, args.out, prefixes)
    if args.parts:
        return parts_main(rows, repeats, args.quick, args.out)
    cores = host_cores()
    threads = sorted({1, cores} | {t for t in (2, 4, 8, 16, 32, 64) if t < cores})
    megabytes = rows * len(COLUMNS) * 4 / 1e6
    decoders = [d for d, module in (("pyarrow", pa), ("polars", pl)) if module is not None and pa is not None]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "decode.parquet")
        write_file(path, rows)
        step = 1 << 17
        calls = {}
        if pa is not None:
            calls["pyarrow read_table"] = lambda: pq.read_table(path, columns=COLUMNS)
        if pl is not None:
            calls["polars read_parquet"] = lambda: pl.read_parquet(path, columns=COLUMNS)
        if pa is not None:
            calls["pyarrow iter_batches"] = lambda: list(pq.ParquetFile(path, pre_buffer=True).iter_batches(
                1 << 17, columns=COLUMNS, use_threads=True))
        calls |= pool_calls(path, rows, threads)
        calls |= source_calls(path, decoders, threads, step)
        calls |= {f"moments run, {d}": (lambda d=d: ss.run(ss.Moments(), ParquetSource(path, columns=COLUMNS,
                                                                                       decoder=d)).mean)
                  for d in decoders}
        calls = only(calls, prefixes)
        answers = {d: calls[f"moments run, {d}"]() for d in decoders if f"moments run, {d}" in calls}  # warm
        if len(answers) == 2:
            np.testing.assert_array_equal(answers["pyarrow"], answers["polars"])
        load = os.getloadavg()[0]
        seconds = timed(calls, repeats)
    print(f"{rows:,} rows x {len(COLUMNS)} float32 ({megabytes:.0f} MB decoded), {cores} cores, load {load:.1f}, "
          f"best of {repeats}, {versions()}")
    print_table(seconds, megabytes, 36)
    for prefix in ("source reads", "moments run"):
        a, b = seconds.get(f"{prefix}, pyarrow"), seconds.get(f"{prefix}, polars")
        if a and b:
            serial = f", {ratio(a[2], b[2])} (the reading thread's CPU)" if prefix == "source reads" else ""
            print(f"  {prefix}: polars {ratio(a[0], b[0])} the speed of pyarrow (wall), {ratio(a[1], b[1])} "
                  f"(CPU){serial}")
    write_json(args.out, f"decode{'_quick' if args.quick else ''}.json",
               {"rows": rows, "cores": cores, "load": load, "repeats": repeats}, seconds)


if __name__ == "__main__":
    main()
