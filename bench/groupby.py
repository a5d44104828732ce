"""The GROUP BY rows of ``bench/run.py``: per-key statistics against pandas, Polars and DuckDB.

    python bench/groupby.py            # 10^6 rows, 1,000 keys with Zipf frequencies, best of 3
    python bench/groupby.py --quick    # 2^17 rows

Every caller gets the same rows: int32 keys (``launch.data.ZipfKeys``: key ``k`` about
``(k + 1)^-1.1`` as often as key 0) and ``(rows, 4)`` float32 values, and answers per key and
column: ``GroupBy(Sum())`` the sums and counts, ``GroupBy(Moments())`` the count, mean,
population variance, min and max (pandas ``groupby().agg``, Polars ``group_by().agg``, DuckDB
``GROUP BY`` with ``var_pop``). Error: the largest relative difference from pandas in float64
(every caller's own arithmetic; the others in float64 where they promote). Callers are timed in
turn, interleaved, best kept; compare ratios (the machine is shared).

Both sharded_scan rows are segment reductions per micro-batch (``Sum.add_keyed``,
``Moments.add_keyed``); bench/README.md has the figures of the last run.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # run alone: 8 simulated devices, like bench/run.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import jax

    jax.config.update("jax_num_cpu_devices", 8)

import argparse
import time
from collections.abc import Callable

import numpy as np
import pandas as pd

import sharded_scan as ss
from launch.data import ZipfKeys

KEYS = 1000
COLUMNS = 4
NAMES = [f"c{j}" for j in range(COLUMNS)]
STATS = ("count", "mean", "var", "min", "max")  # Moments' fields, in its order

try:
    import polars as pl
except ImportError:  # optional peers: their columns are left out
    pl = None
try:
    import duckdb
except ImportError:
    duckdb = None


def rows(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` Zipf keys below :data:`KEYS` and ``(n, COLUMNS)`` float32 normal values around 10."""
    keys = ZipfKeys(n, KEYS, seed=seed).read(0, n)
    x = np.random.default_rng(seed).normal(10, 2, size=(n, COLUMNS)).astype(np.float32)
    return keys, x


def frame(keys: np.ndarray, x: np.ndarray) -> pd.DataFrame:
    return pd.DataFrame({"k": keys, **{name: x[:, j] for j, name in enumerate(NAMES)}})


def stacked(table: pd.DataFrame, stats: tuple[str, ...]) -> np.ndarray:
    """``(KEYS, COLUMNS, len(stats))`` float64 from a table indexed by key with columns ``"c|stat"``."""
    table = table.reindex(range(KEYS))
    return np.array([[table[f"{c}|{s}"].to_numpy(np.float64) for s in stats] for c in NAMES]).transpose(2, 0, 1)


def pandas_groupby(df: pd.DataFrame, stats: tuple[str, ...]) -> np.ndarray:
    table = df.groupby("k")[NAMES].agg([(lambda v: v.var(ddof=0)) if s == "var" else s for s in stats])
    table.columns = [f"{c}|{s}" for c in NAMES for s in stats]
    return stacked(table, stats)


def polars_group_by(df: pl.DataFrame, stats: tuple[str, ...]) -> np.ndarray:
    exprs = [(pl.col(c).var(ddof=0) if s == "var" else getattr(pl.col(c), s)()).alias(f"{c}|{s}")
             for c in NAMES for s in stats]
    return stacked(df.group_by("k").agg(exprs).to_pandas().set_index("k"), stats)


SQL = {"count": "count({c})", "sum": "sum({c})", "mean": "avg({c})", "var": "var_pop({c})", "min": "min({c})",
       "max": "max({c})"}


def duckdb_group_by(df: pd.DataFrame, stats: tuple[str, ...]) -> np.ndarray:
    select = ", ".join(f'{SQL[s].format(c=c)} AS "{c}|{s}"' for c in NAMES for s in stats)
    return stacked(duckdb.query_df(df, "df", f"SELECT k, {select} FROM df GROUP BY k").df().set_index("k"), stats)


