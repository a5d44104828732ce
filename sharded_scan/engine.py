"""The engine: builds the per-device step, runs the loop, merges once, finalizes.

Each device keeps its own partial accumulator (a leading ``data`` axis of size D on
every accumulator leaf, sharded over ``data``). A step folds ``steps_per_call``
micro-batches per device with ``lax.scan`` and has no cross-device collective; the
partials are donated so they stay in place. At the end one collective merges them:
a ``psum`` for additive combiners, otherwise one all-gather and a fixed-order tree
fold with ``combiner.merge``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sharded_scan.checkpoint import Checkpointer, as_checkpointer, fingerprint
from sharded_scan.combiners.base import Combiner
from sharded_scan.combiners.wrappers import NonFiniteWatch, apply_policies
from sharded_scan.distributed import Preempted, PreemptionWatch
from sharded_scan.errors import UsageError
from sharded_scan.layout import Layout, check_positive_int, data_sharding, make_layout
from sharded_scan.mesh import DATA_AXIS, make_mesh
from sharded_scan.prefetch import device_batches
from sharded_scan.sources import as_source
from sharded_scan.watchdog import Watchdog, is_peer_lost

PyTree = Any
_log = logging.getLogger(__name__)

# From the sweep in bench/results/bench.json (Gram on 8 simulated CPU devices): the best
# micro-batch holds about the same bytes whatever the row width (4096 rows at d=256, 1024
# at d=1024), except that narrow rows want at most 16384 rows a micro-batch (2 MiB at
# d=32: 1.6x faster than 32768); so the default is a byte budget with a row cap.
DEFAULT_MICROBATCH = None          # None: DEFAULT_MICROBATCH_BYTES of rows
DEFAULT_MICROBATCH_BYTES = 4 << 20
MICROBATCH_RANGE = (256, 1 << 14)
# A compiled step has a fixed cost (dispatch, waiting for the slowest device), so small
# micro-batches get more of them per step: at least STEP_BYTES_PER_SHARD of rows per
# logical shard (8 steps of 4 MiB; 16 of 2 MiB at d=32, 1.4x faster there than 8).
DEFAULT_STEPS_PER_CALL = None      # None: default_steps_per_call
MIN_STEPS_PER_CALL = 8
STEP_BYTES_PER_SHARD = 32 << 20


def row_bytes(spec: PyTree) -> int:
    """Bytes of one row of ``spec`` (all leaves)."""
    return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(spec))


def default_microbatch(spec: PyTree) -> int:
    """The power-of-two row count nearest ``DEFAULT_MICROBATCH_BYTES`` of rows of ``spec``,
    within ``MICROBATCH_RANGE``."""
    rows = 2 ** round(np.log2(max(DEFAULT_MICROBATCH_BYTES / max(row_bytes(spec), 1), 1)))
    return int(np.clip(rows, *MICROBATCH_RANGE))


def default_steps_per_call(spec: PyTree, microbatch: int) -> int:
    """Micro-batches per compiled step: ``MIN_STEPS_PER_CALL``, or the power of two that
    makes a step hold ``STEP_BYTES_PER_SHARD`` of rows per logical shard if that is more."""
    micro_bytes = max(int(microbatch) * row_bytes(spec), 1)
    return int(max(MIN_STEPS_PER_CALL, 2 ** int(np.ceil(np.log2(max(STEP_BYTES_PER_SHARD / micro_bytes, 1))))))


def resolve_chunking(spec: PyTree, microbatch: int | None = None, steps_per_call: int | None = None) -> tuple[int, int]:
    """``(microbatch, steps_per_call)`` with each None replaced by its default for rows of ``spec``."""
    if microbatch is None:
        microbatch = default_microbatch(spec)
    check_positive_int("microbatch", microbatch)
    if steps_per_call is None:
        steps_per_call = default_steps_per_call(spec, microbatch)
    return microbatch, steps_per_call


class Progress(NamedTuple):
    """What the engine reports after each step."""

    step: int          # steps done in this run (counting from the resumed one)
    total_steps: int
    rows_done: int     # cursor: rows folded so far, including those of a resumed checkpoint
    num_rows: int
    seconds: float     # since the loop started


def cached(build: Callable) -> Callable:
    """Memoizes an engine builder on its (hashable) arguments, so repeated runs of the
    same job reuse the compiled step instead of tracing and compiling it again."""
    memo = functools.lru_cache(maxsize=32)(build)

    @functools.wraps(build)
    def lookup(*args, **kwargs):
        try:
            hash((args, tuple(kwargs.items())))
        except TypeError:  # an unhashable user combiner: build afresh
            return build(*args, **kwargs)
        return memo(*args, **kwargs)

    lookup.cache_clear, lookup.cache_info = memo.cache_clear, memo.cache_info
    return lookup


def accumulator_specs(combiner: Combiner, mesh: Mesh, *lead: str | None) -> PyTree:
    """The PartitionSpecs of the accumulator leaves, with ``lead`` axes in front.

    A pytree prefix of the accumulator: ``P(*lead)`` for a replicated combiner, else
    ``combiner.partition(mesh)`` with ``lead`` prepended to every entry.
    """
    parts = combiner.partition(mesh)
    if parts is None:
        return P(*lead)
    return jax.tree.map(lambda p: P(*lead, *p), parts, is_leaf=lambda x: isinstance(x, P))


@cached
def build_step(combiner: Combiner, mesh: Mesh, layout: Layout) -> Callable:
    """Returns ``step(partials, batch, num_valid) -> partials``, jitted and donating partials.

    ``batch`` holds ``layout.rows_per_step`` rows sharded over ``data``; of them the
    first ``num_valid`` are real. Each logical shard folds its block of rows as
    ``steps_per_call`` micro-batches of ``microbatch`` rows, in order. A shard whose
    block is all real rows takes a branch with a constant all-True mask, which XLA
    folds away.
    """
    combiner = combiner.for_mesh(mesh)
    mb, spc = layout.microbatch, layout.steps_per_call
    per_device, rows_per_shard = layout.shards_per_device, layout.rows_per_shard

    def fold_shard(acc, rows, valid):
        micro = jax.tree.map(lambda x: x.reshape((spc, mb) + x.shape[1:]), rows)
        offsets = jnp.arange(spc, dtype=jnp.int32) * mb

        def ragged(acc, item):
            offset, batch = item
            mask = offset + jnp.arange(mb, dtype=jnp.int32) < valid
            return combiner.add(acc, batch, mask), None

        def full(acc, item):
            return combiner.add(acc, item[1], jnp.ones((mb,), bool)), None

        return jax.lax.cond(
            valid == rows_per_shard,
            lambda acc: jax.lax.scan(full, acc, (offsets, micro))[0],
            lambda acc: jax.lax.scan(ragged, acc, (offsets, micro))[0],
            acc,
        )

    def local_step(partials, batch, num_valid):
        first_row = jax.lax.axis_index(DATA_AXIS) * layout.rows_per_device
        valid = jnp.clip(num_valid - first_row - jnp.arange(per_device) * rows_per_shard, 0, rows_per_shard)
        if per_device == 1:
            acc = fold_shard(jax.tree.map(lambda x: x[0], partials), batch, valid[0])
            return jax.tree.map(lambda x: x[None], acc)
        shards = jax.tree.map(lambda x: x.reshape((per_device, rows_per_shard) + x.shape[1:]), batch)
        # One shard after another, each with the same scan as a lone shard would run.
        return jax.lax.map(lambda args: fold_shard(*args), (partials, shards, valid))

    partial_specs = accumulator_specs(combiner, mesh, DATA_AXIS)
    step = jax.shard_map(
        local_step, mesh=mesh, in_specs=(partial_specs, P(DATA_AXIS), P()), out_specs=partial_specs
    )
    return jax.jit(step, donate_argnums=0)


def init_partials(combiner: Combiner, spec: PyTree, mesh: Mesh, num_shards: int | None = None) -> PyTree:
    """One identity accumulator per logical shard (default: per device), sharded over
    ``data`` (and over the axes ``combiner.partition`` names)."""
    return identity_program(combiner, spec, mesh, num_shards)()


@cached
def identity_program(combiner: Combiner, spec: PyTree, mesh: Mesh, num_shards: int | None) -> Callable:
    """The jitted (and memoized) maker of :func:`init_partials`'s value."""
    combiner = combiner.for_mesh(mesh)
    size = num_shards or mesh.shape[DATA_AXIS]

    def stacked():
        return jax.tree.map(
            lambda x: jnp.broadcast_to(x[None], (size,) + x.shape), combiner.init(spec)
        )

    return jax.jit(stacked, out_shardings=named(mesh, accumulator_specs(combiner, mesh, DATA_AXIS)))


