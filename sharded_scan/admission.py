"""Memory admission: a job that cannot fit is refused in one line before anything compiles.

:func:`memory_estimate` works out, from shapes alone, what one device of a built
:class:`~sharded_scan.compiled.Program` holds at its peak; :func:`memory_need` adds what the
host holds beside it where the devices are the host's (CPU); :func:`check_fits` compares
that with the memory there is and raises a :class:`~sharded_scan.errors.UsageError` naming
the parts and what to shrink. The memory there is: an accelerator's free memory
(``memory_stats()``: limit less in use), or for CPU devices the least of the host's
available memory and the room left in this process's memory cgroup (v1 or v2, the
process's own group and every group above it), so a job in a container is refused, not
killed by the kernel. ``bench/admission.py`` measures the estimate against real peaks.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np
from jax.extend import core as jax_core
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from sharded_scan.compiled import MICROBATCH_SCAN
from sharded_scan.errors import UsageError
from sharded_scan.merging import InPlace
from sharded_scan.mesh import DATA_AXIS, MODEL_AXIS

if TYPE_CHECKING:  # the Program admitted; program.py calls check_fits as it builds one
    from sharded_scan.compiled import Program


GIB = 1 << 30
MIB = 1 << 20
# Where /proc and /sys are read from; tests and bench/admission.py point it at a fake tree.
FS_ROOT = "/"
# XLA's compiler and runtime in the host's memory, whatever the job's shapes (CPU devices):
# bench/admission.py measured 70..170 MiB for the smallest jobs.
RUNTIME = 192 * MIB
# cgroup v1 writes "no limit" as 2^63 - 1 rounded down to a page; v2 writes "max".
NO_LIMIT = 1 << 62


def _nbytes(var: Any) -> int:
    aval = getattr(var, "aval", None)
    return int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize if hasattr(aval, "shape") else 0


def _inner_jaxprs(eqn: Any) -> Iterator[Any]:
    for param in eqn.params.values():
        for value in param if isinstance(param, (tuple, list)) else (param,):
            if isinstance(value, jax_core.ClosedJaxpr):
                yield value.jaxpr
            elif isinstance(value, jax_core.Jaxpr):
                yield value


def live_peak(jaxpr: Any) -> int:
    """Bytes of the values ``jaxpr`` makes that are alive at once, at the most (its inputs not
    counted; an inner jaxpr's own peak counted while it runs). XLA fuses some of them away,
    so this is the most an ``add`` or ``merge`` needs beside its inputs."""
    last_use = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for var in eqn.invars:
            if isinstance(var, jax_core.Var):
                last_use[var] = i
    outputs = {var for var in jaxpr.outvars if isinstance(var, jax_core.Var)}
    live, total, peak = {}, 0, 0
    for i, eqn in enumerate(jaxpr.eqns):
        inner = max((live_peak(j) for j in _inner_jaxprs(eqn)), default=0)
        made = sum(_nbytes(var) for var in eqn.outvars)
        peak = max(peak, total + inner + made)
        for var in eqn.outvars:
            live[var] = _nbytes(var)
        total += made
        for var in eqn.invars:
            if isinstance(var, jax_core.Var) and last_use.get(var) == i and var in live and var not in outputs:
                total -= live.pop(var)
    return peak


# _temporaries by what they depend on: tracing a sketch's add costs more than a cached run of it. The merge's
# entry leaves the micro-batch out (a merge does not see it): another micro-batch of the same job traces only the
# step again (a grouped sketch's merge took 0.1-0.3 s to trace a time), whose trace the run's first step reuses.
_TEMPORARIES: dict[Any, int] = {}


def _temporaries(program: Program) -> tuple[int, int]:
    """Bytes one micro-batch's ``add``, and one ``merge`` of two accumulators, make beside
    their inputs (0, 0 when they cannot be traced alone; the merge's 0 where no two states are merged by it:
    :func:`_merges_pairs`); traced once per combiner, row spec, operand shapes and x64 setting (the add also per
    micro-batch)."""
    mb = program.layout.microbatch
    try:
        operands = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                                program.host_operands)
        key = (program.combiner, jax.config.jax_enable_x64, _merges_pairs(program),
               *[(jax.tree.structure(t), tuple(jax.tree.leaves(t))) for t in (program.spec, operands)])
        hash(key)
    except TypeError:  # something unhashable in the combiner: traced every time
        return _noted(program, _stored_temporaries(program) or _traced_temporaries(program, mb))
    add_key, merge_key = ("add", mb, *key), ("merge", *key)
    if add_key not in _TEMPORARIES or merge_key not in _TEMPORARIES:
        stored = _stored_temporaries(program)
        add, merge = stored or _traced_temporaries(program, mb, _TEMPORARIES.get(merge_key))
        _TEMPORARIES[add_key], _TEMPORARIES[merge_key] = add, merge
    return _noted(program, (_TEMPORARIES[add_key], _TEMPORARIES[merge_key]))


def _stored_temporaries(program: Program) -> tuple[int, int] | None:
    """The figures kept beside the step's executable in the job-keyed cache (:mod:`sharded_scan.executables`),
    which the step's trace would give: None where it holds none."""
    entry = program.stored_step
    return None if entry is None or len(entry.figures) != 2 else (entry.figures[0], entry.figures[1])


def _noted(program: Program, figures: tuple[int, int]) -> tuple[int, int]:
    """``figures``, noted on ``program`` to be kept beside its step's executable."""
    program.step_figures[:] = figures
    return figures


def _traced_temporaries(program: Program, mb: int, merge: int | None = None) -> tuple[int, int]:
    """:func:`_temporaries` traced (the merge's, unless ``merge`` gives it)."""
    try:
        operands = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                                program.host_operands)
        acc = jax.eval_shape(program.combiner.init, program.spec)
        parts = program.combiner.partition(program.mesh)
        split = program.combiner.operand_partition(program.mesh)
        # One micro-batch's mask and add as the step runs them, read from the step's own trace (which
        # the run's first step reuses instead of tracing the add again).
        add = max((live_peak(body) for body in _scan_bodies(program.trace_step().jaxpr.jaxpr)), default=0)
        if not _merges_pairs(program):
            return add, 0
        if merge is not None:
            return add, merge
        merge = live_peak(per_device(lambda ops, a, b: program.combiner.bind(ops).merge(a, b), program.mesh, parts,
                                     2, split)(operands, acc, acc))
    except Exception:  # noqa: BLE001 - e.g. an add that needs other axes than the mesh has: no estimate
        return 0, 0
    return add, merge


