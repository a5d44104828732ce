"""sharded_scan against what a data user picks on one machine, on the same Parquet file, in one process.

    python -m bench.tabular            # 4·10^6 rows (8 float32 + 3 int32 columns), best of 3
    python -m bench.tabular --quick    # 2^18 rows, best of 2 (a minute)
    python -m bench.tabular --devices 2   # simulated CPU devices (default: JAX's own, one on CPU)
    python -m bench.tabular --profile     # also sharded_scan's parts per row (profile())

Every caller reads the file itself (warm: the page cache holds it after the first call) and
returns per-column answers; the table prints seconds, each peer's ratio (its time over
sharded_scan's: > 1 means sharded_scan is faster) and each answer's error:

- moments (count, mean, var, min, max per float column: ``Moments(fields=...)``): DuckDB, Polars
  (``scan_parquet``), numpy on the table pyarrow read (``read_table``, then one array); also
  ``Moments()``, every field (its ratio: its seconds over the fields' run);
- covariance (8 x 8): DuckDB ``covar_samp`` of every pair, Polars ``pl.cov``, ``np.cov`` of the read table;
- quantiles (99 a float column): DuckDB ``approx_quantile`` (t-digest) and exact ``quantile_disc``,
  ``np.quantile`` of the read table, the ``datasketches`` KLL (``vector_of_kll_floats_sketches``,
  all columns at once) at its default k=200 and at the k whose rank error bound matches
  sharded_scan's; error: the largest normalized rank error;
- distinct counts (2 int32 id columns, 10^5 and ~rows/2 distinct; ``exact_up_to=0``, the estimate alone):
  DuckDB ``approx_count_distinct`` and ``count(DISTINCT)``, Polars ``approx_n_unique`` and ``n_unique``, and
  the default ``DistinctCount()``, exact while small (its ratio: its seconds over the estimate's); error: relative
  (``datasketches``' HLL takes one value per Python call: no vectorized update, so no peer);
- top-k (100 most frequent of a Zipf(1.1) int32 column): DuckDB ``GROUP BY`` + ``LIMIT``, Polars
  ``value_counts``, ``np.unique`` counts of the read column; error: true top-100 values missed.
- group-by (4 float columns by an int32 key of 1,000 Zipf(1.1) values, ``GroupBy(..., num_keys=1000, by=)``):
  sums and row counts, and count, mean, population variance, min, max (``GroupBy(Moments(fields=...))``; also
  ``GroupBy(Moments())``, every field); DuckDB ``GROUP BY``, Polars ``group_by().agg``; error: the largest
  relative difference from numpy in float64.

JSON goes to ``bench/results/tabular[_quick].json``.

Why the rows below 1.0x stay there (2·10^6 rows, 2 cores, one device unless said; ``--profile``,
process CPU seconds beside the wall's, ``perf record`` of runs, and ``jax.profiler`` traces of each
combiner's ``add`` over the same rows on one device):

- moments against Polars: the run is the read, and the read is pyarrow's decode. A moments run
  costs 0.156 CPU-s (wall 0.09 s) against Polars' whole query's 0.05 CPU-s (wall 0.027 s, load 2):
  ``ParquetSource``'s read 0.07-0.10 CPU-s, of which pyarrow's decode of the 8 columns alone is
  0.055 CPU-s (its scan or ``pq.read_table``; Polars' ``read_parquet`` of the same columns 0.031),
  the cast of 8 columns into one row-major ``(rows, 8)`` array 0.009-0.016 s; the steps 0.047
  CPU-s (wall 0.022-0.038 s); merge and set-up 0.004 s each. ``perf``: parquet/arrow decode 21%
  of the samples (dictionary-encoded floats, definition levels of the nullable columns), the
  kernel's copies of the file's pages 7%, the cast (numpy's strided copy) 8%, XLA's step code 20%,
  Python 13%. The decode alone costs more CPU than Polars' query, so no change to the compute
  reaches it while the rows come through pyarrow. Tried, no gain: a mask-free ``Moments`` add for
  micro-batches of real rows only (the step already runs such micro-batches with a constant mask
  XLA folds away: 0.30-0.34 against 0.31-0.32 ms a micro-batch); its reductions as separate, flat,
  pairwise-halving or transposed reductions (0.15-0.44 against 0.13-0.25 ms: XLA:CPU's variadic
  reduce of 32 x 8 lanes stays best); Polars as the decoder (a row group a read: 0.042 against 0.056
  CPU-s, but with no read-ahead 0.067 against 0.060 s wall with the cast; a slice a step decodes
  each row group twice); 2 simulated devices instead of one (the same within noise on these three
  rows: the bench now runs what a user's process gets); fewer steps (16 instead of 31: 0.145
  against 0.159 CPU-s at load 6.5; the step cap, ``layout.MIN_JOB_STEPS``, keeps reads hidden on
  larger jobs, left as it is); a memory-mapped file decodes 1.4x faster (0.024 against 0.034 s)
  but a file rewritten in place during a mapped read ends the process with SIGBUS instead of one line.
- covariance against Polars: at or above 1.0x under load (Polars' 36 ``pl.cov`` pairs cost 0.13-0.14
  CPU-s, as much as the run), below it on an idle machine, where Polars' two threads finish first
  (0.72x at load 1.4). Its steps got 1.2x faster (``statistics.column_sum``: XLA:CPU vectorizes a
  column sum of 8-wide rows along the columns only; the steps 0.028 -> 0.023 s wall best of 25,
  0.030 -> 0.026 CPU-s median, at load 13); the read is moments'.
- quantiles against DuckDB ``approx_quantile`` and the KLL at k=200: the steps are 0.62-0.65 s of
  0.65-0.71 s on one device; 80% of the KLL ``add`` is XLA:CPU sorts (each 16384-row micro-batch per
  column, 68%; the moves' windows, 12%, since a move sorts a window of ``k`` slots where its items
  fit: ``kll.window_sizes``, the add 6.3 -> 4.9 ms CPU). Both peers answer at 2.6x and 33-45x
  sharded_scan's rank error; at equal error (the KLL at k≈5800-7000) sharded_scan is 1.13-1.17x on
  one device. DESIGN.md ("Decisions, measured") lists the levers tried (numpy's sort on the host through a callback: 5x
  faster steps, but it hung on 2 devices).
- distinct counts against the approximate DuckDB and Polars counts: a run of 0.04-0.06 s is the
  read (0.022-0.03 s: pyarrow's decode of the two id columns alone 0.017 CPU-s, as much as Polars'
  whole ``approx_n_unique`` query, 0.013-0.023 s), the steps (0.011-0.015 s: hashing and one
  scatter-max a micro-batch), the merge and finalize (0.003-0.004 s) and the run's set-up (0.003
  s): its fixed parts alone are half the peers' query. 31 steps instead of 16 cost it 0.057
  against 0.047 CPU-s (load 6.5; the step cap above).
- top-100 against DuckDB, Polars and numpy: the steps are 0.09-0.10 s of 0.12-0.16 s (before: 0.124-0.131
  s of 0.16-0.17 s; both before hashing: ``TopK`` now counts a 16384-row micro-batch by hashing,
  ``keys.first_rows``, its ``add`` 1.6-1.9x faster); per micro-batch ``TopK`` sorted 16384 keys (0.41 ms,
  half of its ``add``) and keeps
  the 4096 largest of 20480 candidates with no sort (``topk._select``: guessed thresholds checked by
  two counts each, one running sum to rank the chosen; it was ``lax.top_k``, 0.40 ms); sorting once
  per step instead would sort as many keys (n log n does not shrink); the peers count the 2·10^6 ids
  in one hash aggregation (exact, in memory), about as fast as the sort alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import sharded_scan as ss
from bench.tuning import interleaved_best
from sharded_scan.engine import run_program
from sharded_scan.group_keys import grouped_source
from sharded_scan.prefetch import place, read_local
from sharded_scan.program import build_program
from sharded_scan.sharding import to_host
from sharded_scan.sources import ParquetSource

FLOATS = [f"f{i}" for i in range(8)]
IDS = ["few", "many"]
ZIPF = "zipf"
GROUP, GROUPS, GROUPED = "g", 1000, FLOATS[:4]  # the group-by rows: 4 float columns by 1,000 Zipf keys
QS = np.arange(1, 100) / 100
TOP = 100
# No --devices: JAX's own CPU device count (one device), what `ss.run` gets in a user's process;
# sharded_scan does not set it (a process-wide JAX flag, fixed before the backend starts).
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

try:
    import duckdb
    import polars as pl
    from datasketches import kll_floats_sketch, vector_of_kll_floats_sketches
except ImportError as e:  # pragma: no cover - the bench extra
    raise SystemExit(f"{e}: pip install -e '.[bench]' (duckdb, polars, datasketches)") from None


def write_file(path: str, rows: int) -> None:
    """``rows`` rows: 8 N(0,1)+column float32 columns, ids with 10^5 and rows/2 values, Zipf ids."""
    rng = np.random.default_rng(0)
    columns = {name: (rng.standard_normal(rows) + i).astype(np.float32) for i, name in enumerate(FLOATS)}
    columns["few"] = rng.integers(0, 100_000, rows, dtype=np.int32)
    columns["many"] = rng.integers(0, max(rows // 2, 1), rows, dtype=np.int32)
    columns[ZIPF] = np.minimum(rng.zipf(1.1, rows), 2**31 - 1).astype(np.int32)
    weights = np.arange(1, GROUPS + 1) ** -1.1
    columns[GROUP] = np.searchsorted(np.cumsum(weights / weights.sum()), rng.random(rows)).clip(0, GROUPS - 1
                                                                                             ).astype(np.int32)
    pq.write_table(pa.table(columns), path, row_group_size=1 << 17)


def read_columns(path: str, names: list[str]) -> np.ndarray:
    """numpy on the read table: pyarrow reads, then one (rows, k) array."""
    table = pq.read_table(path, columns=names)
    return np.stack([table.column(n).to_numpy() for n in names], axis=1)


def duck(sql: str, path: str) -> list:
    return duckdb.sql(sql.replace("FILE", f"read_parquet('{path}')")).fetchall()


# the rows -------------------------------------------------------------------------------
# sharded_scan's combiner and columns for each row.
# moments: the fields the peers compute (Moments(fields=...): no third and fourth moments, zeros or norms).
MOMENT_FIELDS = ("mean", "var", "min", "max")
OURS = {"moments": (ss.Moments(fields=MOMENT_FIELDS), FLOATS), "covariance": (ss.Covariance(), FLOATS),
        "quantiles": (ss.Quantiles(num_buckets=100), FLOATS), "distinct": (ss.DistinctCount(exact_up_to=0), IDS),
        "topk": (ss.TopK(k=TOP), ZIPF),
        "groupby_sum": (ss.GroupBy(ss.Sum(), GROUPS, by=GROUP), [GROUP, *GROUPED]),
        "groupby_moments": (ss.GroupBy(ss.Moments(fields=MOMENT_FIELDS), GROUPS, by=GROUP), [GROUP, *GROUPED])}


def run_ours(path: str, row: str) -> Any:
    combiner, columns = OURS[row]
    return ss.run(combiner, ParquetSource(path, columns=columns))


def moments(path: str) -> dict[str, Callable[[], np.ndarray]]:
    """Each caller's means (what the error compares)."""
    agg = ", ".join(f"avg({c}), var_pop({c}), min({c}), max({c})" for c in FLOATS)

    def numpy_moments():
        x = read_columns(path, FLOATS)
        return np.stack([x.mean(0), x.var(0), x.min(0), x.max(0)])[0]

    return {
        "sharded_scan": lambda: run_ours(path, "moments").mean,
        "sharded_scan, all fields": lambda: ss.run(ss.Moments(), ParquetSource(path, columns=FLOATS)).mean,
        "duckdb": lambda: np.array(duck(f"SELECT {agg} FROM FILE", path)[0][0::4]),
        "polars": lambda: pl.scan_parquet(path).select(
            [pl.col(c).mean() for c in FLOATS] + [pl.col(c).var(ddof=0).alias(f"v{c}") for c in FLOATS]
            + [pl.col(c).min().alias(f"lo{c}") for c in FLOATS] + [pl.col(c).max().alias(f"hi{c}") for c in FLOATS]
        ).collect().to_numpy()[0, :8],
        "numpy": numpy_moments,
    }