def named(mesh: Mesh, specs: PyTree) -> PyTree:
    """``NamedSharding``s on ``mesh`` for a pytree (prefix) of PartitionSpecs."""
    return jax.tree.map(lambda p: NamedSharding(mesh, p), specs, is_leaf=lambda x: isinstance(x, P))


def tree_fold(merge: Callable, items: list) -> Any:
    """Merges ``items`` pairwise in a fixed balanced tree (deterministic order)."""
    while len(items) > 1:
        paired = [merge(items[i], items[i + 1]) for i in range(0, len(items) - 1, 2)]
        items = paired + ([items[-1]] if len(items) % 2 else [])
    return items[0]


@cached
def build_merge(combiner: Combiner, mesh: Mesh, ordered: bool = False) -> Callable:
    """Returns ``merge(partials) -> acc``: one collective over ``data``.

    Additive combiners are merged by one ``psum`` unless ``ordered``; otherwise the
    partials are all-gathered once and folded with ``combiner.merge`` in a fixed tree,
    which makes the result independent of the device count. The result is on every
    device, or split over the axes ``combiner.partition`` names (a wide accumulator is
    summed over ``data`` only, never gathered whole on one device).
    """
    combiner = combiner.for_mesh(mesh)
    partial_specs = accumulator_specs(combiner, mesh, DATA_AXIS)
    merged_specs = accumulator_specs(combiner, mesh)
    if combiner.additive and not ordered:

        def local_psum(partials):
            return jax.tree.map(lambda x: x[0], jax.lax.psum(partials, DATA_AXIS))

        return jax.jit(
            jax.shard_map(local_psum, mesh=mesh, in_specs=(partial_specs,), out_specs=merged_specs)
        )

    def gather_and_fold(partials):
        everywhere = jax.lax.with_sharding_constraint(partials, named(mesh, accumulator_specs(combiner, mesh, None)))
        count = jax.tree.leaves(everywhere)[0].shape[0]
        parts = [jax.tree.map(lambda x, i=i: x[i], everywhere) for i in range(count)]
        return tree_fold(combiner.merge, parts)

    return jax.jit(gather_and_fold, out_shardings=named(mesh, merged_specs))