def _merges_pairs(program: Program) -> bool:
    """Whether the merge ever merges two states with ``combiner.merge``: not for one shard, nor where
    collectives merge the states in place (whose bytes do not count a merge's temporaries)."""
    return program.layout.num_shards > 1 and not isinstance(program.merger, InPlace)


def _scan_bodies(jaxpr: Any, inside: bool = False) -> Iterator[Any]:
    """The bodies of the step's scans over micro-batches in ``jaxpr``: the outermost scans in the scope
    :data:`MICROBATCH_SCAN` (an inner jaxpr's names start afresh, so what is inside an eqn in it is too)."""
    for eqn in jaxpr.eqns:
        scoped = inside or MICROBATCH_SCAN in str(eqn.source_info.name_stack)
        if scoped and eqn.primitive.name == "scan":
            yield eqn.params["jaxpr"].jaxpr
        else:
            for inner in _inner_jaxprs(eqn):
                yield from _scan_bodies(inner, scoped)


def per_device(fn: Any, mesh: Any, parts: Any, accumulators: int, operand_parts: Any = None) -> Any:
    """``fn(operands, *args) -> acc``'s jaxpr maker, as one device runs it: its block of each of the
    first ``accumulators`` args, split as ``parts`` (:meth:`Combiner.partition`; None: whole) over ``mesh``,
    and of the operands, split as ``operand_parts`` (:meth:`Combiner.operand_partition`; None: whole)."""
    if parts is None and operand_parts is None:
        return lambda *args: jax.make_jaxpr(fn)(*args).jaxpr
    parts = P() if parts is None else parts

    def local(operands, *args):
        specs = (P() if operand_parts is None else operand_parts, *[parts] * accumulators,
                 *[P()] * (len(args) - accumulators))
        mapped = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=parts, check_vma=False)
        return jax.make_jaxpr(mapped)(operands, *args).jaxpr.eqns[0].params["jaxpr"]

    return local