def callers(stats: tuple[str, ...], ours: ss.Combiner, keys: np.ndarray, x: np.ndarray) -> dict[str, Callable]:
    """Each caller of one workload on the same rows (each peer's frame built once, not timed):
    ``() -> (KEYS, COLUMNS, len(stats))`` float64."""
    df = frame(keys, x)

    def sharded_scan():
        r = ss.run(ours, (keys, x))
        fields = {"count": np.broadcast_to(r.rows[:, None], (KEYS, COLUMNS)),
                  **{s: getattr(r.result, s) for s in stats if s != "count"}}
        return np.stack([np.asarray(fields[s], np.float64) for s in stats], axis=-1)

    out = {"sharded_scan": sharded_scan, "pandas": lambda: pandas_groupby(df, stats)}
    if pl is not None:
        polars_frame = pl.from_pandas(df)
        out["polars"] = lambda: polars_group_by(polars_frame, stats)
    if duckdb is not None:
        out["duckdb"] = lambda: duckdb_group_by(df, stats)
    return out


WORKLOADS = {
    "groupby_sum": (("count", "sum"), ss.GroupBy(ss.Sum(), KEYS)),
    "groupby_moments": (STATS, ss.GroupBy(ss.Moments(), KEYS)),
}


def measure(name: str, n: int, repeats: int) -> dict:
    """One workload: every caller's answer scored once (also its warm-up), then timed interleaved."""
    stats, ours = WORKLOADS[name]
    keys, x = rows(n)
    want = pandas_groupby(frame(keys, x.astype(np.float64)), stats)  # the float64 reference
    present = ~np.isnan(want).any(axis=(1, 2))
    calls = callers(stats, ours, keys, x)
    errors = {}
    for caller, call in calls.items():
        got, ref = call()[present], want[present]
        errors[caller] = float(np.max(np.abs(got - ref) / np.maximum(np.abs(ref), 1e-30)))
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats):
        for caller, call in calls.items():
            start = time.perf_counter()
            call()
            best[caller] = min(best[caller], time.perf_counter() - start)
    rate = {caller: n / seconds for caller, seconds in best.items()}
    peers = {k: v for k, v in rate.items() if k != "sharded_scan"}
    best_peer = max(peers, key=peers.get)
    return {"workload": name, "rows": n, "keys": KEYS, "columns": COLUMNS, "seconds": best, "rows_per_second": rate,
            "error": errors, "best_peer": best_peer, "ratio": rate["sharded_scan"] / peers[best_peer]}


def table(results: list[dict]) -> str:
    """rows/s (millions) and the largest relative error of every caller, side by side."""
    lines = ["| workload | caller | Mrows/s | max rel. error vs pandas float64 | |", "|---|---|---|---|---|"]
    for r in results:
        for caller, rate in r["rows_per_second"].items():
            note = f"{r['ratio']:.2f}x {r['best_peer']}" if caller == "sharded_scan" else ""
            lines.append(f"| {r['workload']} ({r['rows']} rows, {r['keys']} keys) | {caller} | {rate / 1e6:.2f} | "
                         f"{r['error'][caller]:.1e} | {note} |")
    return "\n".join(lines)


def run(n: int, repeats: int, only: set[str] | None = None) -> list[dict]:
    """Every GROUP BY workload (those in ``only``), measured."""
    return [measure(name, n, repeats) for name in WORKLOADS if only is None or name in only]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2^17 rows, best of 2")
    parser.add_argument("--rows", type=int, help="rows (default 10^6)")
    parser.add_argument("--only", help="comma-separated workload names")
    args = parser.parse_args()
    results = run(args.rows or ((1 << 17) if args.quick else 10**6), 2 if args.quick else 3,
                  set(args.only.split(",")) if args.only else None)
    print(table(results))


if __name__ == "__main__":
    main()