def to_host(tree: PyTree) -> PyTree:
    """Copies a device pytree to host numpy (works on every process).

    A replicated leaf is read from a local copy; a leaf split over devices is gathered
    (across processes too, when some shards live elsewhere).
    """

    def fetch(x):
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        if x.is_fully_addressable:
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(fetch, tree)


class RunReport(NamedTuple):
    """What a run did, for logs and ``summary.json``."""

    rows: int                  # rows of the dataset (all folded once the run finishes)
    rows_this_run: int         # rows folded by this run (less when it resumed)
    seconds: float             # wall time of this run, restore to result
    steps: int                 # steps run by this run
    resumed_from_cursor: int | None  # the checkpoint's cursor when the run resumed
    resumed_from_step: int | None    # steps done before the resume (over all earlier runs)
    checkpoints_written: int
    merge_bytes: int           # bytes of one shard's accumulator pytree: what the final merge moves per shard
    devices: int
    processes: int
    mesh: dict[str, int]


def run(combiner: Combiner, data: Any, **options: Any) -> Any:
    """Reduces ``data`` with ``combiner`` over every device of ``mesh``.

    Args:
      combiner: the reduction, e.g. ``sharded_scan.Gram()``.
      data: a numpy array, a pytree of arrays with one leading row dimension such as
        ``(X, y)``, or a :class:`sharded_scan.sources.Source`.
      mesh: a ``Mesh`` or a spec such as ``"data:8"``; all devices on ``data`` by default.
      microbatch: rows per device per scan iteration; None: :func:`default_microbatch`.
      steps_per_call: micro-batches each logical shard folds per compiled call; None:
        :func:`default_steps_per_call`.
      prefetch: steps placed on the devices ahead of use (0 turns prefetching off).
      logical_shards: a fixed number of independent accumulators (a multiple of the
        ``data`` axis size). Each folds fixed rows in a fixed order and they merge in a
        fixed tree, so the result is bitwise identical on every device count dividing it.
        None: one accumulator per device, merged by ``psum`` when additive.
      nan_policy: rows holding NaN or Inf: ``"propagate"`` (numpy's behaviour),
        ``"omit"`` (skipped like padding) or ``"raise"`` (stop at the first such step).
      compensated: Kahan-compensated float accumulation for additive combiners.
      checkpoint: None, a directory, :class:`sharded_scan.CheckpointOptions` or a
        :class:`sharded_scan.checkpoint.Checkpointer`. The run then resumes from the
        latest checkpoint there (verifying it belongs to this job), saves every
        ``every_steps`` / ``every_seconds`` and at the end, and on SIGTERM saves and
        raises :class:`sharded_scan.Preempted`.
      progress: called with a :class:`Progress` after every step.
      step_timeout: seconds; when no step finishes for that long (a stuck process or
        peer), print one line and end the process with status 3
        (:class:`sharded_scan.watchdog.Watchdog`). None (the default) for no watchdog.

    Returns:
      ``combiner.finalize`` of the merged accumulator: host numpy, the same on every
      process.

    Raises:
      UsageError: bad data, mesh or arguments, or a checkpoint of another job, before
        any compute.
      Preempted: SIGTERM arrived; a checkpoint was saved and rerunning resumes from it.
    """
    return run_with_report(combiner, data, **options)[0]