def covariance(path: str) -> dict[str, Callable[[], np.ndarray]]:
    pairs = [(a, b) for i, a in enumerate(FLOATS) for b in FLOATS[i:]]

    def square(values):
        out = np.empty((8, 8))
        for (a, b), v in zip(pairs, values, strict=True):
            out[FLOATS.index(a), FLOATS.index(b)] = out[FLOATS.index(b), FLOATS.index(a)] = v
        return out

    sql = "SELECT " + ", ".join(f"covar_samp({a}, {b})" for a, b in pairs) + " FROM FILE"
    return {
        "sharded_scan": lambda: run_ours(path, "covariance").cov,
        "duckdb": lambda: square(duck(sql, path)[0]),
        "polars": lambda: square(pl.scan_parquet(path).select(
            [pl.cov(a, b).alias(f"{a}_{b}") for a, b in pairs]).collect().to_numpy()[0]),
        "numpy": lambda: np.cov(read_columns(path, FLOATS), rowvar=False),
    }


def kll_k_for(rank_error: float) -> int:
    """The smallest KLL k whose (single-quantile, 99%) rank error bound is at most ``rank_error``."""
    k = 8
    while kll_floats_sketch.get_normalized_rank_error(k, False) > rank_error and k < 1 << 16:
        k = int(k * 1.05) + 1
    return k


