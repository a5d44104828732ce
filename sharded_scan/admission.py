"""Memory admission: a job that cannot fit is refused in one line before anything compiles.

:func:`memory_estimate` works out, from shapes alone, what one device of a built
:class:`~sharded_scan.program.Program` holds at its peak; :func:`check_fits` compares it
with the device's memory (or, for CPU devices, the host's available memory) and raises
a :class:`~sharded_scan.errors.UsageError` naming the parts and what to shrink.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from sharded_scan.errors import UsageError

if TYPE_CHECKING:  # program.py calls check_fits as it builds a Program
    from sharded_scan.program import Program


GIB = 1 << 30


def _largest_temporary(program: Program) -> int:
    """Bytes of the largest value one ``add`` of a micro-batch makes (0 when it cannot be traced alone)."""
    mb = program.layout.microbatch
    batch = jax.tree.map(lambda s: jax.ShapeDtypeStruct((mb, *s.shape), s.dtype), program.spec)
    try:
        operands = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                                program.host_operands)
        acc = jax.eval_shape(program.combiner.init, program.spec)
        jaxpr = jax.make_jaxpr(lambda ops, a, b, m: program.combiner.bind(ops).add(a, b, m))(
            operands, acc, batch, jax.ShapeDtypeStruct((mb,), np.bool_))
    except Exception:  # noqa: BLE001 - e.g. an add that needs the mesh's axes: no estimate
        return 0
    sizes = [0]
    for eqn in jaxpr.jaxpr.eqns:
        sizes += [int(np.prod(v.aval.shape)) * np.dtype(v.aval.dtype).itemsize for v in eqn.outvars
                  if hasattr(v.aval, "shape")]
    return max(sizes)


def memory_estimate(program: Program, temporaries: bool = True) -> dict[str, int]:
    """Bytes one device of ``program`` holds at its peak, by part; worked out before compiling.

    ``accumulator``: its shards' partials (as laid out: split over ``model``-like axes);
    ``rows``: the step's rows in flight (``prefetch`` steps ahead, one folding, one read);
    ``merge``: the partials the merge gathers (all shards, unless one ``psum`` sums them in
    place); ``temporary`` (with ``temporaries``; it needs the combiner's operands): the
    largest value one micro-batch's ``add`` makes.
    """
    layout = program.layout
    leaves = jax.tree.leaves(program.like)
    accumulator = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize for x in leaves)
    per_shard = accumulator // max(layout.shards_per_device, 1)
    gathered = not program.combiner.additive or program.options.logical_shards is not None
    rows = sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(program.spec))
    return {
        "accumulator": accumulator,
        "rows": layout.rows_per_device * rows * (program.options.prefetch + 2),
        "merge": per_shard * (layout.num_shards if gathered else 1),
        "temporary": _largest_temporary(program) if temporaries else 0,
    }


def _available(device: Any) -> tuple[int | None, str]:
    """Memory one device may use, and what it is: an accelerator's limit, or the host's free memory."""
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - not every backend reports memory
        limit = None
    if limit:
        return int(limit), f"{device.platform.upper()} memory"
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024, "available host memory"
    except (OSError, KeyError, ValueError):
        return None, ""


def check_fits(program: Program) -> None:
    """Raises a one-line UsageError when the job cannot fit in memory (before anything compiles).

    On an accelerator each device's peak is compared with its limit; CPU devices share the
    host's available memory, with the merged accumulator's host copies on top. The parts
    known from shapes alone are checked first, so a hopeless accumulator is refused before
    the combiner's operands are made.
    """
    device = program.mesh.devices.flat[0]
    limit, what = _available(device)
    if limit is None:
        return
    for temporaries in (False, True):
        parts = memory_estimate(program, temporaries)
        peak = max(parts["accumulator"] + parts["rows"] + parts["temporary"], parts["accumulator"] + parts["merge"])
        local = len(program.mesh.local_devices) if device.platform == "cpu" else 1
        need = peak * local + (2 * parts["merge"] if device.platform == "cpu" else 0)
        if need > limit:
            shown = ", ".join(f"{name} {value / GIB:.2f} GiB" for name, value in parts.items() if value)
            devices = f"{local} devices x " if local > 1 else ""
            raise UsageError(
                f"this job needs about {need / GIB:.1f} GiB ({devices}{peak / GIB:.2f} GiB at the peak: {shown}), more "
                f"than the {limit / GIB:.1f} GiB of {what}; make the accumulator smaller (fewer bins or columns), "
                "split it over a 'model' mesh axis where the combiner can (Gram), or lower logical_shards, "
                "microbatch, steps_per_call or prefetch."
            )