def run_with_report(
    combiner: Combiner,
    data: Any,
    *,
    mesh: Mesh | str | None = None,
    microbatch: int | None = DEFAULT_MICROBATCH,
    steps_per_call: int | None = DEFAULT_STEPS_PER_CALL,
    prefetch: int = 2,
    logical_shards: int | None = None,
    nan_policy: str = "propagate",
    compensated: bool = True,
    checkpoint: Any = None,
    progress: Callable[[Progress], None] | None = None,
    step_timeout: float | None = None,
) -> tuple[Any, RunReport]:
    """Like :func:`run` (which documents every option), also returning a :class:`RunReport`."""
    if step_timeout is not None:  # the same run, watched from restore to result
        with Watchdog(step_timeout) as dog:
            return run_with_report(
                combiner, data, mesh=mesh, microbatch=microbatch, steps_per_call=steps_per_call, prefetch=prefetch,
                logical_shards=logical_shards, nan_policy=nan_policy, compensated=compensated,
                checkpoint=checkpoint, progress=dog.wrap(progress),
            )
    started = time.perf_counter()
    if not isinstance(combiner, Combiner):
        raise UsageError(f"combiner must be a sharded_scan Combiner, got {type(combiner).__name__}.")
    if isinstance(prefetch, bool) or not isinstance(prefetch, (int, np.integer)) or prefetch < 0:
        raise UsageError(f"prefetch must be a non-negative integer, got {prefetch!r}.")
    combiner = apply_policies(combiner, nan_policy=nan_policy, compensated=compensated)
    source = as_source(data)
    if source.num_rows == 0:
        raise UsageError("the data has zero rows; there is nothing to reduce.")
    combiner.check_spec(source.spec)
    mesh = make_mesh(mesh)
    microbatch, steps_per_call = resolve_chunking(source.spec, microbatch, steps_per_call)
    layout = make_layout(source.num_rows, mesh, microbatch, steps_per_call, logical_shards)
    ckpt = as_checkpointer(checkpoint)
    try:
        state = start_state(combiner, source, mesh, layout, ckpt, microbatch)
        step = build_step(combiner, mesh, layout)
        partials, cursor, steps_before = state.partials, state.cursor, state.steps_before
        watch = NonFiniteWatch(combiner)
        meta = {"fingerprint": state.fingerprint, "shards": layout.num_shards, "devices": mesh.size,
                "processes": jax.process_count()}
        partials, steps = scan_loop(
            step, partials, source, layout, mesh, cursor=cursor, prefetch=prefetch, ckpt=ckpt, meta=meta,
            steps_before=steps_before, watch=watch, progress=progress, started=started,
        )
        watch.check()
        if ckpt is not None and steps:  # the finished state: rerunning returns the result at once
            ckpt.save(layout.num_rows, steps_before + steps, partials, meta)
    except Exception as e:
        if ckpt is not None and jax.process_count() > 1 and is_peer_lost(e):
            ckpt.abandon()  # a save in flight would wait for the dead peer until the heartbeat aborts us
        raise
    finally:
        if ckpt is not None:
            ckpt.close()  # waits for the saves in flight, also when the loop failed
    merge_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(partials)) // layout.num_shards
    merged = build_merge(combiner, mesh, ordered=logical_shards is not None)(partials)
    result = combiner.finalize(to_host(merged))
    report = RunReport(
        rows=layout.num_rows,
        rows_this_run=layout.num_rows - cursor,
        seconds=time.perf_counter() - started,
        steps=steps,
        resumed_from_cursor=state.resumed_from,
        resumed_from_step=steps_before if state.resumed_from is not None else None,
        checkpoints_written=0 if ckpt is None else ckpt.written,
        merge_bytes=merge_bytes,
        devices=mesh.size,
        processes=jax.process_count(),
        mesh=dict(mesh.shape),
    )
    return result, report