def ours_k_for(path: str, rank_error: float) -> tuple[int, float]:
    """The smallest power-of-two ``Quantiles`` k whose result's rank error bound on this file is at most
    ``rank_error`` (the default k at most), and that bound: sharded_scan at a peer's accuracy."""
    k = 64
    while True:
        result = ss.run(ss.Quantiles(num_buckets=100, k=k), ParquetSource(path, columns=FLOATS))
        bound = float(np.max(result.rank_error))
        if bound <= rank_error or k >= ss.Quantiles(num_buckets=100).k:
            return k, bound
        k *= 2


def datasketches_kll(path: str, k: int) -> np.ndarray:
    sketches = vector_of_kll_floats_sketches(k, len(FLOATS))
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1 << 17, columns=FLOATS):
        sketches.update(np.stack([c.to_numpy() for c in batch.columns], axis=1))
    return np.asarray(sketches.get_quantiles(QS))


def quantiles(path: str, equal_error_k: int, small_k: int) -> dict[str, Callable[[], np.ndarray]]:
    """(8, 99) answers; ``small_k``: sharded_scan's k at the KLL k=200's error (:func:`ours_k_for`)."""
    qlist = "[" + ", ".join(f"{q:.2f}" for q in QS) + "]"
    return {
        "sharded_scan": lambda: run_ours(path, "quantiles").quantiles,
        f"sharded_scan, k={small_k}": lambda: ss.run(ss.Quantiles(num_buckets=100, k=small_k),
                                                    ParquetSource(path, columns=FLOATS)).quantiles,
        "duckdb approx": lambda: np.array(duck("SELECT " + ", ".join(
            f"approx_quantile({c}, {qlist})" for c in FLOATS) + " FROM FILE", path)[0]),
        "duckdb exact": lambda: np.array(duck("SELECT " + ", ".join(
            f"quantile_disc({c}, {qlist})" for c in FLOATS) + " FROM FILE", path)[0]),
        "numpy": lambda: np.quantile(read_columns(path, FLOATS), QS, axis=0, method="lower").T,
        "datasketches k=200": lambda: datasketches_kll(path, 200),
        f"datasketches k={equal_error_k}": lambda: datasketches_kll(path, equal_error_k),
    }


