"""How accurate the analyzers are on data shaped like users' data, against exact numpy answers.

    python bench/sketches.py            # quantiles on 10^7 rows, 10^3..10^8 distinct values, Zipf 10^7 (~5 min)
    python bench/sketches.py --quick    # 10^6 rows, up to 10^6 distinct (~1 min)
    python bench/sketches.py --k 4096   # the quantile sketch at another size (its accuracy knob)

- Quantiles (default k): the largest normalized rank error over 2001 quantiles against
  the exact order statistics, on N(0,1), lognormal(sigma=2), Poisson(3) (int32, heavy
  ties), sorted, reverse-sorted and blocks of equal values (1000 runs), on 1 and 8
  devices and across a kill + resume on 8 devices (bitwise equal to the uninterrupted
  run?); then ``Quantiles(exact=True)``: equal to ``np.quantile(method="lower")``? in how
  many passes.
- DistinctCount (default precision 14, standard error 1.04/sqrt(2^14) = 0.81%): relative
  error at 10^3..10^8 distinct int32 ids (root mean square over 20 seeds up to 10^5, 10 at
  10^6, 3 at 10^7, 1 at 10^8) and at 10^3..10^7 float32 values.
- TopK (default capacity 4096): on Zipf(1.1) rows over 10^6 values, in random, sorted
  and reverse-sorted order, on 1 and 8 devices: the top 100 values and counts equal to
  the exact ones?

Prints the tables and writes ``bench/results/sketches[_quick].json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

import sharded_scan as ss  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
QS = np.linspace(0, 1, 2001)
SIGMA = 1.04 / np.sqrt(1 << 14)


def quantile_datasets(n: int, seed: int = 0):
    """The six shapes, one column each."""
    r = np.random.default_rng(seed)
    normal = r.standard_normal(n).astype(np.float32)
    yield "normal", normal
    yield "lognormal", r.lognormal(0, 2, n).astype(np.float32)
    yield "poisson", r.poisson(3, n).astype(np.int32)
    yield "sorted", np.sort(normal)
    yield "reversed", np.sort(normal)[::-1].copy()
    yield "blocks", np.repeat(r.standard_normal(1000).astype(np.float32), -(-n // 1000))[:n]


def max_rank_error(sorted_x: np.ndarray, got: np.ndarray, qs: np.ndarray) -> float:
    """The largest distance from ``q (n - 1)`` to the ranks ``got`` holds in the data, over ``n``."""
    below, upto = np.searchsorted(sorted_x, got, "left"), np.searchsorted(sorted_x, got, "right")
    target = qs * (len(sorted_x) - 1)
    return float(np.maximum(0, np.maximum(below - target, target - (upto - 1))).max() / len(sorted_x))


class InterruptError(Exception):
    pass


def interrupt_after(steps: int):
    def progress(p):
        if p.step == steps:
            raise InterruptError

    return progress


def quantiles(n: int, k: int) -> list[dict]:
    rows = []
    sketch = ss.Quantiles(qs=QS, k=k, method="lower")
    exact = ss.Quantiles(qs=np.linspace(0, 1, 11), k=k, exact=True, method="lower")
    kw = {"steps_per_call": 8}  # ~10 steps on 8 devices at 10^7 rows, so that a run can be cut short
    for name, x in quantile_datasets(n):
        sorted_x = np.sort(x.astype(np.float64))
        row = {"dataset": name, "rows": n, "k": k}
        for label, mesh in (("1 device", "data:1"), ("8 devices", "data:8")):
            start = time.perf_counter()
            got = ss.run(sketch, x, mesh=mesh, **kw)
            row[label] = {"max_rank_error": max_rank_error(sorted_x, got.quantiles, QS),
                          "bound_99": float(got.rank_error), "seconds": time.perf_counter() - start}
        with tempfile.TemporaryDirectory() as ck:
            with contextlib.suppress(InterruptError):
                ss.run(sketch, x, mesh="data:8", checkpoint=ss.CheckpointOptions(ck, every_steps=1),
                       progress=interrupt_after(3), **kw)
            resumed, report = ss.run_with_report(sketch, x, mesh="data:8", checkpoint=ck, **kw)
        uninterrupted = ss.run(sketch, x, mesh="data:8", **kw)
        row["kill + resume"] = {
            "max_rank_error": max_rank_error(sorted_x, resumed.quantiles, QS),
            "resumed_from_row": report.resumed_from_cursor,
            "bitwise_equal_to_uninterrupted": bool(np.array_equal(resumed.quantiles, uninterrupted.quantiles)),
        }
        start = time.perf_counter()
        got, _ = ss.run_with_report(exact, x, mesh="data:8")
        want = np.quantile(sorted_x, exact.qs, method="lower")
        row["exact"] = {"equal_to_numpy_lower": bool(np.array_equal(got.quantiles, want)), "passes": int(got.passes),
                        "seconds": time.perf_counter() - start}
        rows.append(row)
        print(f"  quantiles {name}: {row['8 devices']['max_rank_error']:.2e} (8 devices)", flush=True)
    return rows


def distinct_ids(count: int, seed: int) -> np.ndarray:
    """``count`` distinct int32 ids (an affine bijection of 0..count-1), each once, in random order."""
    r = np.random.default_rng(seed)
    a, b = np.uint32(r.integers(0, 2**31) * 2 + 1), np.uint32(r.integers(0, 2**32))
    with np.errstate(over="ignore"):
        return (np.arange(count, dtype=np.uint32) * a + b).view(np.int32)


def distinct(largest: int) -> list[dict]:
    rows = []
    counter = ss.DistinctCount(exact_up_to=0)  # the HyperLogLog estimate alone
    for exponent in range(3, int(np.log10(largest)) + 1):
        count = 10**exponent
        seeds = 20 if exponent <= 5 else (10 if exponent == 6 else (3 if exponent == 7 else 1))
        errors = []
        for seed in range(seeds):
            ids = distinct_ids(count, seed)
            if count <= 10**6:  # every id three times, shuffled: duplicates must not count
                ids = np.random.default_rng(seed).permutation(np.tile(ids, 3))
            errors.append(float(ss.run(counter, ids).count) / count - 1)
        rms = float(np.sqrt(np.mean(np.square(errors))))
        row = {"distinct": count, "kind": "int32 ids", "relative_errors": errors, "rms": rms,
               "max_over_sigma": float(np.max(np.abs(errors)) / SIGMA)}
        rows.append(row)
        if count <= 10**7:
            floats = np.random.default_rng(count).standard_normal(count).astype(np.float32)
            true = len(np.unique(floats))
            err = float(ss.run(counter, floats).count) / true - 1
            rows.append({"distinct": true, "kind": "float32 normals", "relative_errors": [err], "rms": abs(err),
                         "max_over_sigma": abs(err) / SIGMA})
        print(f"  distinct 1e{exponent}: rms {row['rms']:.2%}", flush=True)
    return rows


def zipf(n: int, universe: int = 10**6, seed: int = 0) -> np.ndarray:
    r = np.random.default_rng(seed)
    cdf = np.cumsum(1.0 / np.arange(1, universe + 1) ** 1.1)
    return r.permutation(universe).astype(np.int32)[np.searchsorted(cdf / cdf[-1], r.random(n))]


def topk(n: int, k: int = 100) -> list[dict]:
    x = zipf(n)
    values, counts = np.unique(x, return_counts=True)
    order = np.lexsort((values, -counts))[:k]
    want_values, want_counts = values[order].astype(np.float64), counts[order]
    rows = []
    for label, data in (("random", x), ("sorted", np.sort(x)), ("reversed", np.sort(x)[::-1].copy())):
        for mesh in ("data:1", "data:8"):
            start = time.perf_counter()
            got = ss.run(ss.TopK(k=k), data, mesh=mesh)
            rows.append({
                "order": label, "mesh": mesh, "rows": n, "k": k,
                "values_equal": bool(np.array_equal(got.values, want_values)),
                "counts_equal": bool(np.array_equal(got.counts, want_counts)),
                "max_error": int(got.errors.max()), "bound": int(got.bound), "certain": bool(got.certain),
                "seconds": time.perf_counter() - start,
            })
        print(f"  topk {label}: values equal {rows[-1]['values_equal']}", flush=True)
    return rows


def print_tables(report: dict) -> None:
    k = report["quantiles"][0]["k"]
    print(f"\nQuantiles: largest normalized rank error over 2001 quantiles (k={k})")
    print("| data | rows | 1 device | 8 devices | kill + resume (bitwise) | 99% bound | exact (passes) |")
    print("|---|---|---|---|---|---|---|")
    for r in report["quantiles"]:
        resume = r["kill + resume"]
        print(f"| {r['dataset']} | {r['rows']:.0e} | {r['1 device']['max_rank_error']:.1e} | "
              f"{r['8 devices']['max_rank_error']:.1e} | {resume['max_rank_error']:.1e} "
              f"({'yes' if resume['bitwise_equal_to_uninterrupted'] else 'NO'}) | {r['8 devices']['bound_99']:.1e} | "
              f"{'equal' if r['exact']['equal_to_numpy_lower'] else 'DIFFERENT'} ({r['exact']['passes']}) |")
    print(f"\nDistinctCount: relative error (default precision 14: standard error {SIGMA:.2%})")
    print("| distinct | values | runs | rms error | largest / sigma |")
    print("|---|---|---|---|---|")
    for r in report["distinct"]:
        print(f"| {r['distinct']:.3g} | {r['kind']} | {len(r['relative_errors'])} | {r['rms']:.2%} | "
              f"{r['max_over_sigma']:.2f} |")
    print("\nTopK: Zipf(1.1) over 10^6 values, top 100 (default capacity 4096)")
    print("| order | mesh | values exact | counts exact | largest error | certain |")
    print("|---|---|---|---|---|---|")
    for r in report["topk"]:
        print(f"| {r['order']} | {r['mesh']} | {r['values_equal']} | {r['counts_equal']} | {r['max_error']} | "
              f"{r['certain']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="10^6 rows, up to 10^6 distinct values")
    parser.add_argument("--k", type=int, default=8192, help="the quantile sketch's size (default 8192, its default)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args()
    rows, largest = (10**6, 10**6) if args.quick else (10**7, 10**8)
    started = time.perf_counter()
    report = {"command": " ".join(["python", "bench/sketches.py", *sys.argv[1:]]),
              "quantiles": quantiles(rows, args.k), "distinct": distinct(largest), "topk": topk(rows)}
    report["seconds"] = time.perf_counter() - started
    print_tables(report)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "sketches" + ("_quick" if args.quick else "") + ("" if args.k == 8192 else f"_k{args.k}")
    path = args.out / f"{stem}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {path} in {report['seconds']:.0f} s")


if __name__ == "__main__":
    main()
