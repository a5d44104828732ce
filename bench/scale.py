"""The merge against the shard count: main's all-gather + fold beside the tree merge, side by side.

For ``Sum``, ``Gram`` (d=256, 1024), ``Quantiles`` and ``LinearRegression`` under
``logical_shards=S`` (S = 1..256 on up to 8 simulated CPU devices): merge seconds (best of
``--repeats`` after a warm call), the extra states a device holds while merging (array sizes:
``memory_stats()`` is None on CPU), the bytes a device receives, the merges the busiest device
runs one after another (its depth: what the seconds are on a pod, where devices do not share
cores; here 8 simulated devices share 2 cores), and the checkpoint bytes per
save (every logical shard's state: this bench does not change them). ``before`` is main's path
(:func:`before_merge`: every partial all-gathered onto every device, then folded shard by shard on
one device per process, or in one SPMD program for a sum); ``after`` is :meth:`Program.merge`.

The projection to 256, 1,024 and 4,096 chips (one shard a chip, 4 chips a host) takes the
measured seconds of one merge (``m``, the slope of ``before`` against S) and an assumed
inter-host bandwidth (``--gbps``): before, every process folds every shard after an all-gather
of all of them, ``m * (N - 1) + N * state / bw``; after, a merge that is not a sum runs the
process tree: each host folds its 4 chips' states on one of them (the merge compiled once) and the
hosts pair up, ``m * 3 + log2(N / 4) * (m + 2 * state / bw)`` (a round's state and the broadcast's),
holding log2(4) + 3 states; a sum (the device tree) pairs the chips themselves, ``log2(N) * (m + 2 * state / bw)``,
holding 3.

    python -m bench.scale --quick      # S up to 64, 1 repeat (a few minutes on 2 cores)
    python -m bench.scale --processes 256 --jobs LinearRegression   # 1x8, 2x4, 4x2, 8x1 processes

``--checkpoints`` times checkpoints instead (:func:`checkpoint_point`): for each S, a per-shard
save (every logical shard's state) beside a compact one (``CheckpointOptions(compact=True)``: the
partials merged, one state split over the 8 devices): bytes on disk per save, the seconds a save
takes (until written; after a first save compiled what it runs), the seconds a restore into the
same program takes after a first one compiled what it runs (per-shard: in place; compact: the
state read split and laid out in shard 0), and an elastic restore of the per-shard save onto
``data:8`` without ``logical_shards`` (its S shards read over the devices and folded).

    python -m bench.scale --checkpoints --quick --jobs "Gram d=1024,LinearRegression"

``--split`` times a state split over ``model`` instead (:func:`split_point`: ``Quantiles`` and
``Covariance`` on ``data:4,model:2``, S = 4..64): main's gathered merge beside the device tree.

    python -m bench.scale --split --repeats 5

For each additive job, ``--checkpoints`` also times a compact save without ``logical_shards`` on
``data:8`` (and the jobs of :data:`SCATTER_MODEL` on ``data:4,model:2``), where the merge is one
``psum`` (:func:`scatter_point`): main's path (the ``psum``, the whole state on every device, then
split) beside the reduce-scatter into the split leaves.

Each mode writes its JSON under ``bench/results/``; a run of some ``--jobs`` replaces those jobs'
entries and keeps the others'.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import tempfile
import time

import jax
import numpy as np

import sharded_scan as ss
from sharded_scan import merging, sharding
from sharded_scan import program as pg
from sharded_scan.checkpoint import Checkpointer, CheckpointJob, CheckpointOptions, CheckpointSession
from sharded_scan.combiners.column_split import round_up
from sharded_scan.layout import data_sharding
from sharded_scan.paths import as_path
from sharded_scan.relayout import (
    block_moves,
    compact,
    compact_shape,
    compile_scatter_sum,
    merged_and_split,
    relayout,
    scatters,
    split_axis,
)

RESULTS = os.path.join(os.path.dirname(__file__), "results")
CHIPS, CHIPS_PER_HOST = (256, 1024, 4096), 4
BEFORE_BUDGET = 2 << 30  # bytes the before path's all-gather may take over the 8 devices


def jobs() -> dict:
    """Name: (combiner, rows' spec)."""
    row = lambda d: jax.ShapeDtypeStruct((d,), np.float32)  # noqa: E731
    return {
        "Sum": (ss.Sum(), row(64)),
        "Gram d=256": (ss.Gram(), row(256)),
        "Gram d=1024": (ss.Gram(), row(1024)),
        "Quantiles": (ss.Quantiles(num_buckets=10, k=1024), row(64)),
        "LinearRegression": (ss.LinearRegression(), (row(63), jax.ShapeDtypeStruct((), np.float32))),
    }


def before_merge(prog: pg.Program, partials):
    """Main's merge: a sum in one SPMD program (all-gather, then the fold); any other merge
    all-gathered, then folded by each process on one device (``tree_fold``'s tree)."""
    if prog.combiner.additive:
        return merging.compile_gather_merge(prog.combiner, prog.mesh, prog.options.precision, prog.fixed_products)(
            partials, prog.operands)
    gathered = merging.compile_gather(prog.combiner, prog.mesh)(partials)
    local = jax.tree.map(lambda x: x.addressable_data(0), gathered)
    merge = merging.compile_pair_merge(prog.combiner, prog.options.precision, prog.fixed_products)
    operands = jax.device_put(prog.host_operands, jax.tree.leaves(local)[0].device)
    return merging.tree_fold(lambda a, b: merge(a, b, operands), sharding.shards_of(local))


def folded_partials(prog: pg.Program, seed: int = 0):
    """The partials after one step of random rows (states that are not the identity)."""
    rng = np.random.default_rng(seed)
    rows = prog.layout.rows_per_step
    batch = jax.tree.map(lambda s: (3 + rng.normal(size=(rows, *s.shape))).astype(s.dtype), prog.spec)
    batch = jax.device_put(batch, data_sharding(prog.mesh))
    return prog.step(prog.init(), batch, rows)


def best_seconds(call, repeats: int) -> float:
    jax.block_until_ready(call())  # compile
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(call())
        best = min(best, time.perf_counter() - start)
    return best


def point(name: str, shards: int, repeats: int) -> dict:
    combiner, spec = jobs()[name]
    devices = min(shards, 8)
    options = ss.RunOptions(mesh=f"data:{devices}", logical_shards=shards, microbatch=32, steps_per_call=1)
    prog = pg.program_for_spec(combiner, spec, shards * 32, options)
    state = sum(int(np.prod(s.shape[1:])) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(prog.like))
    partials = folded_partials(prog)
    per_device, rounds = shards // devices, (devices - 1).bit_length()
    by_processes = prog.merge_route is merging.MergeRoute.PROCESS_TREE
    out = {
        "job": name, "shards": shards, "devices": devices, "state_bytes": state,
        "route": str(prog.merge_route),
        "checkpoint_bytes_per_save": shards * state,
        # before: the all-gather's S states on every device; after, the process tree: the fold's
        # stack on the process's first device (log2 of the process's shards), the one taken, a
        # partner and merge; the device tree of a sum: the halves of its level-by-level fold, a
        # round's partner and merge.
        "extra_states_before": shards,
        "extra_states_after": shards.bit_length() + 2 if by_processes else per_device + 2,
        # into the device that merges: the process tree (one process here) brings its other devices'
        # states to its first device, one at a time; a sum's device tree: a state a round and the broadcast
        "bytes_in_before": (shards - per_device) * state,
        "bytes_in_after": (shards - per_device) * state if by_processes else 2 * rounds * state,
        # merges the busiest device runs one after another: before, one device folds all S;
        # after, the process tree (one process) folds its S on one device, compiling the merge once;
        # a sum's device tree: its own at log2 levels, then a merge a round
        "merge_depth_before": shards - 1,
        "merge_depth_after": shards - 1 if by_processes else (per_device - 1).bit_length() + rounds,
        "seconds_after": best_seconds(lambda: prog.merge(partials), repeats),
    }
    if shards * state * devices <= BEFORE_BUDGET:
        out["seconds_before"] = best_seconds(lambda: before_merge(prog, partials), repeats)
        got, want = (jax.tree.leaves(sharding.to_host(f())) for f in (lambda: prog.merge(partials),
                                                                 lambda: before_merge(prog, partials)))
        out["bitwise_as_before"] = all(np.array_equal(a, b, equal_nan=True) for a, b in zip(got, want, strict=True))
    return out


def disk_bytes(directory: str) -> int:
    """Bytes of the files under ``directory``."""
    path = as_path(directory)
    return sum(disk_bytes(p) if p.is_dir() else p.stat().length for p in path.iterdir())


def checkpointer(prog: pg.Program, directory: str, compact_saves: bool, saves=compact):
    """``prog``'s checkpoints in ``directory``, opened: its latest checkpoint restored (on the devices);
    a compact save writes ``saves(prog, partials)``."""
    ckpt = Checkpointer(CheckpointOptions(directory, every_steps=1, every_seconds=None, keep=1, compact=compact_saves))
    session = ckpt.open(CheckpointJob(prog.like, prog.fingerprint, prog.shape_meta, functools.partial(relayout, prog),
                                      functools.partial(saves, prog)))
    restored = session.restore_latest()
    if restored is not None:
        jax.block_until_ready(restored.partials)
    return session


def checkpoint_point(name: str, shards: int, rows: int) -> dict:
    """Bytes and seconds of a per-shard and a compact save of S = ``shards`` partials, and their restores
    (``rows``: the job's, the same for every S, at least 16 steps of the largest S: one fingerprint)."""
    combiner, spec = jobs()[name]
    options = ss.RunOptions(mesh=f"data:{min(shards, 8)}", logical_shards=shards, microbatch=32, steps_per_call=1)
    prog = pg.program_for_spec(combiner, spec, rows, options)
    elastic = pg.program_for_spec(combiner, spec, rows, ss.RunOptions(mesh="data:8", microbatch=32, steps_per_call=1))
    state = sum(int(np.prod(s.shape[1:])) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(prog.like))
    partials = folded_partials(prog)
    out = {"job": name, "shards": shards, "devices": min(shards, 8), "state_bytes": state}
    for mode in ("per_shard", "compact"):
        with tempfile.TemporaryDirectory() as directory:
            out[f"{mode}_save_seconds"] = save_seconds(checkpointer(prog, directory, mode == "compact"), partials)
            out[f"{mode}_bytes_per_save"] = disk_bytes(os.path.join(directory, "32"))
            out[f"{mode}_bytes_per_state"] = out[f"{mode}_bytes_per_save"] / state
            for restore, target in (("restore", prog), ("elastic_restore", elastic)):
                if restore == "elastic_restore" and (mode == "compact" or shards == 8):
                    continue  # a compact restore is the same on any mesh; S=8 is in place on data:8
                checkpointer(target, directory, False).close()  # compiles what the restore runs
                start = time.perf_counter()
                checkpointer(target, directory, False).close()
                out[f"{mode}_{restore}_seconds"] = time.perf_counter() - start
    return out


def save_seconds(ckpt: CheckpointSession, partials, repeats: int = 1) -> float:
    """A save's seconds until written (best of ``repeats``), after a first save compiled what a save runs
    (compact: the merge); closes ``ckpt``."""
    ckpt.save(16, 1, partials, {})
    ckpt.raise_failure()  # waits for it
    best = math.inf
    for cursor in range(32, 32 + 16 * repeats, 16):
        start = time.perf_counter()
        ckpt.save(cursor, 1, partials, {})
        ckpt.raise_failure()  # waits for the write
        best = min(best, time.perf_counter() - start)
    ckpt.close()
    return best


def held_bytes(compiled) -> int:
    """The bytes a device holds as a compiled program's outputs (XLA's memory analysis)."""
    return int(compiled.memory_analysis().output_size_in_bytes)


#: Additive jobs whose compact save is also timed on a mesh with a ``model`` axis (:func:`scatter_point`):
#: ``Gram``'s state split over ``model``, ``Sum``'s leaves whole on each device.
SCATTER_MODEL = {"Gram d=1024": "data:4,model:2", "Sum": "data:4,model:2"}


def scatter_point(name: str, repeats: int, mesh: str = "data:8") -> dict:
    """A compact save of an additive job without ``logical_shards`` on ``mesh``, where the merge is one
    ``psum``: main's path (:func:`merged_and_split`: the ``psum``, the whole state, or its ``model`` block, on
    every device, then each leaf flattened and split, a split one gathered whole first) beside the
    reduce-scatter straight into the split leaves (:func:`compile_scatter_sum`; a split leaf's block
    reduce-scattered over ``data``, then its pieces permuted). Seconds of that alone (best of ``repeats``)
    and of a save until written; the bytes a device holds after the collective (its outputs, XLA's memory
    analysis; before, on a split mesh, with the largest leaf gathered whole) and receives
    (:func:`received_bytes`)."""
    combiner, spec = jobs()[name]
    options = ss.RunOptions(mesh=mesh, microbatch=32, steps_per_call=1)
    prog = pg.program_for_spec(combiner, spec, 16 * 32 * 8, options)
    n, partials = prog.mesh.size, folded_partials(prog)
    state = sum(int(np.prod(s.shape[1:])) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(prog.like))
    psum = merging.compile_psum_merge(prog.combiner, prog.mesh).lower(prog.like, prog.operands)
    gathered = 0
    if prog.combiner.partition(prog.mesh) is not None:  # merged_and_split's _flat gathers a split leaf whole
        gathered = max(int(np.prod(s.shape[1:])) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(prog.like))
    before_in, after_in = received_bytes(prog)
    out = {"job": name, "mesh": mesh, "devices": n, "state_bytes": state, "scatters": scatters(prog),
           "held_bytes_before": held_bytes(psum.compile()) + gathered,
           "held_bytes_after": held_bytes(compile_scatter_sum(prog.combiner, prog.mesh).lower(prog.like).compile()),
           "received_bytes_before": before_in, "received_bytes_after": after_in}
    before = lambda p, x: (merged_and_split(p, x), compact_shape(p.mesh))  # noqa: E731 - main's compact save
    for when, saves in (("before", before), ("after", compact)):
        out[f"seconds_{when}"] = best_seconds(lambda saves=saves: saves(prog, partials)[0], repeats)
        with tempfile.TemporaryDirectory() as directory:
            out[f"save_seconds_{when}"] = save_seconds(checkpointer(prog, directory, True, saves), partials, repeats)
    got, want = (jax.tree.leaves(sharding.to_host(f(prog, partials)[0])) for f in (compact, before))
    out["bitwise_as_before"] = all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    return out


def received_bytes(prog: pg.Program) -> tuple[int, int]:
    """The bytes a device receives in a compact save's collectives, before and after (ring algorithms, a
    model): before, each leaf's ``psum`` over ``data`` (2 (D - 1) / D of what a device holds of it) and a
    split leaf gathered whole over ``model`` ((M - 1) / M of it); after, each leaf's ``psum_scatter`` over
    ``data`` ((D - 1) / D of what it scatters: a whole leaf's D pieces at the device's place on the other
    axes, 1/M of it padded; a split leaf's block) and, for a split leaf, the busiest device's share of the
    ``ppermute``s that move its pieces (:func:`block_moves`)."""
    d, m = prog.layout.data_size, dict(prog.mesh.shape).get("model", 1)
    before = after = 0
    for leaf in jax.tree.leaves(prog.like):
        item, whole = np.dtype(leaf.dtype).itemsize, int(np.prod(leaf.shape[1:]))
        axis = split_axis(leaf.sharding.spec)
        if axis is None:
            before += 2 * (d - 1) * whole * item // d
            after += (d - 1) * (round_up(whole, prog.mesh.size) // prog.mesh.size) * item
            continue
        block = list(leaf.shape[1:])
        block[axis] //= m
        moves = block_moves(tuple(block), axis, tuple(prog.mesh.devices.shape), prog.mesh.axis_names)
        before += 2 * (d - 1) * (whole // m) * item // d + (m - 1) * whole * item // m
        moved = np.zeros(prog.mesh.size, np.int64)
        for _, pairs, *_, count in moves.rounds:
            moved += 0 if pairs is None else count
        after += ((d - 1) * moves.run + int(moved.max())) * item
    return before, after


def process_point(name: str, shards: int, repeats: int) -> dict:
    """One process's merge seconds, before and after, on all devices of every process (run in each)."""
    combiner, spec = jobs()[name]
    options = ss.RunOptions(mesh="data:-1", logical_shards=shards, microbatch=32, steps_per_call=1)
    prog = pg.program_for_spec(combiner, spec, shards * 32, options)
    partials = folded_partials(prog)
    return {"job": name, "shards": shards, "processes": jax.process_count(), "devices": jax.device_count(),
            "seconds_after": best_seconds(lambda: prog.merge(partials), repeats),
            "seconds_before": best_seconds(lambda: before_merge(prog, partials), repeats)}


def over_processes(name: str, shards: int, repeats: int, splits=((1, 8), (2, 4), (4, 2), (8, 1))) -> list[dict]:
    """:func:`process_point` on ``splits`` (processes, devices each) of 8 devices; the slowest process's."""
    from tests import multiprocess

    out = []
    for split in splits:
        got = multiprocess.run_processes("bench.scale:process_point", *split, timeout=900,
                                         kwargs={"name": name, "shards": shards, "repeats": repeats})
        out.append({**got[0], **{k: max(g[k] for g in got) for k in ("seconds_after", "seconds_before")}})
        print(json.dumps(out[-1]), flush=True)
    return out


def projection(points: list[dict], gbps: float) -> dict:
    """Seconds at CHIPS, before and after (see the module docstring)."""
    timed = [p for p in points if "seconds_before" in p and p["shards"] >= 8]
    if len(timed) < 2:
        return {}
    s = np.array([p["shards"] for p in timed], float)
    m = max(float(np.polyfit(s, [p["seconds_before"] for p in timed], 1)[0]), 1e-6)
    state, bw = points[0]["state_bytes"], gbps * 1e9
    if points[0]["route"] == "device_tree":  # a sum: the chips pair up, a merge and a state a round
        after = lambda n: math.log2(n) * (m + 2 * state / bw)  # noqa: E731
        held = 3  # one shard a chip: a round's partner and merge
    else:  # the process tree: each host folds its chips' states on one, the hosts pair up
        after = lambda n: m * (CHIPS_PER_HOST - 1) + math.log2(n / CHIPS_PER_HOST) * (m + 2 * state / bw)  # noqa: E731
        held = CHIPS_PER_HOST.bit_length() + 2  # point's extra_states_after for a host's shards
    return {"merge_seconds": m, "gbps": gbps, **{str(n): {
        "before": m * (n - 1) + n * state / bw, "after": after(n),
        "extra_bytes_per_device_before": n * state, "extra_bytes_per_device_after": held * state,
        "checkpoint_bytes_per_save": n * state} for n in CHIPS}}


SPLIT_JOBS = {"Quantiles": 64, "Covariance": 256}  # columns


def split_point(name: str, shards: int, repeats: int) -> dict:
    """A state split over ``model`` (``data:4,model:2``, ``logical_shards=S``): main's merge (every
    shard's block all-gathered over ``data``, then folded in one program tracing S - 1 merges:
    ``compile_gather_merge``) beside the device tree (:meth:`Program.merge`: each device its own shards by
    levels, then log2(4) rounds of ``ppermute``); the first call's seconds (its compile) and the best
    of ``repeats`` after it."""
    combiner = {"Quantiles": ss.Quantiles(num_buckets=10, k=1024), "Covariance": ss.Covariance()}[name]
    spec = jax.ShapeDtypeStruct((SPLIT_JOBS[name],), np.float32)
    options = ss.RunOptions(mesh="data:4,model:2", logical_shards=shards, microbatch=32, steps_per_call=1)
    prog = pg.program_for_spec(combiner, spec, shards * 32, options)
    partials = folded_partials(prog)
    before = merging.compile_gather_merge(prog.combiner, prog.mesh, prog.options.precision, prog.fixed_products)
    calls = {"before": lambda: before(partials, prog.operands), "after": lambda: prog.merge(partials)}
    out = {"job": name, "mesh": "data:4,model:2", "shards": shards, "route_after": str(prog.merge_route)}
    for key, call in calls.items():
        start = time.perf_counter()
        jax.block_until_ready(call())
        out[f"first_call_seconds_{key}"] = time.perf_counter() - start
        out[f"seconds_{key}"] = best_seconds(call, repeats)
    got, want = (jax.tree.leaves(sharding.to_host(calls[k]())) for k in ("after", "before"))
    out["bitwise_as_before"] = all(np.array_equal(a, b, equal_nan=True) for a, b in zip(got, want, strict=True))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--gbps", type=float, default=10.0, help="assumed inter-host GB/s for the projection")
    parser.add_argument("--jobs", default=",".join(jobs()))
    parser.add_argument("--processes", type=int, default=0, help="S for the 1-8 process splits (0: none)")
    parser.add_argument("--checkpoints", action="store_true", help="checkpoint bytes and seconds, per-shard vs compact")
    parser.add_argument("--split", action="store_true", help="a state split over model: gathered vs the device tree")
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", 8)
    if args.split:
        counts = [4, 8, 16] if args.quick else [4, 8, 16, 32, 64]
        points = [split_point(name, s, args.repeats) for name in SPLIT_JOBS for s in counts]
        for p in points:
            print(json.dumps(p), flush=True)
        write_results("scale_split.json", {"points": points})
        return
    if args.checkpoints:
        counts = [1, 8, 32] if args.quick else [1, 8, 32, 64, 256]
        points = [checkpoint_point(name, s, 16 * 32 * counts[-1]) for name in args.jobs.split(",") for s in counts]
        for p in points:
            print(json.dumps(p), flush=True)
        additive = [name for name in args.jobs.split(",") if jobs()[name][0].additive]
        scatter = [scatter_point(name, args.repeats) for name in additive]
        scatter += [scatter_point(name, args.repeats, SCATTER_MODEL[name]) for name in additive
                    if name in SCATTER_MODEL]
        for p in scatter:
            print(json.dumps(p), flush=True)
        write_results("scale_checkpoints.json", {"points": points, "scatter": scatter})
        return
    if args.processes:
        points = [p for name in args.jobs.split(",") for p in over_processes(name, args.processes, args.repeats)]
        write_results("scale_processes.json", {"points": points})
        return
    shards = [1, 2, 4, 8, 16, 32, 64] + ([] if args.quick else [128, 256])
    repeats = 1 if args.quick else args.repeats
    out = {"points": [], "projection": {}, "gbps": args.gbps}
    for name in args.jobs.split(","):
        caps = {"Gram d=1024": 64}  # 256 states of 4 MiB on each of 8 devices do not fit this machine
        points = [point(name, s, repeats) for s in shards if s <= caps.get(name, 256)]
        for p in points:
            print(json.dumps(p), flush=True)
        out["points"] += points
        out["projection"][name] = projection(points, args.gbps)
        print(name, json.dumps(out["projection"][name], indent=None), flush=True)
    write_results("scale_quick.json" if args.quick else "scale.json", out)


def write_results(filename: str, fresh: dict) -> None:
    """``fresh`` into ``bench/results/filename``, keeping the jobs a run with ``--jobs`` did not
    measure: each list's entries of the jobs ``fresh`` has replace theirs, a dict's keys theirs."""
    path = os.path.join(RESULTS, filename)
    kept = {}
    if os.path.exists(path):
        with open(path) as f:
            kept = json.load(f)
    rerun = {entry["job"] for value in fresh.values() if isinstance(value, list) for entry in value}
    out = dict(kept)
    for key, value in fresh.items():
        if isinstance(value, list):
            out[key] = [e for e in kept.get(key, []) if e.get("job") not in rerun] + value
        elif isinstance(value, dict):
            out[key] = {**kept.get(key, {}), **value}
        else:
            out[key] = value
    os.makedirs(RESULTS, exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