def memory_estimate(program: Program, temporaries: bool = True) -> dict[str, int]:
    """Bytes one device of ``program`` holds at its peak, by part; worked out before compiling.

    ``accumulator``: its shards' partials (as laid out: split over ``model``-like axes);
    ``rows``: the steps' rows in flight (``prefetch`` steps ahead, one folding, one placed; no
    more steps than the data has);
    ``merge``: the states the merge holds, and what merging two of them makes, as the program's
    merge route states them (``Program.merger``, :meth:`~sharded_scan.merging.Merge.peak_bytes`):
    one, when a ``psum`` sums them in place, or one collective a leaf merges them; a device's own
    shards and two more by the device tree (its first level merges half of a device's shards at
    once); on a process's first device, by the process tree, its own shards, the log2 of its
    process's shards that ``tree_fold`` holds, one brought in and a partner's; every shard's
    partial where they are gathered; ``temporary`` (with ``temporaries``; it needs
    the combiner's operands): what one micro-batch's ``add`` makes, its values alive at once;
    ``operands`` (with ``temporaries``: it makes them): the combiner's runtime operands
    (:func:`operand_bytes`: histogram edges, quantile boundaries, a gradient's parameters), whole
    on every device whatever the mesh, or a device's block where they split over ``model``
    (:meth:`Combiner.operand_partition`: a histogram's edges, the exact quantiles' boundaries), alive from
    the first step to the merge's end.
    """
    layout = program.layout
    leaves = jax.tree.leaves(program.like)
    accumulator = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize for x in leaves)
    per_shard = accumulator // max(layout.shards_per_device, 1)
    add, merge = _temporaries(program) if temporaries else (0, 0)
    rows = sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(program.spec))
    return {
        "accumulator": accumulator,
        "rows": layout.rows_per_device * rows * min(program.options.prefetch + 2, layout.num_steps()),
        "merge": program.merger.peak_bytes(per_shard, merge),
        "temporary": add,
        "operands": operand_bytes(program) if temporaries else 0,
    }


def operand_bytes(program: Program, whole: bool = False) -> int:
    """Bytes of the combiner's operands (:meth:`Combiner.operands`) as a device holds them (whole
    where they are replicated, its block where they split: ``Program.operand_shardings``), or the
    ``whole`` of them (the host's copy), each leaf in the dtype jax places it as (64-bit host values
    are 32-bit without x64)."""
    leaves = jax.tree.leaves(program.host_operands)
    shapes = [np.shape(x) if whole else s.shard_shape(np.shape(x))
              for x, s in zip(leaves, jax.tree.leaves(program.operand_shardings), strict=True)]
    return sum(int(np.prod(shape)) * jax.dtypes.canonicalize_dtype(np.asarray(x).dtype).itemsize
               for x, shape in zip(leaves, shapes, strict=True))


def device_peak(parts: dict[str, int]) -> int:
    """One device's peak from :func:`memory_estimate`'s ``parts``: its partials with the rows in
    flight and a step's temporaries, or with the merge (never both at once), the operands beside either."""
    return parts["operands"] + parts["accumulator"] + max(parts["rows"] + parts["temporary"], parts["merge"])


class Need(NamedTuple):
    """What :func:`memory_need` worked out, in bytes."""

    total: int                # what the memory there is must hold
    device_peak: int          # one device's peak (``memory_estimate``'s parts at once)
    devices: int              # devices sharing that memory (the local CPU devices; else 1)
    parts: dict[str, int]     # ``memory_estimate``'s parts, and ``reads``, ``host``, ``runtime`` on CPU


def memory_need(program: Program, temporaries: bool = True) -> Need:
    """Bytes ``program`` needs of the memory :func:`check_fits` compares with.

    One device's peak (:func:`memory_estimate`: its partials, with the rows in flight and
    a step's temporaries, or with the merge; the operands beside either); CPU devices share
    the host's memory, so it counts once for every local device, with the host's parts on
    top: ``reads``, the rows in
    flight as read before they are placed (a second copy); ``host``, the merged accumulator
    copied to the host and ``finalize``'s work on it (as much again), and the host's copy of the
    operands (``Program.host_operands``, whole); and ``runtime``, XLA's
    compiler and runtime (:data:`RUNTIME`).
    """
    device = program.mesh.devices.flat[0]
    parts = memory_estimate(program, temporaries)
    peak = device_peak(parts)
    if device.platform != "cpu":
        return Need(peak, peak, 1, parts)
    local = len(program.mesh.local_devices)
    per_shard = parts["accumulator"] // max(program.layout.shards_per_device, 1)
    host_operands = operand_bytes(program, whole=True) if temporaries else 0
    parts = {**parts, "reads": parts["rows"] * local, "host": 2 * per_shard + host_operands, "runtime": RUNTIME}
    return Need(peak * local + parts["reads"] + parts["host"] + parts["runtime"], peak, local, parts)