def distinct(path: str) -> dict[str, Callable[[], np.ndarray]]:
    return {
        "sharded_scan": lambda: run_ours(path, "distinct").count,
        "sharded_scan, exact first": lambda: ss.run(ss.DistinctCount(), ParquetSource(path, columns=IDS)).count,
        "duckdb approx": lambda: np.array(duck("SELECT " + ", ".join(
            f"approx_count_distinct({c})" for c in IDS) + " FROM FILE", path)[0]),
        "duckdb exact": lambda: np.array(duck("SELECT " + ", ".join(
            f"count(DISTINCT {c})" for c in IDS) + " FROM FILE", path)[0]),
        "polars approx": lambda: pl.scan_parquet(path).select(
            [pl.col(c).approx_n_unique() for c in IDS]).collect().to_numpy()[0],
        "polars exact": lambda: pl.scan_parquet(path).select(
            [pl.col(c).n_unique() for c in IDS]).collect().to_numpy()[0],
    }


def top_k(path: str) -> dict[str, Callable[[], np.ndarray]]:
    """The values of the top ``TOP``."""

    def numpy_top():
        values, counts = np.unique(pq.read_table(path, columns=[ZIPF]).column(0).to_numpy(), return_counts=True)
        return values[np.argsort(-counts, kind="stable")[:TOP]]

    return {
        "sharded_scan": lambda: run_ours(path, "topk").values,
        "duckdb": lambda: np.array([r[0] for r in duck(
            f"SELECT {ZIPF}, count(*) AS n FROM FILE GROUP BY {ZIPF} ORDER BY n DESC LIMIT {TOP}", path)]),
        "polars": lambda: pl.scan_parquet(path).select(pl.col(ZIPF).value_counts(sort=True).head(TOP)).unnest(
            ZIPF).collect()[ZIPF].to_numpy(),
        "numpy": numpy_top,
    }


