"""A robot-learning dataset (one Parquet file an episode, vector features as lists) against pyarrow alone.

    python -m bench.episodes            # 20 episodes of 50,000 rows (1M rows, 2 x 14 float32 a row); ~1 min
    python -m bench.episodes --quick    # 20 episodes of 5,000 rows, 3 repeats; ~15 s

The files hold what LeRobot's layout stores per frame: ``observation.state`` and ``action``
(14 float32 values each), ``timestamp``, ``frame_index``, ``episode_index``, ``index``; each
episode one file, one row group. The job reads ``columns=["observation.state", "action"]``:
X of 28 values a row. Three layouts of the same values: the vectors as ``fixed_size_list``,
as ``list`` (what pandas and Hugging Face write), and as 28 scalar columns (the path every
tabular source had before vector columns), so the vector reads are compared with it too.

Timed, interleaved, best of repeats:
  arrow     ``pyarrow.dataset.dataset(dir).to_batches(columns=...)`` alone, the batches dropped;
  ceiling   the same, each batch also made one ``(rows, 28)`` float32 numpy array (the lists
            flattened, or the 28 columns copied): what any reader must hand the devices;
  read      the source's own reads of every step of the default layout (``source.read``);
  run       ``sharded_scan.run(Moments(), source)``, default options, 8 simulated CPU devices, warm.
JSON goes to ``bench/results/episodes.json``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before the backend starts

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.dataset  # noqa: E402, F401 - loads the submodule
import pyarrow.parquet as pq  # noqa: E402

import sharded_scan as ss  # noqa: E402
from bench.streaming import ROOT, Bench, timed  # noqa: E402
from bench.tabular_streaming import read_only, write_results  # noqa: E402
from sharded_scan.sources import ParquetSource  # noqa: E402
from sharded_scan.sources.base import aligned_empty  # noqa: E402

K = 14
VECTORS = ["observation.state", "action"]
SCALARS = [f"{v}_{i}" for v in ("state", "action") for i in range(K)]
RESULTS = os.path.join(ROOT, "bench", "results", "episodes.json")


def write_episodes(directory: str, episodes: int, rows: int, layout: str) -> None:
    """``episodes`` files of ``rows`` rows; the vectors as ``layout``: fixed_size_list, list or scalars."""
    os.makedirs(directory)
    for e in range(episodes):
        rng = np.random.default_rng(e)
        values = {v: rng.normal(size=(rows, K)).astype(np.float32) for v in VECTORS}
        if layout == "scalars":
            columns = {f"{v}_{i}": values[long][:, i] for v, long in zip(("state", "action"), VECTORS, strict=True)
                       for i in range(K)}
        else:
            vector = pa.list_(pa.float32(), K) if layout == "fixed_size_list" else pa.list_(pa.float32())
            columns = {v: pa.FixedSizeListArray.from_arrays(values[v].reshape(-1), K).cast(vector) for v in VECTORS}
        columns |= {"timestamp": np.arange(rows, dtype=np.float32) / 30, "frame_index": np.arange(rows),
                    "episode_index": np.full(rows, e), "index": np.arange(rows) + e * rows}
        pq.write_table(pa.table(columns), os.path.join(directory, f"episode_{e:06d}.parquet"),
                       row_group_size=rows)


def arrow_read(path: str, names: list[str], convert: bool) -> int:
    """pyarrow's dataset scan of ``names``; with ``convert`` each batch also becomes one (rows, 28) float32 array."""
    rows = 0
    for batch in pa.dataset.dataset(path).to_batches(columns=names):
        rows += batch.num_rows
        if convert:
            out, at = aligned_empty((batch.num_rows, 2 * K), np.float32), 0
            for j in range(batch.num_columns):
                column = batch.column(j)
                if pa.types.is_list(column.type) or pa.types.is_fixed_size_list(column.type):
                    np.copyto(out[:, at : at + K], column.flatten().to_numpy().reshape(-1, K))
                    at += K
                else:
                    np.copyto(out[:, at], column.to_numpy())
                    at += 1
    return rows


def measure(layout: str, path: str, repeats: int) -> dict[str, Any]:
    names = SCALARS if layout == "scalars" else VECTORS
    source = ParquetSource(path, columns=names)
    assert source.spec.shape == (2 * K,)
    started = time.perf_counter()
    ss.run(ss.Moments(), source)  # compiles the run's programs
    run_cold = time.perf_counter() - started
    bench = Bench(source, ss.Moments(), ss.RunOptions())
    timings = {
        "arrow_s": lambda: arrow_read(path, names, False),
        "ceiling_s": lambda: arrow_read(path, names, True),
        "read_s": lambda: read_only(source, bench.layout),
        "run_s": lambda: ss.run(ss.Moments(), source),
    }
    times: dict[str, list[float]] = {k: [] for k in timings}
    for _ in range(repeats):
        for key, fn in timings.items():
            times[key].append(timed(fn))
    best = {k: min(v) for k, v in times.items()}
    rows = source.num_rows
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    row = {"layout": layout, "rows": rows, "files": len(os.listdir(path)), "file_mib": size / 2**20,
           "steps": bench.layout.num_steps(), "run_cold_s": run_cold, "all_s": times, **best,
           **{k[:-2] + "_rows_per_s": rows / v for k, v in best.items()}}
    row["read_over_ceiling"] = best["ceiling_s"] / best["read_s"]
    row["run_over_ceiling"] = best["ceiling_s"] / best["run_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small episodes, 3 repeats")
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--rows", type=int, default=None, help="rows an episode (default 50,000; --quick 5,000)")
    parser.add_argument("--repeats", type=int, default=None, help="round-robin repeats (default 7; --quick 3)")
    args = parser.parse_args()
    rows, repeats = args.rows or (5_000 if args.quick else 50_000), args.repeats or (3 if args.quick else 7)
    cases = []
    with tempfile.TemporaryDirectory(prefix="bench-episodes-") as tmp:
        for layout in ("fixed_size_list", "list", "scalars"):
            path = os.path.join(tmp, layout)
            write_episodes(path, args.episodes, rows, layout)
            cases.append(measure(layout, path, repeats))
    print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}, cores: {os.cpu_count()}, pyarrow "
          f"{pa.__version__}; {args.episodes} episode files x {rows} rows, X = 2 x {K} float32, Moments, "
          f"best of {repeats}")
    keys = ("arrow", "ceiling", "read", "run")
    print(f"{'layout':<17}{'MiB':>6}" + "".join(f"{k + ' rows/s':>16}" for k in keys) + f"{'read/ceil':>11}"
          + f"{'run/ceil':>10}")
    for r in cases:
        print(f"{r['layout']:<17}{r['file_mib']:>6.0f}" + "".join(f"{r[k + '_rows_per_s'] / 1e6:>15.2f}M" for k in keys)
              + f"{r['read_over_ceiling']:>11.2f}{r['run_over_ceiling']:>10.2f}")
    write_results(RESULTS, args.quick, {"repeats": repeats, "episodes": args.episodes, "rows_per_episode": rows,
                                        "cases": cases})


if __name__ == "__main__":
    main()
