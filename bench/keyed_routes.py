"""Each keyed fold's two routes on the device JAX finds: the scatter-add against the one-hot matmul
(``combiners/keyed_sums.py``), and ``TopK``'s hash against its sort, per micro-batch.

    python -m bench.keyed_routes            # the CPU here; on a TPU host, the chip
    python -m bench.keyed_routes --quick    # fewer repeats

A program takes one route by the platform it is lowered for (``jax.lax.platform_dependent``): the scatter-add and
the hash on CPU and GPU, the one-hot matmul and the sort on a TPU. This prints both routes' milliseconds a
micro-batch (a jitted scan of 8 micro-batches, best of the repeats), and each ``GroupBy``'s whole ``add`` on the route
the platform takes, so the choice can be checked on the platform at hand.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import sharded_scan as ss
from sharded_scan.combiners import keyed_sums

KEYS, ROWS, COLUMNS, STEPS = 1000, 16384, 4, 8


def best_ms(fn, carry, xs, repeats: int) -> float:
    """Milliseconds a micro-batch of ``fn(carry, x)`` scanned over ``xs``, best of ``repeats``."""
    scan = jax.jit(lambda c, xs: jax.lax.scan(lambda c, x: (fn(c, x), None), c, xs)[0])
    jax.block_until_ready(scan(carry, xs))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(scan(carry, xs))
        best = min(best, time.perf_counter() - start)
    return best / STEPS * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats instead of 10")
    repeats = 3 if parser.parse_args().quick else 10
    r = np.random.default_rng(0)
    keys = jnp.asarray(np.minimum(r.zipf(1.1, (STEPS, ROWS)) - 1, KEYS - 1).astype(np.int32))
    values = jnp.asarray(r.normal(size=(STEPS, ROWS, COLUMNS)).astype(np.float32))
    weights = jnp.asarray(r.random((STEPS, ROWS)).astype(np.float32))
    print(f"{jax.devices()[0].platform}: {STEPS} micro-batches of {ROWS} rows, {COLUMNS} float32 columns, {KEYS} Zipf "
          f"keys; ms a micro-batch, best of {repeats}")

    sums = jnp.zeros((KEYS, COLUMNS), jnp.float32)
    counts = jnp.zeros((KEYS,), jnp.int32)
    for name, route in (("scatter-add", keyed_sums._scattered), ("one-hot matmul", keyed_sums._by_one_hot)):
        summed = best_ms(lambda c, kx, route=route: c + route(kx[1], kx[0], KEYS), sums, (keys, values), repeats)
        counted = best_ms(lambda c, kx, route=route: c + route(jnp.ones_like(kx[0]), kx[0], KEYS), counts,
                          (keys, values), repeats)
        print(f"  {name:48s} {summed:8.3f}   sums; row counts {counted:.3f}")

    mask = jnp.ones((ROWS,), bool)
    inners = {"Sum()": ss.Sum(), "Moments(fields=mean,var,min,max)": ss.Moments(fields="mean,var,min,max"),
              "Covariance()": ss.Covariance(), "Weighted(Covariance())": ss.Weighted(ss.Covariance())}
    for name, inner in inners.items():
        group = ss.GroupBy(inner, KEYS)
        row = jax.ShapeDtypeStruct((COLUMNS,), jnp.float32)
        weighted = isinstance(inner, ss.Weighted)
        spec = (jax.ShapeDtypeStruct((), jnp.int32), (jax.ShapeDtypeStruct((), jnp.float32), row) if weighted else row)
        xs = (keys, (weights, values)) if weighted else (keys, values)
        ms = best_ms(lambda c, kx, group=group: group.add(c, kx, mask), group.init(spec), xs, repeats)
        print(f"  {'GroupBy(' + name + ').add':48s} {ms:8.3f}   (the platform's route)")

    column = jnp.asarray((r.zipf(1.1, (STEPS, 4 * ROWS)) % 1_000_000).astype(np.int32))
    top = ss.TopK(k=100)
    wide = jnp.ones((4 * ROWS,), bool)
    for name, add in (("hash", top._add_by_hash), ("sort", top._add_by_sort)):
        ms = best_ms(lambda c, x, add=add: add(c, x, wide), top.init(jax.ShapeDtypeStruct((), jnp.int32)), column,
                     repeats)
        print(f"  {f'TopK(k=100) by {name}, {4 * ROWS} int32 rows':48s} {ms:8.3f}")


if __name__ == "__main__":
    main()