GROUP_STATS = {"groupby_sum": ("count", "sum"), "groupby_moments": ("count", "mean", "var", "min", "max")}
SQL = {"count": "count({c})", "sum": "sum({c})", "mean": "avg({c})", "var": "var_pop({c})", "min": "min({c})",
       "max": "max({c})"}


def group_by(path: str, row: str) -> dict[str, Callable[[], np.ndarray]]:
    """Per key and column, each statistic: ``(GROUPS, 4, stats)`` float64 (keys of no rows: NaN)."""
    stats = GROUP_STATS[row]

    def table(keys: np.ndarray, columns: dict) -> np.ndarray:
        out = np.full((GROUPS, len(GROUPED), len(stats)), np.nan)
        for (c, s), values in columns.items():
            out[np.asarray(keys, np.int64), GROUPED.index(c), stats.index(s)] = values
        return out

    def ours(combiner=None):
        r = run_ours(path, row) if combiner is None else ss.run(combiner, ParquetSource(path, columns=OURS[row][1]))
        fields = {"count": np.broadcast_to(r.rows[:, None], (GROUPS, len(GROUPED))),
                  **{s: np.asarray(getattr(r, s), np.float64) for s in stats if s != "count"}}
        return np.stack([np.asarray(fields[s], np.float64) for s in stats], axis=-1)

    def duckdb_group_by():
        select = ", ".join(SQL[s].format(c=c) for c in GROUPED for s in stats)
        rows = np.array(duck(f"SELECT {GROUP}, {select} FROM FILE GROUP BY {GROUP}", path), np.float64)
        return table(rows[:, 0], {(c, s): rows[:, 1 + i * len(stats) + j] for i, c in enumerate(GROUPED)
                                  for j, s in enumerate(stats)})

    def polars_group_by():
        exprs = [(pl.col(c).var(ddof=0) if s == "var" else pl.len() if s == "count" else getattr(pl.col(c), s)()
                  ).alias(f"{c}|{s}") for c in GROUPED for s in stats]
        got = pl.scan_parquet(path).group_by(GROUP).agg(exprs).collect()
        return table(got[GROUP].to_numpy(), {(c, s): got[f"{c}|{s}"].to_numpy() for c in GROUPED for s in stats})

    every = {"sharded_scan, all fields": lambda: ours(ss.GroupBy(ss.Moments(), GROUPS, by=GROUP))} if (
        row == "groupby_moments") else {}
    return {"sharded_scan": ours, **every, "duckdb": duckdb_group_by, "polars": polars_group_by}


def per_key(path: str, row: str) -> Callable[[np.ndarray], float]:
    """The largest relative difference from numpy's float64 statistics per key (keys present)."""
    stats, x = GROUP_STATS[row], read_columns(path, [GROUP, *GROUPED]).astype(np.float64)
    keys, x = x[:, 0].astype(np.int64), x[:, 1:]
    order = np.argsort(keys, kind="stable")
    starts = np.searchsorted(keys[order], np.arange(GROUPS))
    present = np.bincount(keys, minlength=GROUPS) > 0
    parts = {"count": lambda v: np.full(v.shape[1], len(v)), "sum": lambda v: v.sum(0), "mean": lambda v: v.mean(0),
             "var": lambda v: v.var(0), "min": lambda v: v.min(0), "max": lambda v: v.max(0)}
    want = np.full((GROUPS, len(GROUPED), len(stats)), np.nan)
    for k, rows in enumerate(np.split(x[order], starts[1:])):
        if present[k]:
            want[k] = np.stack([parts[s](rows) for s in stats], axis=-1)

    def error(got: np.ndarray) -> float:
        got, ref = np.asarray(got)[present], want[present]
        return float(np.max(np.abs(got - ref) / np.maximum(np.abs(ref), 1e-30)))

    return error