def scan_loop(
    step: Callable, partials: PyTree, source: Any, layout: Layout, mesh: Mesh, *, cursor: int, prefetch: int,
    ckpt: Checkpointer | None, meta: dict, steps_before: int, watch: NonFiniteWatch,
    progress: Callable[[Progress], None] | None, started: float,
) -> tuple[PyTree, int]:
    """Folds every step from ``cursor`` on; saves between steps; stops on preemption.

    Returns:
      ``(partials, steps)``: the partials after the last row, and the steps run.

    Raises:
      Preempted: after saving a checkpoint at the step boundary all processes agreed on.
    """
    total, steps = layout.num_steps(cursor), 0
    batches = device_batches(source, layout, mesh, cursor, prefetch)
    with PreemptionWatch(enabled=ckpt is not None) as preemption, contextlib.closing(batches):
        for i, item in enumerate(batches):
            partials = step(partials, item.batch, np.int32(item.num_valid))
            watch.after_step(partials, item.cursor, item.num_valid)
            jax.block_until_ready(partials)  # one step in flight: prefetch alone bounds memory
            steps, done = i + 1, item.cursor + item.num_valid
            if progress is not None:
                progress(Progress(steps, total, done, layout.num_rows, time.perf_counter() - started))
            if ckpt is None or done >= layout.num_rows:
                continue
            if preemption.should_stop(i):
                watch.check()
                ckpt.save(done, steps_before + steps, partials, meta)
                raise Preempted(done, layout.num_rows, ckpt.directory)
            if ckpt.due(steps_before + steps):
                watch.check()
                ckpt.save(done, steps_before + steps, partials, meta)
    return partials, steps


class StartState(NamedTuple):
    """Where a run starts: fresh, or from a checkpoint."""

    partials: PyTree
    cursor: int
    steps_before: int
    fingerprint: dict | None = None
    resumed_from: int | None = None


def start_state(
    combiner: Combiner, source: Any, mesh: Mesh, layout: Layout, ckpt: Checkpointer | None, microbatch: int
) -> StartState:
    """Fresh identity partials, or those of the latest checkpoint, verified and laid out.

    A checkpoint with the current shard count is restored in place (bitwise the state
    it saved). One with another shard count is folded with ``combiner.merge`` into one
    accumulator, laid out as ``[merged, init, init, ...]`` over the current shards.
    """
    if ckpt is None:
        return StartState(init_partials(combiner, source.spec, mesh, layout.num_shards), 0, 0)
    current = fingerprint(combiner, source, microbatch)
    like = jax.eval_shape(lambda: init_partials(combiner, source.spec, mesh, layout.num_shards))

    def restore(cursor: int, meta: dict) -> PyTree:
        ckpt.verify(meta, current, like)  # reads the arrays' metadata: may find damage too
        if meta["shards"] == layout.num_shards:
            return ckpt.restore_partials(cursor, like, data_sharding(mesh))
        return relayout(combiner, ckpt.restore_partials(cursor, like), source.spec, mesh, layout.num_shards)

    for cursor in ckpt.candidates():  # newest first; a damaged one is set aside with a warning
        meta = ckpt.read_meta(cursor)
        partials = ckpt.try_restore(cursor, functools.partial(restore, cursor, meta))
        if partials is None:
            continue
        _log.info(
            "resuming from the checkpoint at row %d of %d (step %d, written by %d shards on %d devices) in %s",
            cursor, layout.num_rows, meta["steps"], meta["shards"], meta["devices"], ckpt.directory,
        )
        return StartState(partials, int(meta["cursor"]), int(meta["steps"]), current, int(meta["cursor"]))
    return StartState(init_partials(combiner, source.spec, mesh, layout.num_shards), 0, 0, current)


def relayout(combiner: Combiner, saved: PyTree, spec: PyTree, mesh: Mesh, num_shards: int) -> PyTree:
    """Folds host partials (any leading shard count) into ``[merged, init, ...]`` over ``num_shards``."""
    count = jax.tree.leaves(saved)[0].shape[0]

    def fold(saved):
        merged = tree_fold(combiner.merge, [jax.tree.map(lambda x, i=i: x[i], saved) for i in range(count)])
        identity = combiner.init(spec)
        return jax.tree.map(
            lambda m, z: jnp.concatenate([m[None], jnp.broadcast_to(z[None], (num_shards - 1,) + z.shape)]),
            merged, identity,
        )

    host = jax.tree.map(np.asarray, jax.jit(fold)(saved))
    sharding = data_sharding(mesh)
    return jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, sharding, lambda idx, x=x: x[idx]), host)


# `run` takes exactly the options of `run_with_report`; show them to help() and IDEs.
run.__signature__ = inspect.signature(run_with_report).replace(return_annotation=Any)
