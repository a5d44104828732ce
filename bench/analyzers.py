"""The analyzer rows of ``bench/run.py``: quantiles, distinct counts and top-k against their peers.

Every caller gets the same ``(rows, 4)`` host array and returns per-column answers:

- quantiles (99 boundaries, ``num_buckets=100``) of N(0,1) float32: ``np.quantile`` and
  ``np.partition`` at the ranks (exact, in memory), ``dask.array.percentile`` (per-chunk
  percentiles merged); error: the largest normalized rank error.
- distinct counts of int32 ids (10^3 to ~rows distinct per column): ``pandas`` ``nunique``
  (hash table), ``np.unique`` (sort), dask's ``nunique_approx`` (HyperLogLog); error:
  the largest relative error.
- top 100 of Zipf(1.1) int32 ids: ``pandas`` ``value_counts``, ``np.unique`` counts,
  dask's ``value_counts().nlargest``; error: values listed that are not in a true top 100,
  plus the largest count error relative to the rows.

dask is used when it imports (``pip install "dask[array,dataframe]"``); without it its
column is left out.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np
import pandas as pd

import sharded_scan as ss

COLUMNS = 4
BUCKETS = 100
TOP = 100
DASK_CHUNKS = 16

try:
    import dask
    import dask.array as da
    import dask.dataframe as dd
except ImportError:  # dask is optional here
    dask = None


@dataclasses.dataclass
class Analyzer:
    """One row of the analyzer table: the data, each caller, and how to score an answer."""

    name: str
    x: np.ndarray
    calls: dict[str, Callable[[np.ndarray], np.ndarray]]
    error: Callable[[np.ndarray], float]
    error_name: str


# quantiles -------------------------------------------------------------------------------
def quantile_ranks(n: int) -> np.ndarray:
    return np.floor(np.arange(1, BUCKETS) / BUCKETS * (n - 1)).astype(np.int64)


def quantiles(rows: int) -> Analyzer:
    x = np.random.default_rng(0).standard_normal((rows, COLUMNS)).astype(np.float32)
    qs = np.arange(1, BUCKETS) / BUCKETS
    ordered = np.sort(x.astype(np.float64), axis=0)

    def rank_error(got: np.ndarray) -> float:
        worst = 0.0
        for j in range(COLUMNS):
            below = np.searchsorted(ordered[:, j], got[j], "left")
            upto = np.searchsorted(ordered[:, j], got[j], "right")
            target = qs * (rows - 1)
            worst = max(worst, float(np.maximum(0, np.maximum(below - target, target - (upto - 1))).max()))
        return worst / rows

    calls = {
        "sharded_scan": lambda x: ss.run(ss.Quantiles(num_buckets=BUCKETS), x).quantiles,
        "np.quantile": lambda x: np.quantile(x, qs, axis=0).T,
        "np.partition": lambda x: np.stack([np.partition(x[:, j], quantile_ranks(len(x)))[quantile_ranks(len(x))]
                                            for j in range(x.shape[1])]),
    }
    if dask is not None:
        def dask_percentile(x):
            xd = da.from_array(x, chunks=(-(-len(x) // DASK_CHUNKS), x.shape[1]))
            parts = [da.percentile(xd[:, j], qs * 100) for j in range(x.shape[1])]
            return np.stack(dask.compute(*parts, scheduler="threads"))

        calls["dask"] = dask_percentile
    return Analyzer(f"quantiles_d{COLUMNS}", x, calls, rank_error, "rank error")


# distinct counts ---------------------------------------------------------------------------
def distinct(rows: int) -> Analyzer:
    r = np.random.default_rng(1)
    cardinalities = [10**3, 10**5, max(rows // 4, 10**3), rows * 8]
    x = np.stack([r.integers(0, c, rows) for c in cardinalities], 1).astype(np.int32)
    want = np.array([len(np.unique(x[:, j])) for j in range(COLUMNS)])

    calls = {
        "sharded_scan": lambda x: ss.run(ss.DistinctCount(exact_up_to=0), x).count,  # the estimate alone
        "pandas": lambda x: pd.DataFrame(x).nunique().to_numpy(),
        "np.unique": lambda x: np.array([len(np.unique(x[:, j])) for j in range(x.shape[1])]),
    }
    if dask is not None:
        def dask_nunique_approx(x):
            frame = dd.from_pandas(pd.DataFrame(x), npartitions=DASK_CHUNKS)
            return np.array(dask.compute(*[frame[j].nunique_approx() for j in range(x.shape[1])], scheduler="threads"))

        calls["dask"] = dask_nunique_approx
    return Analyzer(f"distinct_d{COLUMNS}", x, calls, lambda got: float(np.max(np.abs(got / want - 1))),
                    "relative error")


# top-k -------------------------------------------------------------------------------------
def zipf_ids(rows: int, seed: int, universe: int = 10**6) -> np.ndarray:
    r = np.random.default_rng(seed)
    cdf = np.cumsum(1.0 / np.arange(1, universe + 1) ** 1.1)
    return r.permutation(universe).astype(np.int32)[np.searchsorted(cdf / cdf[-1], r.random(rows))]


def topk(rows: int) -> Analyzer:
    x = np.stack([zipf_ids(rows, seed) for seed in range(COLUMNS)], 1)
    truth = [pd.Series(x[:, j]).value_counts() for j in range(COLUMNS)]

    def error(got) -> float:
        """Listed values outside a true top 100 (ties count as in), plus the largest count error over rows."""
        values, counts = got
        wrong, worst = 0, 0.0
        for j, true in enumerate(truth):
            listed = true.reindex(values[j]).fillna(0).to_numpy()
            wrong += int(np.sum(listed < true.iloc[TOP - 1]))
            worst = max(worst, float(np.max(np.abs(listed - counts[j]))) / rows)
        return wrong + worst

    def ours(x):
        got = ss.run(ss.TopK(k=TOP), x)
        return got.values.astype(np.int64), got.counts

    def pandas_counts(x):
        tops = [pd.Series(x[:, j]).value_counts().head(TOP) for j in range(x.shape[1])]
        return np.stack([t.index.to_numpy() for t in tops]), np.stack([t.to_numpy() for t in tops])

    def numpy_counts(x):
        values, counts = [], []
        for j in range(x.shape[1]):
            v, c = np.unique(x[:, j], return_counts=True)
            top = np.argpartition(-c, TOP)[:TOP]
            values.append(v[top])
            counts.append(c[top])
        return np.stack(values), np.stack(counts)

    calls = {"sharded_scan": ours, "pandas": pandas_counts, "np.unique": numpy_counts}
    if dask is not None:
        def dask_counts(x):
            frame = dd.from_pandas(pd.DataFrame(x), npartitions=DASK_CHUNKS)
            tops = dask.compute(*[frame[j].value_counts().nlargest(TOP) for j in range(x.shape[1])],
                                scheduler="threads")
            return np.stack([t.index.to_numpy() for t in tops]), np.stack([t.to_numpy() for t in tops])

        calls["dask"] = dask_counts
    return Analyzer(f"topk{TOP}_d{COLUMNS}", x, calls, error, "wrong values + count error")


NAMES = {f"quantiles_d{COLUMNS}": quantiles, f"distinct_d{COLUMNS}": distinct, f"topk{TOP}_d{COLUMNS}": topk}


def make_analyzers(rows: int, only: set[str] | None = None) -> list[Analyzer]:
    """The analyzers named in ``only`` (all by default), on ``rows`` rows each."""
    return [make(rows) for name, make in NAMES.items() if only is None or name in only]


def measure(a: Analyzer, repeats: int) -> dict:
    """Scores every caller's answer (one warm-up run each), then times them interleaved."""
    errors = {name: a.error(call(a.x)) for name, call in a.calls.items()}
    best = dict.fromkeys(a.calls, float("inf"))
    for _ in range(repeats):
        for name, call in a.calls.items():
            start = time.perf_counter()
            call(a.x)
            best[name] = min(best[name], time.perf_counter() - start)
    rate = {name: len(a.x) / seconds for name, seconds in best.items()}
    peers = {k: v for k, v in rate.items() if k != "sharded_scan"}
    best_peer = max(peers, key=peers.get)
    return {
        "workload": a.name, "rows": len(a.x), "columns": a.x.shape[1], "seconds": best, "rows_per_second": rate,
        "error_name": a.error_name, "error": errors, "best_peer": best_peer,
        "ratio": rate["sharded_scan"] / peers[best_peer],
    }


def table(rows: list[dict]) -> str:
    """rows/s (millions) and the error of every caller, one line per analyzer."""
    lines = ["| analyzer | caller | Mrows/s | error | |", "|---|---|---|---|---|"]
    for r in rows:
        for caller, rate in r["rows_per_second"].items():
            note = f"{r['ratio']:.2f}x {r['best_peer']}" if caller == "sharded_scan" else ""
            lines.append(f"| {r['workload']} | {caller} | {rate / 1e6:.1f} | {r['error'][caller]:.2e} "
                         f"({r['error_name']}) | {note} |")
    return "\n".join(lines)
