"""TopK, DistinctCount or Moments of float64 columns under ``nan_policy="omit"`` beside ``"propagate"``: the run's
CPU seconds, in memory.

    python -m bench.nan_omit                        # 4·10^6 values (1% NaN, 0.1% inf), TopK(100), best of 3
    python -m bench.nan_omit --microbatch 16384     # a fixed micro-batch (default: the job's own)
    python -m bench.nan_omit --combiner distinct --columns 8 --exact-up-to 0   # DistinctCount(exact_up_to=0)
    python -m bench.nan_omit --combiner moments --rows 16000000 --columns 8   # Moments(), also "omit_rows"
    python -m bench.nan_omit --combiner moments --wrap groupby   # GroupBy(Moments(), 16) on (int32 key, X)
    PYTHONPATH=/work/main python bench/nan_omit.py  # another checkout's sharded_scan

Each policy runs once unmeasured (its compile), then ``--repeats`` times interleaved; a row is the least CPU seconds
of ``ss.run(combiner, x, nan_policy=...)`` (this process's, ``time.process_time``: what holds on a loaded
machine) and its wall seconds, and the ratio of omit's CPU to propagate's. The load (``os.getloadavg``) is printed.
``--columns d`` splits the ``--rows`` values into ``d`` columns (each its own draw), so every shape folds as many.
``--wrap``: the combiner in ``GroupBy(..., 16)`` (rows ``(key, X)``, int32 keys drawn uniformly) or ``Weighted``
(rows ``(w, X)``, weights uniform in [0, 1)). Moments runs ``"omit_rows"`` too.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import sharded_scan as ss


def column(rows: int, seed: int = 0) -> np.ndarray:
    """Zipf(1.1) float64 values over 10^5 ranks, 1% NaN and 0.1% +-inf spread at random."""
    r = np.random.default_rng(seed)
    universe = 100_000
    cdf = np.cumsum(1.0 / np.arange(1, universe + 1) ** 1.1)
    x = np.searchsorted(cdf / cdf[-1], r.random(rows)).astype(np.float64) * 0.5 - 1000.0
    x[r.random(rows) < 0.01] = np.nan
    x[r.random(rows) < 0.001] = np.inf * r.choice([-1.0, 1.0])
    return x


def combiner(name: str, exact_up_to: int | None) -> ss.Combiner:
    """``TopK(100)``, ``DistinctCount(exact_up_to=...)`` or ``Moments()``."""
    if name == "moments":
        return ss.Moments()
    return ss.TopK(100) if name == "topk" else ss.DistinctCount(exact_up_to=exact_up_to)


def wrapped(c: ss.Combiner, wrap: str | None, x: np.ndarray) -> tuple[ss.Combiner, object]:
    """``c`` and its data ``x`` as ``--wrap`` asks."""
    r = np.random.default_rng(99)
    if wrap == "groupby":
        return ss.GroupBy(c, 16), (r.integers(0, 16, len(x)).astype(np.int32), x)
    if wrap == "weighted":
        return ss.Weighted(c), (r.random(len(x)), x)
    return c, x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4_000_000, help="values in all (split over --columns)")
    parser.add_argument("--columns", type=int, default=1)
    parser.add_argument("--combiner", choices=("topk", "distinct", "moments"), default="topk")
    parser.add_argument("--wrap", choices=("groupby", "weighted"), default=None)
    parser.add_argument("--exact-up-to", type=int, default=None, help="DistinctCount's (default: its own)")
    parser.add_argument("--microbatch", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    n, d = args.rows // args.columns, args.columns
    x = column(n) if d == 1 else np.stack([column(n, seed) for seed in range(d)], axis=1)
    c, x = wrapped(combiner(args.combiner, args.exact_up_to), args.wrap, x)
    policies = ("propagate", "omit", "omit_rows") if args.combiner == "moments" else ("propagate", "omit")
    options = {p: ss.RunOptions(nan_policy=p, microbatch=args.microbatch) for p in policies}
    for p in policies:
        ss.run(c, x, options=options[p])  # compiled once, not measured
    best = {p: (np.inf, np.inf) for p in policies}
    for _ in range(args.repeats):
        for p in policies:
            cpu, wall = time.process_time(), time.perf_counter()
            ss.run(c, x, options=options[p])
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            best[p] = min(best[p], (cpu, wall))
    print(f"sharded_scan {ss.__file__}; load {os.getloadavg()[0]:.1f}; {c!r}; {n} rows x {d} columns, "
          f"microbatch {args.microbatch or 'default'}, best of {args.repeats}")
    for p in policies:
        print(f"  {p:9s} {best[p][0]:.3f} CPU-s  {best[p][1]:.3f} s")
    for p in policies[1:]:
        print(f"  {p} / propagate: {best[p][0] / best['propagate'][0]:.2f}x CPU")


if __name__ == "__main__":
    main()