# errors ---------------------------------------------------------------------------------
def rank_error(ordered: np.ndarray) -> Callable[[np.ndarray], float]:
    n = len(ordered)

    def error(got: np.ndarray) -> float:
        got, worst = np.asarray(got, np.float64).reshape(len(FLOATS), -1), 0.0
        for j in range(len(FLOATS)):
            below = np.searchsorted(ordered[:, j], got[j], "left")
            upto = np.searchsorted(ordered[:, j], got[j], "right") - 1
            target = QS * (n - 1)
            worst = max(worst, float(np.maximum(0, np.maximum(below - target, target - upto)).max()))
        return worst / n

    return error


def relative(want: np.ndarray) -> Callable[[np.ndarray], float]:
    return lambda got: float(np.abs(np.asarray(got, np.float64) - want).max() / max(np.abs(want).max(), 1e-30))


def measure(name: str, calls: dict[str, Callable[[], Any]], error: Callable[[Any], float], repeats: int,
            parts: Callable[[], dict] | None = None) -> dict:
    """The row's seconds, ratios and errors; ``parts``: sharded_scan's :func:`profile`, when asked."""
    errors = {caller: error(call()) for caller, call in calls.items()}  # warm: compiled, file cached
    cpu: dict[str, float] = {}
    seconds = interleaved_best(calls, repeats, cpu)
    ours = seconds["sharded_scan"]
    out = {"row": name, "seconds": seconds, "cpu": cpu, "error": errors,
           "ratio": {c: t / ours for c, t in seconds.items() if c != "sharded_scan"}}
    return out if parts is None else {**out, "profile": parts()}


def profile(path: str, row: str, repeats: int) -> dict[str, float]:
    """Where sharded_scan's seconds go on ``row`` (best of ``repeats`` each, the parts timed apart): the whole
    ``run``; every step's rows read from the file (``read``: Parquet decode and the cast into rows)
    and placed on the devices (``place``); the compiled steps alone on the placed rows (``steps``);
    the merge and ``finalize`` (``merge``); the run's own set-up (``build``: spec checks, admission,
    fingerprint). The run overlaps reads with steps on the same cores, so the parts add up to more."""
    combiner, columns = OURS[row]
    combiner, source = grouped_source(combiner, ParquetSource(path, columns=columns))  # GroupBy by= a column
    options = ss.RunOptions.make(None)
    program = build_program(combiner, source, options)
    layout = program.layout
    cursors = range(0, layout.num_rows, layout.rows_per_step)
    host = [read_local(source, layout, c) for c in cursors]
    placed = [place(h, layout, program.mesh) for h in host]

    def steps():
        partials = program.init()
        for c, batch in zip(cursors, placed, strict=True):
            partials = program.step(partials, batch, min(layout.rows_per_step, layout.num_rows - c))
        return jax.block_until_ready(partials)

    partials = steps()
    cpu: dict[str, float] = {}
    seconds = interleaved_best({
        "run": lambda: run_program(program, source),
        "build": lambda: build_program(combiner, source, options),
        "read": lambda: [read_local(source, layout, c) for c in cursors],
        "place": lambda: jax.block_until_ready([place(h, layout, program.mesh) for h in host]),
        "steps": steps,
        "merge": lambda: program.finalize(to_host(program.merge(partials))),
    }, repeats, cpu)
    return {**seconds, "cpu": cpu, "num_steps": len(cursors), "microbatch": layout.microbatch,
            "steps_per_call": layout.steps_per_call}