class CgroupDir(NamedTuple):
    """A memory cgroup of this process: ``version`` 1 or 2, its ``path``, the hierarchy's ``mount``."""

    version: int
    path: pathlib.Path
    mount: pathlib.Path


def cgroup_dirs(root: str | pathlib.Path | None = None) -> list[CgroupDir]:
    """This process's memory cgroups (v2 and/or v1), from ``/proc/self/cgroup`` and
    ``/proc/self/mountinfo`` under ``root`` (default :data:`FS_ROOT`)."""
    root = pathlib.Path(FS_ROOT if root is None else root)
    try:
        groups = (root / "proc/self/cgroup").read_text().splitlines()
        mounts = [line.split() for line in (root / "proc/self/mountinfo").read_text().splitlines()]
    except OSError:
        return []
    found = []
    for line in groups:
        number, controllers, path = line.split(":", 2)
        version = 2 if number == "0" and not controllers else 1 if "memory" in controllers.split(",") else 0
        for fields in mounts:
            if "-" not in fields or not version:
                continue
            kind, options = fields[fields.index("-") + 1], fields[fields.index("-") + 3].split(",")
            if (version, kind) == (2, "cgroup2") or ((version, kind) == (1, "cgroup") and "memory" in options):
                top, mount = fields[3].rstrip("/"), root / fields[4].lstrip("/")
                inside = path[len(top):] if path == top or path.startswith(top + "/") else ""
                found.append(CgroupDir(version, mount / inside.lstrip("/"), mount))
                break
    return found


def _number(path: pathlib.Path) -> int | None:
    """The integer a cgroup file holds; None for ``max``, huge values, or no file."""
    try:
        value = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return value if value < NO_LIMIT else None


def _stat(path: pathlib.Path, key: str) -> int:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    return next((int(v) for k, v in (line.split() for line in lines if line.count(" ") == 1) if k == key), 0)


def cgroup_room(root: str | pathlib.Path | None = None) -> tuple[int, int] | None:
    """``(room, limit)`` in bytes: the least, over this process's memory cgroups and every
    group above them, of the limit less the usage (page cache the kernel can drop,
    ``inactive_file``, not counted as used); None when no group has a limit.

    cgroup v2: ``memory.max`` and ``memory.current``; v1: ``memory.limit_in_bytes`` and
    ``memory.usage_in_bytes``. Files are read under ``root`` (default :data:`FS_ROOT`).
    """
    names = {2: ("memory.max", "memory.current", "inactive_file"),
             1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}
    best = None
    for group in cgroup_dirs(root):
        limit_file, usage_file, cache = names[group.version]
        directory = group.path
        while True:
            limit = _number(directory / limit_file)
            if limit is not None:
                used = max((_number(directory / usage_file) or 0) - _stat(directory / "memory.stat", cache), 0)
                if best is None or limit - used < best[0]:
                    best = (max(limit - used, 0), limit)
            if directory == group.mount or directory == directory.parent:
                break
            directory = directory.parent
    return best


def host_available(root: str | pathlib.Path | None = None) -> tuple[int | None, str]:
    """Memory this process may still take on the host, and what it is: the least of
    ``/proc/meminfo``'s ``MemAvailable`` and :func:`cgroup_room`; ``(None, "")`` when
    neither can be read."""
    root = pathlib.Path(FS_ROOT if root is None else root)
    try:
        info = dict(line.split(":", 1) for line in (root / "proc/meminfo").read_text().splitlines() if ":" in line)
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        available = None
    room = cgroup_room(root)
    if room is not None and (available is None or room[0] < available):
        return room[0], f"memory left in this process's cgroup (limit {room[1] / GIB:.1f} GiB)"
    return available, "available host memory" if available is not None else ""


