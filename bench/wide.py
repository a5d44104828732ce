"""A wide job's memory per device: ``Quantiles`` on many columns, ``data:8`` beside ``data:4,model:2``.

On a mesh with a ``model`` axis the sketch is split by columns (each device holds and sorts
``1/M`` of them), so a device's accumulator, the partials its merge gathers (over ``data``
only) and its ``add``'s temporaries shrink by the ``model`` size. For each mesh this prints,
per device: the accumulator as laid out (the arrays' shard on device 0, measured), the merged
state (measured), :func:`sharded_scan.admission.memory_estimate`'s parts and one device's peak from them (the
``admission.device_peak``, what admission works with; ``memory_stats()`` is None on CPU), and the seconds of a run over
``--rows`` rows. ``--estimate-k`` adds estimate-only rows (nothing runs) at a larger ``k``
and ``--estimate-rows`` rows, e.g. the default ``k=8192`` on 10^6 rows.

    python -m bench.wide                           # 20,000 columns, k=256, 2,048 rows
    python -m bench.wide --columns 2000 --rows 512 # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np

import sharded_scan as ss
from sharded_scan import admission
from sharded_scan import program as pg

RESULTS = os.path.join(os.path.dirname(__file__), "results")
MESHES = ("data:8", "data:4,model:2")
MIB = 1 << 20


def on_first_device(tree) -> int:
    """Bytes of ``tree``'s arrays that device 0 holds."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def measured(columns: int, rows: int, k: int, mesh: str) -> dict:
    """A run over ``rows`` rows of ``columns`` columns on ``mesh``: what one device holds."""
    x = np.random.default_rng(0).normal(size=(rows, columns)).astype(np.float32)
    job = ss.Quantiles(num_buckets=10, k=k)
    prog = pg.program_for_spec(job, jax.ShapeDtypeStruct((columns,), np.float32), rows, ss.RunOptions(mesh=mesh))
    partials = prog.init()
    merged = prog.merge(partials)
    start = time.perf_counter()
    ss.run(job, x, mesh=mesh)
    seconds = time.perf_counter() - start
    parts = admission.memory_estimate(prog)
    return {"mesh": mesh, "columns": columns, "k": k, "rows": rows, "partials_MiB": on_first_device(partials) / MIB,
            "merged_MiB": on_first_device(merged) / MIB, "estimate_MiB": {n: v / MIB for n, v in parts.items()},
            "peak_MiB": admission.device_peak(parts) / MIB, "run_s": seconds}


def estimated(columns: int, rows: int, k: int, mesh: str) -> dict:
    """:func:`~sharded_scan.admission.memory_estimate` alone (nor admission, nor compute)."""
    fits, pg.check_fits = pg.check_fits, lambda program: None  # this machine cannot hold the job: estimate only
    try:
        prog = pg.program_for_spec(ss.Quantiles(num_buckets=10, k=k), jax.ShapeDtypeStruct((columns,), np.float32),
                                   rows, ss.RunOptions(mesh=mesh))
    finally:
        pg.check_fits = fits
    parts = admission.memory_estimate(prog)
    return {"mesh": mesh, "columns": columns, "k": k, "rows": rows,
            "estimate_MiB": {n: v / MIB for n, v in parts.items()}, "peak_MiB": admission.device_peak(parts) / MIB}


def side_by_side(points: list[dict]) -> None:
    """The meshes' per-device figures in one table, and model's over data's ratio of the peak."""
    print(f"{'mesh':16} {'k':>5} {'rows':>8} {'partials':>9} {'merged':>8} {'acc est':>8} {'merge est':>9} "
          f"{'add est':>8} {'peak est':>9} {'run s':>6}  (MiB a device)")
    for p in points:
        est = p["estimate_MiB"]
        print(f"{p['mesh']:16} {p['k']:>5} {p['rows']:>8} {p.get('partials_MiB', float('nan')):>9.1f} "
              f"{p.get('merged_MiB', float('nan')):>8.1f} {est['accumulator']:>8.1f} {est['merge']:>9.1f} "
              f"{est['temporary']:>8.1f} {p['peak_MiB']:>9.1f} {p.get('run_s', float('nan')):>6.1f}")
    for a, b in zip(points[::2], points[1::2], strict=True):
        print(f"k={a['k']} rows={a['rows']}: {b['mesh']} peak / {a['mesh']} peak = {b['peak_MiB'] / a['peak_MiB']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--columns", type=int, default=20_000)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--k", type=int, default=256)
    parser.add_argument("--estimate-k", type=int, default=8192)
    parser.add_argument("--estimate-rows", type=int, default=1_000_000)
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", 8)
    points = [measured(args.columns, args.rows, args.k, mesh) for mesh in MESHES]
    points += [estimated(args.columns, args.estimate_rows, args.estimate_k, mesh) for mesh in MESHES]
    side_by_side(points)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "wide.json"), "w") as f:
        json.dump({"points": points}, f, indent=1)


if __name__ == "__main__":
    main()