def print_row(r: dict) -> None:
    print(f"\n{r['row']}  (ratio: peer seconds / sharded_scan seconds; > 1: sharded_scan faster)")
    for caller, t in r["seconds"].items():
        ratio = "" if caller == "sharded_scan" else f"{r['ratio'][caller]:7.2f}x"
        print(f"  {caller:<24}{t:9.3f} s  {ratio:>8}   CPU {r['cpu'][caller]:6.3f} s   error {r['error'][caller]:.2g}")
    if "profile" in r:
        p = r["profile"]
        print(f"  sharded_scan's parts: {p['num_steps']} steps of {p['steps_per_call']} x {p['microbatch']} rows a "
              "shard; " + ", ".join(f"{k} {p[k]:.3f} s" for k in ("run", "read", "place", "steps", "merge", "build")))
        print("  their CPU seconds (every thread's): " + ", ".join(f"{k} {p['cpu'][k]:.3f}" for k in (
            "run", "read", "place", "steps", "merge", "build")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2^18 rows, best of 2")
    parser.add_argument("--rows", type=int, help="rows of the file (default 4·10^6; quick 2^18)")
    parser.add_argument("--repeats", type=int, help="timed rounds (default 3; quick 2)")
    parser.add_argument("--only", help="comma-separated rows: moments,covariance,quantiles,distinct,topk,"
                        "groupby_sum,groupby_moments")
    parser.add_argument("--profile", action="store_true", help="also time sharded_scan's parts (profile())")
    parser.add_argument("--devices", type=int, help="simulated CPU devices (default: JAX's, what a user's run gets)")
    args = parser.parse_args()
    if args.devices:
        jax.config.update("jax_num_cpu_devices", args.devices)  # before the backend starts
    rows, repeats = args.rows or ((1 << 18) if args.quick else 4_000_000), args.repeats or (2 if args.quick else 3)
    only = set(args.only.split(",")) if args.only else {"moments", "covariance", "quantiles", "distinct", "topk",
                                                        "groupby_sum", "groupby_moments"}
    out = []
    with tempfile.TemporaryDirectory(prefix="bench-tabular-") as tmp:
        path = os.path.join(tmp, "table.parquet")
        write_file(path, rows)
        print(f"{rows} rows, {os.path.getsize(path) / 2**20:.0f} MiB Parquet; {jax.device_count()} devices, "
              f"{os.cpu_count()} cores; best of {repeats}", flush=True)
        floats = read_columns(path, FLOATS).astype(np.float64)

        def parts(row: str) -> Callable[[], dict] | None:
            return (lambda: profile(path, row, repeats)) if args.profile else None

        if "moments" in only:
            out.append(measure("moments (8 columns)", moments(path), relative(floats.mean(0)), repeats,
                               parts("moments")))
        if "covariance" in only:
            out.append(measure("covariance (8 x 8)", covariance(path), relative(np.cov(floats, rowvar=False)),
                               repeats, parts("covariance")))
        if "quantiles" in only:
            ours = run_ours(path, "quantiles")
            k = kll_k_for(float(np.max(ours.rank_error)))
            small_k, small_bound = ours_k_for(path, kll_floats_sketch.get_normalized_rank_error(200, False))
            out.append(measure(f"quantiles (99 a column; sharded_scan's bound {np.max(ours.rank_error):.2g}, "
                               f"datasketches k={k} for it; at k={small_k} {small_bound:.2g}, the KLL k=200's "
                               f"{kll_floats_sketch.get_normalized_rank_error(200, False):.2g})",
                               quantiles(path, k, small_k), rank_error(np.sort(floats, 0)), repeats,
                               parts("quantiles")))
        if "distinct" in only:
            ids = read_columns(path, IDS)
            want = np.array([len(np.unique(ids[:, j])) for j in range(len(IDS))], np.float64)
            out.append(measure("distinct counts (2 id columns)", distinct(path), relative(want), repeats,
                               parts("distinct")))
        if "topk" in only:
            values, counts = np.unique(pq.read_table(path, columns=[ZIPF]).column(0).to_numpy(), return_counts=True)
            true_top = set(values[np.argsort(-counts, kind="stable")[:TOP]].tolist())
            missed = lambda got: float(TOP - len(true_top & set(np.asarray(got).ravel().tolist())))  # noqa: E731
            out.append(measure(f"top-{TOP} (Zipf 1.1)", top_k(path), missed, repeats, parts("topk")))
        for row in ("groupby_sum", "groupby_moments"):
            if row in only:
                out.append(measure(f"{row} (4 columns by {GROUPS} Zipf keys)", group_by(path, row),
                                   per_key(path, row), repeats, parts(row)))
    for r in out:
        print_row(r)
    os.makedirs(RESULTS, exist_ok=True)
    target = os.path.join(RESULTS, "tabular_quick.json" if args.quick else "tabular.json")
    with open(target, "w") as f:
        json.dump({"command": " ".join(["python -m bench.tabular", *sys.argv[1:]]), "rows": rows,
                   "repeats": repeats, "machine": {"cpus": os.cpu_count(), "devices": jax.device_count(),
                                                   "platform": platform.platform(), "host": platform.node()},
                   "jax": jax.__version__, "results": out, "written": time.strftime("%Y-%m-%d %H:%M")}, f, indent=1)
    print(f"\nwrote {target}")


if __name__ == "__main__":
    main()
