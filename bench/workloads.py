"""The benchmark workloads: data, the sharded_scan call, the peers, the work done.

Rates are effective: ``2·n·d²`` flops for a Gram matrix (whatever the implementation
actually computes: symmetric products do half), ``2·n·d·(d + 1)`` for the normal
equations of a regression, and input bytes for per-column moments.
"""

from __future__ import annotations

import dataclasses
import pathlib
import tempfile
from collections.abc import Callable

import numpy as np

import sharded_scan as ss
from bench.peers import PEERS


def aligned_rows(n: int, d: int, seed: int = 0, align: int = 64) -> np.ndarray:
    """``(n, d)`` float32 normal rows in a buffer aligned to ``align`` bytes.

    The devices of XLA's CPU client can then use the host buffer in place (no copy on
    placement); every peer gets the same array.
    """
    nbytes = n * d * 4
    buf = np.empty(nbytes + align, np.uint8)
    start = (-buf.ctypes.data) % align
    x = buf[start : start + nbytes].view(np.float32).reshape(n, d)
    rng = np.random.default_rng(seed)
    for i in range(0, n, 1 << 16):
        x[i : i + (1 << 16)] = rng.standard_normal((min(1 << 16, n - i), d), dtype=np.float32)
    return x


@dataclasses.dataclass
class Workload:
    """One row of the table."""

    name: str
    kind: str                     # "gram", "moments" or "linreg": which peer bodies
    d: int
    unit: str                     # "GFLOP/s" or "GB/s"
    ours: Callable                # (x, y) -> result
    x: np.ndarray
    y: np.ndarray | None = None
    peers: tuple[str, ...] = tuple(PEERS)
    cleanup: Callable | None = None

    @property
    def n(self) -> int:
        return self.x.shape[0]

    @property
    def work(self) -> float:
        """Flops (effective) or bytes, per run."""
        n, d = self.n, self.d
        if self.kind == "gram":
            return 2.0 * n * d * d
        if self.kind == "linreg":
            return 2.0 * n * d * (d + 1)
        return 4.0 * n * d

    def calls(self) -> dict[str, Callable]:
        """``{"sharded_scan": ..., peer: ...}``, each a no-argument callable."""
        out = {"sharded_scan": lambda: self.ours(self.x, self.y)}
        for name in self.peers:
            peer = PEERS[name](self.kind)
            out[name] = lambda peer=peer: peer(self.x, self.y)
        return out


def rows_for(megabytes: int, d: int, multiple: int) -> int:
    """Rows of a ``megabytes`` float32 array of width ``d``, rounded down to ``multiple``."""
    n = (megabytes << 20) // (4 * d)
    return max(multiple, n // multiple * multiple)


def make_workloads(megabytes: int, only: set[str] | None = None) -> list[Workload]:
    """The table's workloads, each on a ``megabytes`` float32 input."""
    multiple = 8 * 4096 * 8  # every peer's batch shape divides it
    out = []

    def want(name):
        return only is None or name in only

    for d in (32, 256, 1024):
        if want(f"gram_d{d}"):
            x = aligned_rows(rows_for(megabytes, d, multiple), d)
            out.append(Workload(f"gram_d{d}", "gram", d, "GFLOP/s", lambda x, y: ss.run(ss.Gram(), x), x))
    if want("moments_d256"):
        x = aligned_rows(rows_for(megabytes, 256, multiple), 256, seed=1)
        out.append(Workload("moments_d256", "moments", 256, "GB/s", lambda x, y: ss.run(ss.Moments(), x), x))
    if want("linreg_d256"):
        x = aligned_rows(rows_for(megabytes, 256, multiple), 256, seed=2)
        y = (x @ np.linspace(-1, 1, 256, dtype=np.float32) + 0.5).astype(np.float32)
        out.append(
            Workload("linreg_d256", "linreg", 256, "GFLOP/s", lambda x, y: ss.run(ss.LinearRegression(), (x, y)), x, y)
        )
    if want("gram_npy_d256"):
        out.append(npy_workload(megabytes))
    return out


def npy_workload(megabytes: int) -> Workload:
    """Gram of a ``.npy`` file, memory-mapped (read through the page cache, warm after the
    first run); every caller streams it from the file."""
    d = 256
    tmp = tempfile.TemporaryDirectory(prefix="ss_bench_")
    path = pathlib.Path(tmp.name) / "rows.npy"
    np.save(path, aligned_rows(rows_for(megabytes, d, 8 * 4096 * 8), d, seed=3))
    x = np.load(path, mmap_mode="r")
    return Workload(
        "gram_npy_d256", "gram", d, "GFLOP/s", lambda x, y: ss.run(ss.Gram(), x), x, cleanup=tmp.cleanup
    )


def reference(w: Workload) -> np.ndarray:
    """float64 value every caller's result is checked against (matrix, mean or coef)."""
    x = np.asarray(w.x, np.float64)
    if w.kind == "gram":
        return x.T @ x
    if w.kind == "moments":
        return x.mean(0)
    xm = x - x.mean(0)
    ym = w.y - w.y.mean()
    return np.linalg.solve(xm.T @ xm, xm.T @ ym)


def comparable(w: Workload, result) -> np.ndarray:
    """The part of any caller's result that :func:`reference` gives."""
    if w.kind == "gram":
        return np.asarray(result)
    if w.kind == "moments":
        return np.asarray(result.mean if hasattr(result, "mean") and not callable(result.mean) else result[0])
    return np.asarray(result.coef if hasattr(result, "coef") else result[0])
