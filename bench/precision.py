"""The cost and the accuracy of each matmul precision, on whatever accelerator JAX finds.

    python bench/precision.py             # 2^21 rows of d=256, mean 100 (the data that shows it)
    python bench/precision.py --quick     # 2^18 rows

For Gram, Covariance and LinearRegression it times ``ss.run(..., precision=P)`` for P in
highest (the default), high, default, and the float32 result's relative error against
float64 numpy. On CPU every precision computes the same products; on a GPU, ``default`` uses
TF32 tensor cores and on a TPU one bfloat16 pass, which is what the figures measure there.
Prints a table and writes ``bench/results/precision_<platform>.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import numpy as np

import sharded_scan as ss

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
PRECISIONS = ("highest", "high", "default")


def best_seconds(call, repeats: int) -> float:
    call()  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    n, d = (1 << 18 if args.quick else 1 << 21), 256
    rng = np.random.default_rng(0)
    x = (100 + rng.normal(size=(n, d))).astype(np.float32)
    y = (x[:, :8].sum(1) + rng.normal(size=n)).astype(np.float32)
    x64 = x.astype(np.float64)
    cases = {
        "Gram": (ss.Gram(), x, x64.T @ x64, lambda r: r),
        "Covariance": (ss.Covariance(), x, np.cov(x64, rowvar=False), lambda r: r.cov),
        "LinearRegression": (
            ss.LinearRegression(), (x, y),
            np.linalg.lstsq(np.hstack([x64, np.ones((n, 1))]), y.astype(np.float64), rcond=None)[0][:-1],
            lambda r: r.coef,
        ),
    }
    rows = []
    for name, (combiner, data, want, pick) in cases.items():
        for precision in PRECISIONS:
            seconds = best_seconds(lambda c=combiner, x=data, p=precision: ss.run(c, x, precision=p), args.repeats)
            got = np.asarray(pick(ss.run(combiner, data, precision=precision)), np.float64)
            error = float(np.abs(got - want).max() / np.abs(want).max())
            rows.append({"combiner": name, "precision": precision, "seconds": seconds, "rows_per_s": n / seconds,
                         "rel_err": error})
            print(f"{name:17s} {precision:8s} {n / seconds:12.4g} rows/s  rel err {error:.2e}", flush=True)
    platform = jax.devices()[0].platform
    report = {"platform": platform, "device": str(jax.devices()[0].device_kind), "rows": n, "d": d, "results": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"precision_{platform}.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
