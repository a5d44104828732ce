"""What a user would write instead of sharded_scan: the peers each workload is timed against.

Every peer takes the data as the user holds it (host numpy arrays, or a memory-mapped
``.npy``) and returns host numpy, so its time covers the whole job, transfers included.

- ``numpy``: in memory, the fastest single call numpy offers (``X.T @ X`` is a syrk).
- ``dask``: ``dask.array`` over the same array in row chunks, threaded scheduler.
- ``seed scan``: the seed's ``shard_map`` + ``lax.scan`` example made to work (``pcast``
  on the carry, a ``psum`` at the end), all rows placed at once, jitted once.
- ``naive loop``: one jitted call per batch on one device, each after a synchronous
  transfer of the batch.
- ``spmd jit``: the JAX a user writes first, ``jax.jit`` of the whole reduction as one
  expression (``x.T @ x``) over the rows sharded on ``data`` (XLA SPMD partitions it and adds the
  collective), the rows placed from host memory in the call; ``spmd resident``: the same over
  rows already placed (placed once, at the untimed first call: compute alone).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import dask
import dask.array as da
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

SEED_MICROBATCH = 4096
NAIVE_BATCH = 16384
DASK_CHUNKS = 16


# The reductions as (init(d), body(carry, x, y), finish(carry, n)) on device arrays; the
# jax peers share them, so they differ only in how the rows reach the devices.
def gram_body(carry, x, y):
    return carry + x.T @ x


def moments_body(carry, x, y):
    s, ss_, lo, hi = carry
    return s + x.sum(0), ss_ + (x * x).sum(0), jnp.minimum(lo, x.min(0)), jnp.maximum(hi, x.max(0))


def linreg_body(carry, x, y):
    xtx, xty, sx, sy = carry
    return xtx + x.T @ x, xty + x.T @ y, sx + x.sum(0), sy + y.sum()


def zeros_for(kind: str, d: int):
    f = np.float32
    if kind == "gram":
        return jnp.zeros((d, d), f)
    if kind == "moments":
        return (jnp.zeros(d, f), jnp.zeros(d, f), jnp.full(d, jnp.inf, f), jnp.full(d, -jnp.inf, f))
    return (jnp.zeros((d, d), f), jnp.zeros(d, f), jnp.zeros(d, f), jnp.zeros((), f))


BODIES = {"gram": gram_body, "moments": moments_body, "linreg": linreg_body}


def finish(kind: str, carry, n: int):
    """The user-facing result from the summed carry (host numpy)."""
    carry = jax.tree.map(lambda a: np.asarray(a, np.float64), carry)
    if kind == "gram":
        return carry
    if kind == "moments":
        s, ss_, lo, hi = carry
        mean = s / n
        return mean, ss_ / n - mean * mean, lo, hi
    return solve_normal(*carry, n)


def solve_normal(xtx, xty, sx, sy, n):
    """Least squares with an intercept from the normal equations (float64)."""
    mx, my = sx / n, sy / n
    coef = np.linalg.solve(xtx - n * np.outer(mx, mx), xty - n * mx * my)
    return coef, my - mx @ coef


# numpy ---------------------------------------------------------------------------------
def numpy_peer(kind: str) -> Callable:
    def gram(x, y=None):
        return x.T @ x

    def moments(x, y=None):
        return x.mean(0), x.var(0), x.min(0), x.max(0)

    def linreg(x, y):
        n = x.shape[0]
        return solve_normal(
            (x.T @ x).astype(np.float64), (x.T @ y).astype(np.float64),
            x.sum(0, dtype=np.float64), y.sum(dtype=np.float64), n,
        )

    return {"gram": gram, "moments": moments, "linreg": linreg}[kind]


# dask ----------------------------------------------------------------------------------
def dask_peer(kind: str) -> Callable:
    def call(x, y=None):
        n, d = x.shape
        chunk = -(-n // DASK_CHUNKS)
        xd = da.from_array(x, chunks=(chunk, d))
        if kind == "gram":
            return (xd.T @ xd).compute(scheduler="threads")
        if kind == "moments":
            return dask.compute(xd.mean(0), xd.var(0), xd.min(0), xd.max(0), scheduler="threads")
        yd = da.from_array(y, chunks=(chunk,))
        xtx, xty, sx, sy = dask.compute(xd.T @ xd, xd.T @ yd, xd.sum(0), yd.sum(), scheduler="threads")
        return solve_normal(*(np.asarray(a, np.float64) for a in (xtx, xty, sx, sy)), n)

    return call


# the seed's scan, corrected -----------------------------------------------------------
@functools.cache
def seed_program(kind: str, n: int, d: int, has_y: bool):
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    body = BODIES[kind]
    mb = SEED_MICROBATCH

    def local(xs, ys):
        xs = xs.reshape(-1, mb, d)
        ys = ys.reshape(-1, mb)
        init = jax.tree.map(lambda z: jax.lax.pcast(z, ("data",), to="varying"), zeros_for(kind, d))
        carry, _ = jax.lax.scan(lambda c, b: (body(c, *b), None), init, (xs, ys))
        if kind == "moments":
            s, ss_, lo, hi = carry
            return jax.lax.psum((s, ss_), "data") + (jax.lax.pmin(lo, "data"), jax.lax.pmax(hi, "data"))
        return jax.lax.psum(carry, "data")

    program = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P()))
    return program, NamedSharding(mesh, P("data"))


def seed_peer(kind: str) -> Callable:
    def call(x, y=None):
        n, d = x.shape
        if n % (jax.device_count() * SEED_MICROBATCH):
            raise ValueError("the seed scan needs rows divisible by devices * microbatch")
        program, sharding = seed_program(kind, n, d, y is not None)
        ys = np.zeros(n, np.float32) if y is None else y
        return finish(kind, program(jax.device_put(x, sharding), jax.device_put(ys, sharding)), n)

    return call


# naive loop ----------------------------------------------------------------------------
@functools.cache
def naive_update(kind: str):
    return jax.jit(BODIES[kind], donate_argnums=0)


def naive_peer(kind: str) -> Callable:
    def call(x, y=None):
        n, d = x.shape
        update, device = naive_update(kind), jax.devices()[0]
        carry = jax.device_put(zeros_for(kind, d), device)
        ys = np.zeros(n, np.float32) if y is None else y
        for start in range(0, n, NAIVE_BATCH):
            xb = jax.device_put(x[start : start + NAIVE_BATCH], device).block_until_ready()
            yb = jax.device_put(ys[start : start + NAIVE_BATCH], device).block_until_ready()
            carry = jax.block_until_ready(update(carry, xb, yb))
        return finish(kind, carry, n)

    return call


# XLA SPMD -------------------------------------------------------------------------------
@functools.cache
def spmd_program(kind: str, precision: str = "highest"):
    """The reduction of all rows in one jitted expression (the bodies from a zero carry), rows on ``data``."""
    auto = (jax.sharding.AxisType.Auto,)  # XLA's SPMD partitioner picks the output sharding (the psum)
    sharding = NamedSharding(jax.make_mesh((jax.device_count(),), ("data",), axis_types=auto), P("data"))

    def reduce(x, y):
        with jax.default_matmul_precision(precision):  # sharded_scan's default: "highest"
            return BODIES[kind](zeros_for(kind, x.shape[1]), x, y)

    return jax.jit(reduce, in_shardings=(sharding, sharding)), sharding


def spmd_peer(kind: str, resident: bool = False, precision: str = "highest") -> Callable:
    placed: dict[int, tuple] = {}

    def call(x, y=None):
        program, sharding = spmd_program(kind, precision)
        ys = np.zeros(x.shape[0], np.float32) if y is None else y
        if not resident or id(x) not in placed:
            placed[id(x)] = (jax.device_put(x, sharding), jax.device_put(ys, sharding))
        args = placed[id(x)] if resident else placed.pop(id(x))
        return finish(kind, program(*args), x.shape[0])

    return call


PEERS = {"numpy": numpy_peer, "dask": dask_peer, "seed scan": seed_peer, "naive loop": naive_peer,
         "spmd jit": spmd_peer, "spmd resident": functools.partial(spmd_peer, resident=True)}
