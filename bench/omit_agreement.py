"""Moments under ``nan_policy="omit"`` against its former route, ``EachColumn(Moments)`` (one-column states under
``jax.vmap``), on many seeded inputs: how far each result field moves.

    python -m bench.omit_agreement            # 308 runs: 1-40 columns, float32/64, 1-8 devices, data:2,model:2
    python -m bench.omit_agreement --quick    # a tenth of them
    XLA_FLAGS=--xla_cpu_max_isa=AVX python -m bench.omit_agreement   # no FMA: XLA contracts no multiply-add

Each input (normal, shifted, rounded, Cauchy near the largest float, exponential; NaN, +-inf, an all-NaN column, a
constant one, a column of no finite value in the first micro-batches) runs as ``Moments`` (fields and ddof varying),
``GroupBy(Moments, 5)``, ``Weighted(Moments)``, ``GroupBy(Weighted(Moments), 4)`` and ``GroupBy`` by value, each
both ways. Printed: per field and data dtype, the runs and values that differ and by how much (relative, in ulps of
the accumulator's dtype, absolute).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import collections  # noqa: E402
import dataclasses  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import sharded_scan as ss  # noqa: E402
from bench.each_column import EachColumn  # noqa: E402

jax.config.update("jax_enable_x64", True)


@dataclasses.dataclass(frozen=True)
class FormerRoute(ss.Moments):
    """``Moments`` whose ``nan_policy="omit"`` runs as it did: ``EachColumn(Moments)``."""

    def omitting_values(self):
        return EachColumn(ss.Moments(self.ddof, self.fields))


def data(seed: int, n: int, d: int, dtype) -> np.ndarray:
    r = np.random.default_rng(seed)
    kind = seed % 5
    if kind == 0:
        x = r.normal(size=(n, d)) * 10 + 3
    elif kind == 1:
        x = r.normal(size=(n, d)) * 1e-3 + 1e4
    elif kind == 2:
        x = np.round(r.normal(size=(n, d)) * 3)  # zeros, repeated values
    elif kind == 3:
        x = r.standard_cauchy(size=(n, d)) * 1e300  # near overflow: the convex mean
    else:
        x = r.exponential(size=(n, d)) * r.choice([1, -1], size=(n, d))
    x[r.random((n, d)) < r.choice([0.0, 0.01, 0.1, 0.5])] = np.nan
    x[r.random((n, d)) < 0.01] = np.inf
    x[r.random((n, d)) < 0.01] = -np.inf
    if d > 1:
        x[:, 1] = np.nan  # all NaN
    if d > 2:
        x[:, 2] = 2.5  # constant (and a NaN)
        x[n // 2, 2] = np.nan
    if d > 3 and n > 10:
        x[: n // 3, 3] = np.nan  # no finite value in the first micro-batches
    if kind == 3 and d > 4:
        x[:, 4] = r.choice([1e308, -1e308, 1.7e308], size=n)
    with np.errstate(over="ignore"):
        return x.astype(dtype)


def leaves(result) -> dict:
    """A result's arrays by field name (a GroupByResult's inner fields under ``result.``)."""
    out = {}
    for f, v in zip(result._fields, result, strict=True):
        if hasattr(v, "_fields"):
            out.update({f"{f}.{k}": w for k, w in leaves(v).items()})
        elif v is not None:
            out[f] = np.asarray(v)
    return out


def cases(quick: bool):
    shapes = [(1, 1), (7, 3), (203, 6), (1000, 8), (5000, 2), (333, 33), (2049, 40), (64, 5)]
    i = 0
    for n, d in shapes:
        for dtype in (np.float64, np.float32):
            for seed in range(5):
                i += 1
                if quick and i % 10:
                    continue
                x = data(seed + 10 * n + d, n, d, dtype)
                mesh = ("data:1", "data:8", "data:2,model:2", "data:4")[i % 4]
                mb = (8, 64, None)[i % 3]
                kw = {"mesh": mesh, **({"microbatch": mb} if mb else {}), **({"steps_per_call": 2} if i % 2 else {})}
                fields = [None, "mean,var", "min,max,nan_count", "skewness,kurtosis", "norm_l1,norm_l2,zeros"][seed]
                r = np.random.default_rng(seed)
                keys = r.integers(0, 4, n).astype(np.int32)
                w = r.random(n) * 3
                w[r.random(n) < 0.05] = 0.0
                w[r.random(n) < 0.02] = np.nan
                w = w.astype(dtype)

                def forms(m, fields=fields, seed=seed, x=x, keys=keys, w=w):
                    yield m(ddof=seed % 2, fields=fields), x
                    yield ss.GroupBy(m(ddof=1, fields=fields), 5), (keys, x)
                    yield ss.Weighted(m(ddof=seed % 2, fields=fields)), (w, x)
                    if seed < 2:
                        yield ss.GroupBy(ss.Weighted(m(fields=fields)), 4), (keys, (w, x))
                        yield ss.GroupBy(m()), (np.array(["a", "b", "c"])[keys % 3], x)

                yield dtype, kw, forms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    stats = collections.defaultdict(lambda: [0, 0, 0, 0.0, 0.0, 0.0])  # runs, differing, values, rel, ulps, abs
    runs = values = 0
    for dtype, kw, forms in cases(args.quick):
        for (new, x), (old, _) in zip(forms(ss.Moments), forms(FormerRoute), strict=True):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                a = leaves(ss.run(old, x, nan_policy="omit", **kw))
                b = leaves(ss.run(new, x, nan_policy="omit", **kw))
            runs += 1
            assert a.keys() == b.keys()
            for f, u in a.items():
                v = b[f]
                assert u.dtype == v.dtype and u.shape == v.shape, (f, u.dtype, v.dtype, u.shape, v.shape)
                s = stats[f.split(".")[-1], np.dtype(dtype).name]
                s[0] += 1
                values += u.size
                if u.tobytes() == v.tobytes():
                    continue
                moved = (u != v) & ~(np.isnan(u) & np.isnan(v)) if u.dtype.kind == "f" else u != v
                s[1] += 1
                s[2] += int(moved.sum())
                if u.dtype.kind == "f":
                    p, q = u[moved].astype(np.float64), v[moved].astype(np.float64)
                    s[3] = max(s[3], float(np.max(np.abs(p - q) / np.abs(p))))
                    ulp = np.spacing(np.abs(u[moved]).astype(dtype)).astype(np.float64)
                    s[4] = max(s[4], float(np.max(np.abs(p - q) / ulp)))
                    s[5] = max(s[5], float(np.max(np.abs(p - q))))
    moved = sum(s[2] for s in stats.values())
    print(f"{runs} runs, {values} values: {moved} moved")
    for (field, dt), (n, nd, nv, rel, ulps, ab) in sorted(stats.items()):
        if nd:
            print(f"  {field:10s} {dt:8s} runs {n:4d} differing {nd:3d} values {nv:5d}  max rel {rel:.1e}  "
                  f"{ulps:.1f} ulps  abs {ab:.1e}")


if __name__ == "__main__":
    main()