def device_available(device: Any) -> tuple[int | None, str]:
    """Memory one accelerator may still take (``memory_stats()``: ``bytes_limit`` less
    ``bytes_in_use``), and what it is; ``(None, "")`` where the device reports no limit (CPU)."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - not every backend reports memory
        stats = {}
    if not stats.get("bytes_limit"):
        return None, ""
    limit, used = int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))
    return limit - used, f"free {device.platform.upper()} memory ({limit / GIB:.1f} GiB, {used / GIB:.1f} GiB in use)"


def check_fits(program: Program) -> None:
    """Raises a one-line UsageError when the job cannot fit in memory (before anything compiles).

    On an accelerator each device's peak is compared with its free memory; CPU devices
    share the host's (:func:`host_available`: a cgroup's limit counts), with the host's
    part on top (:func:`memory_need`). The parts known from shapes alone are checked
    first, so a hopeless accumulator is refused before the combiner's operands are made.
    """
    device = program.mesh.devices.flat[0]
    limit, what = device_available(device)
    if limit is None:
        limit, what = host_available()
    if limit is None:
        return
    for temporaries in (False, True):
        need = memory_need(program, temporaries)
        if need.total > limit:
            shown = ", ".join(f"{name} {value / GIB:.2f} GiB" for name, value in need.parts.items()
                              if round(value / GIB, 2))
            devices = f"{need.devices} devices x " if need.devices > 1 else ""
            raise UsageError(
                f"this job needs about {need.total / GIB:.1f} GiB ({devices}{need.device_peak / GIB:.2f} GiB at the "
                f"peak; {shown}), more than the {limit / GIB:.1f} GiB of {what}; "
                f"{axis_to_grow(program, need.parts, need.devices * need.parts['operands'] > limit)}."
            )


def axis_to_grow(program: Program, parts: dict[str, int], operands_alone: bool = False) -> str:
    """What shrinks the biggest part of one device's peak: a mesh axis to grow, or an option.

    Operands whole on every device shrink with no axis; ones the job splits over ``model``
    (:meth:`Combiner.operand_partition`: a histogram's edges, the exact quantiles' boundaries) shrink
    with it.
    ``operands_alone`` (they need more than there is by themselves) says only that; where they are
    the biggest part, so does the advice's start, and where they show in the parts (0.01 GiB or
    more), its end."""
    operands = parts.get("operands", 0)
    shrink = "make the combiner's operands smaller (fewer histogram bins, quantile boundaries or parameters)"
    on_model = program.job.for_mesh(AbstractMesh((1, 2), (DATA_AXIS, MODEL_AXIS)))
    split = on_model.operand_partition(program.mesh) is not None
    grow_model = "grow the mesh's 'model' axis (e.g. data:4,model:2: each device holds 1/2 of the accumulator's columns"
    if operands_alone:
        if split:
            return (f"the combiner's operands alone ({operands / GIB:.2f} GiB a device) do not fit: {grow_model} and "
                    f"of the operands), or {shrink}")
        return (f"the combiner's operands alone ({operands / GIB:.2f} GiB, whole on every device whatever the mesh) "
                f"do not fit: no mesh axis shrinks them; {shrink}")
    state = parts["accumulator"] + parts["merge"]
    if state < parts["rows"] + parts["temporary"]:
        advice = ("grow the mesh's 'data' axis (more devices share the rows), or lower microbatch, steps_per_call or "
                  "prefetch")
    elif on_model.partition(program.mesh) is not None:
        advice = f"{grow_model}), make the accumulator smaller (fewer bins or columns), or lower logical_shards"
    else:
        advice = "make the accumulator smaller (fewer bins or columns), or lower logical_shards"
    if operands > max(state, parts["rows"] + parts["temporary"]):
        if split:
            return f"the combiner's operands are the most of it: {grow_model} and of the operands), or {shrink}"
        return (f"the combiner's operands are the most of it and whole on every device (no axis shrinks them): "
                f"{shrink}, or {advice}")
    if round(operands / GIB, 2):
        where = " a device, shrink as 'model' grows" if split else ", stay whole on every device"
        return f"{advice} (the combiner's operands, {operands / GIB:.2f} GiB{where})"
    return advice
