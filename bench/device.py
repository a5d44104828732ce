"""sharded_scan on an accelerator against the SPMD jit peer and the chip's peak: one command.

    python -m bench.device            # 1 GiB a workload, best of 3; a few minutes on one GPU/TPU host
    python -m bench.device --quick    # 16 MiB, best of 2 (seconds on CPU: checks that it runs)

Per workload it prints sharded_scan's rate (``ss.run`` from host memory, transfers included),
the SPMD jit peer's (``jax.jit`` of the same reduction, from host memory and over rows already
resident: ``bench/peers.py``), the accelerator's peak for the dtype (:data:`PEAKS`, by
``device_kind``: fp32, tf32 and bf16 with fp32 accumulation, as ``precision`` selects them) or its
memory bandwidth for the memory-bound row (Moments), and the fraction of it reached. Then the
host->device overlap (``bench/streaming.py``'s measure at the default options) from a ``.npy``
and a Parquet source. On a device kind missing from the table the peak is "n/a".
JSON goes to ``bench/results/device[_quick].json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile

import jax
import numpy as np

import sharded_scan as ss
from bench.peers import spmd_peer
from bench.streaming import measure as overlap
from bench.streaming import write_npy
from bench.tuning import interleaved_best
from bench.workloads import aligned_rows, rows_for
from sharded_scan.sources import NpySource, ParquetSource

# Dense peaks per chip (vendor data sheets): TFLOP/s by precision, memory bandwidth in GB/s.
PEAKS = {
    "H200": {"highest": 67, "tensorfloat32": 495, "bfloat16": 989, "GB/s": 4800},
    "H100": {"highest": 67, "tensorfloat32": 495, "bfloat16": 989, "GB/s": 3350},
    "A100": {"highest": 19.5, "tensorfloat32": 156, "bfloat16": 312, "GB/s": 2039},
    "L4": {"highest": 30, "tensorfloat32": 60, "bfloat16": 121, "GB/s": 300},
    "TPU v4": {"bfloat16": 275, "GB/s": 1200},
    "TPU v5 lite": {"bfloat16": 197, "GB/s": 819},
    "TPU v5p": {"bfloat16": 459, "GB/s": 2765},
    "TPU v6 lite": {"bfloat16": 918, "GB/s": 1640},
}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def peak_for(kind: str, key: str) -> float | None:
    """The table's peak for ``device_kind`` ``kind`` (longest matching name), None when unknown."""
    names = sorted((n for n in PEAKS if n.lower() in kind.lower()), key=len, reverse=True)
    return PEAKS[names[0]].get(key) if names else None


def workloads() -> list[tuple[str, str, str, int]]:
    """``(name, kind, precision, d)``: compute-bound Gram at three precisions, memory-bound Moments."""
    return [("gram_d1024 fp32", "gram", "highest", 1024), ("gram_d1024 tf32", "gram", "tensorfloat32", 1024),
            ("gram_d1024 bf16", "gram", "bfloat16", 1024), ("moments_d256", "moments", "highest", 256)]


def rate_rows(megabytes: int, repeats: int) -> list[dict]:
    kind_name = jax.devices()[0].device_kind
    out = []
    for name, kind, precision, d in workloads():
        x = aligned_rows(rows_for(megabytes, d, 8 * jax.device_count() * 1024), d)
        combiner = ss.Gram() if kind == "gram" else ss.Moments()
        host, resident = spmd_peer(kind, precision=precision), spmd_peer(kind, True, precision)
        calls = {"sharded_scan": lambda c=combiner, p=precision, x=x: ss.run(c, x, precision=p),
                 "spmd jit": lambda f=host, x=x: f(x), "spmd resident": lambda f=resident, x=x: f(x)}
        for call in calls.values():
            call()  # compile; the resident peer places its rows
        seconds = interleaved_best(calls, repeats)
        n = x.shape[0]
        work, unit, key = (2.0 * n * d * d / 1e12, "TFLOP/s", precision) if kind == "gram" else (
            x.nbytes / 1e9, "GB/s", "GB/s")
        rates = {c: work / t for c, t in seconds.items()}
        peak = peak_for(kind_name, key)
        out.append({"workload": name, "unit": unit, "rate": rates, "peak": peak,
                    "fraction": {c: r / peak for c, r in rates.items()} if peak else None})
    return out


def overlap_rows(megabytes: int, repeats: int) -> list[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory(prefix="bench-device-") as tmp:
        npy, parquet = os.path.join(tmp, "rows.npy"), os.path.join(tmp, "rows.parquet")
        rows = (megabytes << 20) // (256 * 4)
        write_npy(npy, rows)
        x = np.load(npy, mmap_mode="r")
        pq.write_table(pa.table({f"c{j}": np.asarray(x[:, j]) for j in range(32)}), parquet, row_group_size=1 << 17)
        options = ss.RunOptions()
        return [overlap(".npy (256 float32 columns)", NpySource(npy), repeats, options=options),
                overlap("Parquet (32 float32 columns)", ParquetSource(parquet), repeats, options=options)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 MiB a workload, best of 2")
    args = parser.parse_args()
    megabytes, repeats = (16, 2) if args.quick else (1024, 3)
    device = jax.devices()[0]
    print(f"{jax.device_count()} x {device.device_kind} ({device.platform}); {megabytes} MiB a workload, "
          f"best of {repeats}", flush=True)
    rates = rate_rows(megabytes, repeats)
    print(f"\n{'workload':<18}{'unit':>8}{'sharded_scan':>14}{'spmd jit':>10}{'resident':>10}{'peak':>8}"
          f"{'ss/peak':>9}{'resident/peak':>15}")
    for r in rates:
        f, peak = r["fraction"], r["peak"]
        print(f"{r['workload']:<18}{r['unit']:>8}{r['rate']['sharded_scan']:>14.3g}{r['rate']['spmd jit']:>10.3g}"
              f"{r['rate']['spmd resident']:>10.3g}{peak or 'n/a':>8}"
              f"{f['sharded_scan'] if f else float('nan'):>9.2f}{f['spmd resident'] if f else float('nan'):>15.2f}")
    overlaps = overlap_rows(megabytes if args.quick else 512, repeats)
    print("\nhost->device at the default options (overlap: max(read, compute) / end to end, prefetch=2)")
    for r in overlaps:
        print(f"  {r['case']:<30} {r['steps']:>4} steps  read {r['source_s']:.2f} s  compute {r['compute_s']:.2f} s  "
              f"end to end {r['e2e_p2_s']:.2f} s  overlap {r['overlap_p2']:.2f}")
    os.makedirs(RESULTS, exist_ok=True)
    target = os.path.join(RESULTS, "device_quick.json" if args.quick else "device.json")
    with open(target, "w") as f:
        json.dump({"device_kind": device.device_kind, "devices": jax.device_count(), "host": platform.node(),
                   "jax": jax.__version__, "megabytes": megabytes, "rates": rates, "overlap": overlaps}, f, indent=1)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
