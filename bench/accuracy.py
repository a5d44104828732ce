"""Accuracy against certified references and peers, and what accuracy costs.

    python bench/accuracy.py            # the full run (~6 min on 2 cores)
    python bench/accuracy.py --quick    # smaller compensation and speed workloads

Prints, and writes to bench/results/accuracy.json:

1. LRE (correct significant digits, McCullough 1998) on NIST StRD Longley, Wampler1,
   Wampler2 (regression coefficients) and NumAcc1-4 (mean, sd), float64 (under x64, in a
   subprocess) and float32, for every LinearRegression solver side by side with numpy
   ``lstsq``, scikit-learn, statsmodels and scipy's LAPACK ``lstsq``: each peer as called
   on arrays of that dtype (numpy's linalg computes float32 input in float64).
2. The everyday float32 regressions of issue 16 against float64 scikit-learn.
3. Rows/s of each LinearRegression solver against Gram on the same data (d=256), interleaved.
4. Compensated (Kahan) against plain float32 accumulation: drift and step cost.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout first

import jax  # noqa: E402
import numpy as np  # noqa: E402

import sharded_scan as ss  # noqa: E402
from bench import certified  # noqa: E402
from bench.tuning import interleaved_best  # noqa: E402
from sharded_scan.combiners.linalg.solvers import SOLVERS  # noqa: E402
from sharded_scan.combiners.wrappers.policies import Compensated  # noqa: E402
from sharded_scan.prefetch import device_batches  # noqa: E402
from sharded_scan.program import build_program  # noqa: E402
from sharded_scan.sources import ArraySource  # noqa: E402


def best_time(fn, repeats: int) -> float:
    fn()  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def drift(steps: int) -> dict:
    """Relative error of summing ``steps`` single-row micro-batches of 0.1 on one device."""
    x = np.full((steps, 1), 0.1, np.float32)
    want = float(np.float64(np.float32(0.1)) * steps)
    out = {}
    for name, combiner in (("plain", ss.Sum()), ("compensated", Compensated(ss.Sum()))):
        got = ss.run(combiner, x, mesh="data:1", microbatch=1, steps_per_call=8192, compensated=False)
        out[name] = abs(float(got.sum[0]) - want) / want
    return out


def step_seconds(combiner, x: np.ndarray, repeats: int) -> float:
    """Best seconds for folding ``x`` with compiled steps (compile and merge excluded)."""
    source = ArraySource(x)
    prog = build_program(combiner, source, ss.RunOptions(compensated=False))
    batches = list(device_batches(source, prog.layout, prog.mesh))

    def fold():
        partials = prog.init()
        for item in batches:
            partials = prog.step(partials, item.batch, item.num_valid)
        jax.block_until_ready(partials)

    return best_time(fold, repeats)


def cost(rows: int, d: int, repeats: int) -> list[dict]:
    """Step time of Gram and Sum with and without compensation, 8 devices, same data."""
    x = np.random.default_rng(0).normal(size=(rows, d)).astype(np.float32)
    table = []
    for name, inner in (("Gram", ss.Gram()), ("Sum", ss.Sum())):
        plain = step_seconds(inner, x, repeats)
        kahan = step_seconds(Compensated(inner), x, repeats)
        table.append({"workload": f"{name} d={d} rows={rows}", "plain_s": plain, "compensated_s": kahan,
                      "cost": kahan / plain - 1})
    return table


def lre_table() -> dict:
    """``{dtype: {"ours": scores per solver, "peers": scores per peer}}`` for float64 and float32."""
    ours64 = certified.run_x64("""
        import numpy as np
        from bench import certified
        emit({"ours": certified.sharded_scan_scores(np.float64), "peers": certified.peer_scores(np.float64)})
    """)
    return {"float64": ours64, "float32": {"ours": certified.sharded_scan_scores(np.float32),
                                           "peers": certified.peer_scores(np.float32)}}


def everyday() -> dict:
    """Relative errors of the issue's float32 regressions (200,000 rows, data:4) against
    float64 scikit-learn: ``LinearRegression`` and ``Ridge(1.0)`` with lognormal income."""
    from sklearn.linear_model import LinearRegression, Ridge

    rng = np.random.default_rng(0)
    n = 200_000
    year, age = rng.integers(1990, 2021, n).astype(np.float64), rng.normal(40, 10, n)
    out = {}
    for name, income, coef, noise, peer, l2 in (
        ("linear", rng.normal(5e4, 1e4, n), (250, 0.8, -30), 50, LinearRegression(), 0.0),
        ("ridge lognormal", rng.lognormal(np.log(5e4), 0.5, n), (3, 2e-4, 0.5), 1, Ridge(1.0), 1.0),
    ):
        x = np.stack([year, income, age], axis=1).astype(np.float32)
        y = (np.asarray(x, np.float64) @ coef + 1000 * (l2 == 0) + rng.normal(0, noise, n)).astype(np.float32)
        want = peer.fit(x.astype(np.float64), y.astype(np.float64))
        for solver in SOLVERS:
            got = ss.run(ss.LinearRegression(l2=l2, solver=solver), (x, y), mesh="data:4")
            out.setdefault(name, {})[solver] = {
                "coef": float(np.abs(got.coef / want.coef_ - 1).max()),
                "intercept": float(abs(got.intercept - want.intercept_) / abs(y.astype(np.float64).mean())),
            }
    return out


def solver_speed(rows: int, repeats: int) -> dict:
    """Rows/s of Gram and of LinearRegression with each solver on the same (X, y), d=256."""
    from bench.workloads import aligned_rows

    x = aligned_rows(rows, 256, seed=2)
    y = (x @ np.linspace(-1, 1, 256, dtype=np.float32) + 0.5).astype(np.float32)
    calls = {"Gram": lambda: ss.run(ss.Gram(), x)}
    for solver in SOLVERS:
        calls[f"LinearRegression({solver})"] = lambda s=solver: ss.run(ss.LinearRegression(solver=s), (x, y))
    for call in calls.values():
        call()  # compile
    seconds = interleaved_best(calls, repeats)
    return {name: {"rows_per_s": rows / t, "vs_gram": seconds["Gram"] / t} for name, t in seconds.items()}


def print_lre(table: dict) -> None:
    for dtype, scores in table.items():
        ours, peers = scores["ours"], scores["peers"]
        callers = [f"ss {s}" for s in ours["regression"]] + list(peers["regression"])
        print(f"\nLRE, {dtype} (digits; 15 = all certified digits)")
        print(f"{'problem':22}" + "".join(f"{c:>16}" for c in callers))
        for name in ours["regression"]["whitened"]:
            values = [ours["regression"][s][name] for s in ours["regression"]]
            values += [peers["regression"][p][name] for p in peers["regression"]]
            print(f"{name + ' coef':22}" + "".join(f"{v:16.1f}" for v in values))
        for name, got in ours["moments"].items():
            for stat in ("mean", "sd"):
                print(f"{name + ' ' + stat:22}{got[stat]:16.1f}" + " " * 16 * (len(ours["regression"]) - 1)
                      + f"{peers['moments'][name][stat]:16.1f}  (numpy)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", 8)
    steps = 10**6 if args.quick else 10**7
    table = lre_table()
    daily = everyday()
    speed = solver_speed(2**16 if args.quick else 2**18, 3 if args.quick else 5)
    errors = drift(steps)
    costs = cost(2**16 if args.quick else 2**19, 256, 3 if args.quick else 5)
    print_lre(table)
    print("\neveryday float32 regressions (200,000 rows, data:4) against float64 scikit-learn")
    for name, by_solver in daily.items():
        for solver, err in by_solver.items():
            print(f"  {name:16} {solver:10} coef {err['coef']:.1e}  intercept/mean(y) {err['intercept']:.1e}")
    print("\nrows/s on the same data, d=256 (8 devices, interleaved, best of runs)")
    for name, row in speed.items():
        print(f"  {name:30} {row['rows_per_s'] / 1e6:6.3f} M rows/s  {row['vs_gram']:.2f}x Gram")
    print(f"\nrelative error after {steps:.0e} float32 micro-batches of 0.1 (float64 reference)")
    print(f"  plain        {errors['plain']:.2e}")
    print(f"  compensated  {errors['compensated']:.2e}")
    print(f"{'workload':32} {'plain s':>9} {'kahan s':>9} {'cost':>7}")
    for row in costs:
        print(f"{row['workload']:32} {row['plain_s']:9.4f} {row['compensated_s']:9.4f} {row['cost']:+7.1%}")
    out = pathlib.Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    report = {"command": "python bench/accuracy.py" + (" --quick" if args.quick else ""), "lre": table,
              "everyday": daily, "solver_speed": speed, "steps": steps, "error": errors, "cost": costs}
    (out / "accuracy.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
