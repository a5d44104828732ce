"""Accuracy and cost of compensated (Kahan) accumulation, side by side with plain float32.

    python bench/accuracy.py            # 10**7 micro-batches of 0.1, then the cost on Gram/Sum
    python bench/accuracy.py --quick    # 10**6 micro-batches, smaller cost workloads

Prints one table and writes bench/results/accuracy.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import numpy as np

import sharded_scan as ss
from sharded_scan.combiners.wrappers import Compensated
from sharded_scan.prefetch import device_batches
from sharded_scan.program import build_program
from sharded_scan.sources import ArraySource


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", 8)
    steps = 10**6 if args.quick else 10**7
    errors = drift(steps)
    costs = cost(2**16 if args.quick else 2**19, 256, 3 if args.quick else 5)
    print(f"relative error after {steps:.0e} float32 micro-batches of 0.1 (float64 reference)")
    print(f"  plain        {errors['plain']:.2e}")
    print(f"  compensated  {errors['compensated']:.2e}")
    print(f"{'workload':32} {'plain s':>9} {'kahan s':>9} {'cost':>7}")
    for row in costs:
        print(f"{row['workload']:32} {row['plain_s']:9.4f} {row['compensated_s']:9.4f} {row['cost']:+7.1%}")
    out = pathlib.Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "accuracy.json").write_text(json.dumps({"steps": steps, "error": errors, "cost": costs}, indent=2))


if __name__ == "__main__":
    main()
