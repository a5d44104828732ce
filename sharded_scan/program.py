"""A job resolved once: the combiner as every program runs it, its layout, fingerprint and programs.

:func:`build_program` checks and resolves everything a run needs before any compute:
the run's policies wrap the combiner, the mesh resolves it (:meth:`Combiner.for_mesh`),
the layout cuts the rows into steps, the fingerprint names the job, and the compiled
programs are built (memoized, so a rerun of the same job compiles nothing):

- ``init() -> partials``: one identity accumulator per logical shard, with a leading
  shard axis sharded over ``data`` (and over the axes ``combiner.partition`` names);
- ``step(partials, batch, num_valid) -> partials``: each logical shard folds its block
  of the step's rows as ``steps_per_call`` micro-batches with ``lax.scan``; no
  collective; the partials are donated;
- ``merge(partials) -> acc``: a ``psum`` for additive combiners (without
  ``logical_shards``), one collective a leaf for the order-free reductions a combiner names
  (:meth:`Combiner.merge_collectives`), else a fixed tree (:func:`tree_fold`'s): each device, or each process,
  folds its own shards, then log2 rounds of ``ppermute`` and ``combiner.merge`` (see
  :meth:`Program.merge`).

Beside it: :mod:`sharded_scan.admission` refuses a job that cannot fit in memory before
anything compiles, and :mod:`sharded_scan.relayout` lays a checkpoint written with another
shard count or another resolution of the job out on this one.

Every program traces under ``jax.default_matmul_precision(options.precision)`` and takes
the combiner's operands (:meth:`Combiner.operands`) as an argument, so new parameter
values reuse the compiled programs.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import threadpoolctl
from jax.experimental import multihost_utils
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sharded_scan import compile_cache
from sharded_scan.admission import check_fits, memory_estimate  # noqa: F401 - memory_estimate: its old home
from sharded_scan.combiners import wide
from sharded_scan.combiners.base import Combiner, rows_spec
from sharded_scan.combiners.pca import PCA
from sharded_scan.combiners.regression import LinearRegression
from sharded_scan.combiners.wrappers import Wrapper, apply_policies, innermost
from sharded_scan.dtypes import check_placeable, x64_scope
from sharded_scan.errors import UsageError
from sharded_scan.fixed_order import fixed_order, refusal, unpinned
from sharded_scan.identity import job_fingerprint
from sharded_scan.layout import Layout, data_sharding, make_layout, resolve_chunking
from sharded_scan.mesh import DATA_AXIS, make_mesh
from sharded_scan.options import RunOptions
from sharded_scan.sources import ArraySource, Source

PyTree = Any
_log = logging.getLogger(__name__)


def cached(build: Callable) -> Callable:
    """Memoizes a program builder on its (hashable) arguments and whether 64-bit values are
    on (:func:`~sharded_scan.dtypes.x64_scope`), so repeated runs of the same job reuse the
    compiled program instead of tracing and compiling it again."""
    memo = functools.lru_cache(maxsize=32)(lambda x64, *args, **kwargs: build(*args, **kwargs))

    @functools.wraps(build)
    def lookup(*args, **kwargs):
        try:
            hash((args, tuple(kwargs.items())))
        except TypeError:  # an unhashable user combiner: build afresh
            return build(*args, **kwargs)
        return memo(bool(jax.config.jax_enable_x64), *args, **kwargs)

    lookup.cache_clear, lookup.cache_info = memo.cache_clear, memo.cache_info
    return lookup


def accumulator_specs(combiner: Combiner, mesh: Mesh | AbstractMesh, *lead: str | None) -> PyTree:
    """The PartitionSpecs of the accumulator leaves, with ``lead`` axes in front.

    A pytree prefix of the accumulator: ``P(*lead)`` for a replicated combiner, else
    ``combiner.partition(mesh)`` with ``lead`` prepended to every entry.
    """
    parts = combiner.partition(mesh)
    if parts is None:
        return P(*lead)
    return jax.tree.map(lambda p: P(*lead, *p), parts, is_leaf=lambda x: isinstance(x, P))


def operand_specs(combiner: Combiner, mesh: Mesh | AbstractMesh) -> PyTree:
    """The PartitionSpecs of the combiner's operands inside the programs' ``shard_map``:
    ``combiner.operand_partition(mesh)``, or ``P()`` (whole on every device)."""
    parts = combiner.operand_partition(mesh)
    return P() if parts is None else parts


def named(mesh: Mesh, specs: PyTree) -> PyTree:
    """``NamedSharding``s on ``mesh`` for a pytree (prefix) of PartitionSpecs."""
    return jax.tree.map(lambda p: NamedSharding(mesh, p), specs, is_leaf=lambda x: isinstance(x, P))


def tree_fold(merge: Callable, items: Iterable) -> Any:
    """Merges ``items`` pairwise in a fixed balanced tree (deterministic order).

    The tree: item ``i`` merges with ``i + 1`` (``i`` even), those with their neighbours
    two apart, and so on, an odd one out carried up; so the items ``[j * 2^r, (j + 1) * 2^r)``
    are one subtree. Items are taken one at a time (an iterator is consumed lazily), and at
    most ``log2(len(items)) + 1`` merged ones are held at once.
    """
    stack: list[tuple[int, Any]] = []  # (items under it, merged), sizes decreasing
    for item in items:
        size = 1
        while stack and stack[-1][0] == size:
            item, size = merge(stack.pop()[1], item), 2 * size
        stack.append((size, item))
    merged = stack.pop()[1]
    while stack:
        merged = merge(stack.pop()[1], merged)
    return merged


def stacked(combiner: Combiner, spec: PyTree, count: int) -> PyTree:
    """``count`` identity accumulators along a new leading shard axis (traceable)."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x[None], (count,) + x.shape), combiner.init(spec))


def shards_of(partials: PyTree) -> list[PyTree]:
    """The per-shard accumulators of stacked ``partials``."""
    count = jax.tree.leaves(partials)[0].shape[0]
    return [jax.tree.map(lambda x, i=i: x[i], partials) for i in range(count)]


@cached
def compile_init(combiner: Combiner, spec: PyTree, mesh: Mesh, num_shards: int) -> Callable:
    """The jitted maker of ``num_shards`` identity accumulators, laid out on ``mesh``."""
    return jax.jit(
        lambda: stacked(combiner, spec, num_shards),
        out_shardings=named(mesh, accumulator_specs(combiner, mesh, DATA_AXIS)),
    )


# Combiners whose add (a re-whitening fold) is slow to compile and cheap to mask: their steps
# compile one scan, not a second, constant-mask copy for steps of real rows only.
ONE_SCAN_PER_STEP = (LinearRegression, PCA)


def pinned(combiner: Combiner, fn: Callable) -> Callable:
    """``fn`` (the combiner's ``add`` or ``merge``) under :func:`~sharded_scan.fixed_order.fixed_order`,
    its refusal naming the user's combiner."""
    return fixed_order(fn, who=type(innermost(combiner)).__name__)


def check_pinned(program: Program) -> None:
    """Where ``fixed_products``: one line before any compute when the job's ``add`` or ``merge`` holds a
    float sum :mod:`~sharded_scan.fixed_order` cannot fix the order of (the programs would refuse it
    only as they are traced, the merge's after the last step)."""
    names = unpinned_parts(program.job, program.spec, program.layout.microbatch, program.options.precision)
    if names:
        raise UsageError(refusal(type(innermost(program.job)).__name__, list(names)))


@cached
def unpinned_parts(job: Combiner, spec: PyTree, rows: int, precision: str) -> tuple[str, ...]:
    """:func:`~sharded_scan.fixed_order.unpinned` of ``job``'s ``add`` of ``rows`` rows and its ``merge``."""
    try:  # the whole state (not the mesh's split of it, which traces only inside shard_map): the same primitives
        bound = job.bind(jax.tree.map(np.asarray, job.operands(spec)))
        acc = jax.eval_shape(lambda: job.init(spec))
        mask = jax.ShapeDtypeStruct((rows,), jnp.bool_)
        with jax.default_matmul_precision(precision):
            names = [*unpinned(jax.make_jaxpr(bound.add)(acc, rows_spec(spec, rows), mask)),
                     *unpinned(jax.make_jaxpr(bound.merge)(acc, acc))]
    except UsageError:
        raise
    except Exception:  # noqa: BLE001 - a state that traces only in its programs: they refuse as they are traced
        return ()
    return tuple(dict.fromkeys(names))


@cached
def compile_step(combiner: Combiner, mesh: Mesh, layout: Layout, precision: str, fixed: bool = False) -> Callable:
    """``step(partials, batch, num_valid, operands) -> partials``, jitted, donating partials.

    ``batch`` holds ``layout.rows_per_step`` rows sharded over ``data``; of them the
    first ``num_valid`` are real. Each logical shard folds its block of rows as
    ``steps_per_call`` micro-batches of ``microbatch`` rows, in order. A shard whose
    block is all real rows takes a branch with a constant all-True mask, which XLA
    folds away (except for :data:`ONE_SCAN_PER_STEP`). ``fixed``: every float
    product of ``add`` sums in contraction order (:func:`~sharded_scan.fixed_order.fixed_order`).
    """
    mb, spc = layout.microbatch, layout.steps_per_call
    per_device, rows_per_shard = layout.shards_per_device, layout.rows_per_shard

    def fold_shard(bound, acc, rows, valid):
        add = pinned(combiner, bound.add) if fixed else bound.add
        micro = jax.tree.map(lambda x: x.reshape((spc, mb) + x.shape[1:]), rows)
        offsets = jnp.arange(spc, dtype=jnp.int32) * mb

        def ragged(acc, item):
            offset, batch = item
            mask = offset + jnp.arange(mb, dtype=jnp.int32) < valid
            return add(acc, batch, mask), None

        def full(acc, item):
            return add(acc, item[1], jnp.ones((mb,), bool)), None

        if isinstance(innermost(combiner), ONE_SCAN_PER_STEP):
            return jax.lax.scan(ragged, acc, (offsets, micro))[0]
        return jax.lax.cond(
            valid == rows_per_shard,
            lambda acc: jax.lax.scan(full, acc, (offsets, micro))[0],
            lambda acc: jax.lax.scan(ragged, acc, (offsets, micro))[0],
            acc,
        )

    def local_step(partials, batch, num_valid, operands):
        bound = combiner.bind(operands)
        first_row = jax.lax.axis_index(DATA_AXIS) * layout.rows_per_device
        valid = jnp.clip(num_valid - first_row - jnp.arange(per_device) * rows_per_shard, 0, rows_per_shard)
        with jax.default_matmul_precision(precision):
            if per_device == 1:
                acc = fold_shard(bound, jax.tree.map(lambda x: x[0], partials), batch, valid[0])
                return jax.tree.map(lambda x: x[None], acc)
            shards = jax.tree.map(lambda x: x.reshape((per_device, rows_per_shard) + x.shape[1:]), batch)
            # One shard after another, each with the same scan as a lone shard would run.
            return jax.lax.map(lambda args: fold_shard(bound, *args), (partials, shards, valid))

    partial_specs = accumulator_specs(combiner, mesh, DATA_AXIS)
    step = jax.shard_map(local_step, mesh=mesh, out_specs=partial_specs,
                         in_specs=(partial_specs, P(DATA_AXIS), P(), operand_specs(combiner, mesh)))
    return jax.jit(step, donate_argnums=0)


@cached
def compile_gather(combiner: Combiner, mesh: Mesh) -> Callable:
    """``gather(partials) -> partials`` whole on every device: one all-gather over ``data``."""
    return jax.jit(lambda partials: partials, out_shardings=named(mesh, accumulator_specs(combiner, mesh, None)))


def pair_merge(combiner: Combiner, precision: str, fixed: bool) -> Callable:
    """``merge(a, b, operands) -> acc`` of two accumulators, traced at ``precision`` (``fixed``:
    float products in contraction order): the body of every merge program but the ``psum``."""

    def merge(a, b, operands):
        with jax.default_matmul_precision(precision):
            bound = combiner.bind(operands)
            return (pinned(combiner, bound.merge) if fixed else bound.merge)(a, b)

    return merge


@cached
def compile_pair_merge(combiner: Combiner, precision: str, fixed: bool = False) -> Callable:
    """``merge(a, b, operands) -> acc`` of two accumulators, jitted for one device (``fixed``:
    float products in contraction order)."""
    return jax.jit(pair_merge(combiner, precision, fixed))


def tree_strides(size: int) -> list[int]:
    """The rounds of the tree over ``size`` members: 1, 2, 4... below ``size``."""
    return [1 << r for r in range((size - 1).bit_length())]


def receives(stride: int, size: int) -> Callable[[jax.Array], jax.Array]:
    """Whether member ``m`` of ``size`` receives in the tree's round of ``stride``
    (``m`` a multiple of ``2 * stride`` with a member ``m + stride``)."""
    return lambda m: (m % (2 * stride) == 0) & (m + stride < size)


def exchanged(states: PyTree, stride: int, size: int) -> PyTree:
    """Inside ``shard_map``: in the round of ``stride`` member ``m`` gets member ``m + stride``'s
    state (:func:`receives`), every other member its own."""
    mine = receives(stride, size)(jax.lax.axis_index(DATA_AXIS))
    got = jax.lax.ppermute(states, DATA_AXIS, [(m + stride, m) for m in range(0, size - stride, 2 * stride)])
    return jax.tree.map(lambda g, x: jnp.where(mine, g, x), got, states)


def broadcast_first(states: PyTree, size: int) -> PyTree:
    """Inside ``shard_map``: member 0's state on every member (the tree's rounds backwards, copies only)."""
    m = jax.lax.axis_index(DATA_AXIS)
    for stride in reversed(tree_strides(size)):
        got = jax.lax.ppermute(states, DATA_AXIS, [(s, s + stride) for s in range(0, size - stride, 2 * stride)])
        mine = m % (2 * stride) == stride  # member m - stride sent it
        states = jax.tree.map(lambda g, x, mine=mine: jnp.where(mine, g, x), got, states)
    return jax.tree.map(lambda x: x[0], states)


@cached
def compile_exchange(combiner: Combiner, mesh: Mesh, stride: int) -> Callable:
    """``exchange(states) -> partners``: :func:`exchanged` on ``mesh``'s ``data`` axis, one state a member."""
    specs, size = accumulator_specs(combiner, mesh, DATA_AXIS), mesh.shape[DATA_AXIS]
    return jax.jit(jax.shard_map(lambda s: exchanged(s, stride, size), mesh=mesh, in_specs=specs, out_specs=specs))


@cached
def compile_broadcast(combiner: Combiner, mesh: Mesh) -> Callable:
    """``broadcast(states) -> acc``: :func:`broadcast_first` on ``mesh``, laid out as a merge's result."""
    specs, size = accumulator_specs(combiner, mesh, DATA_AXIS), mesh.shape[DATA_AXIS]
    return jax.jit(jax.shard_map(lambda s: broadcast_first(s, size), mesh=mesh, in_specs=specs,
                                 out_specs=accumulator_specs(combiner, mesh), check_vma=False))  # all alike now


@cached
def compile_tree_merge(combiner: Combiner, mesh: Mesh, precision: str, fixed: bool = False) -> Callable:
    """``merge(partials, operands) -> acc`` by the device tree, one program: each device merges
    its own shards level by level in :func:`tree_fold`'s tree (neighbours, vectorized, an odd one
    out carried up), then the tree's rounds over the devices (``ppermute``), then the broadcast;
    a device holds its partials and a few states, and the merge is traced once a level (log2 of
    the shards), never once a shard. For a sum under ``logical_shards`` (additions round alike
    batched or not and in any program) and a state split over ``model`` (each device its own
    block): :func:`tree_fold`'s tree over the shards when each device holds a power of two of
    them, or there is one device.
    """
    specs, size = accumulator_specs(combiner, mesh, DATA_AXIS), mesh.shape[DATA_AXIS]
    merge = jax.vmap(pair_merge(combiner, precision, fixed), in_axes=(0, 0, None))

    def local(states, operands):
        while (count := jax.tree.leaves(states)[0].shape[0]) > 1:
            evens, odds = (jax.tree.map(lambda x, i=i: x[i : count - 1 + i : 2], states) for i in (0, 1))
            pairs = merge(evens, odds, operands)
            states = jax.tree.map(lambda p, x: jnp.concatenate([p, x[count - count % 2 :]]), pairs, states)
        for stride in tree_strides(size):
            merged = merge(states, exchanged(states, stride, size), operands)
            mine = receives(stride, size)(jax.lax.axis_index(DATA_AXIS))
            states = jax.tree.map(lambda m, x, mine=mine: jnp.where(mine, m, x), merged, states)
        return broadcast_first(states, size)

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs, operand_specs(combiner, mesh)),
                                 out_specs=accumulator_specs(combiner, mesh), check_vma=False))


@cached
def compile_merge(combiner: Combiner, mesh: Mesh, ordered: bool, precision: str, fixed: bool = False) -> Callable:
    """``merge(partials, operands) -> acc``: one collective over ``data``.

    Additive combiners are merged by one ``psum`` unless ``ordered``; otherwise the
    partials are all-gathered once and folded with ``combiner.merge`` in a fixed tree,
    which makes the result independent of the device count. The result is on every
    device, or split over the axes ``combiner.partition`` names (a wide accumulator is
    summed, or gathered and folded block by block, over ``data`` only, never gathered
    whole on one device). ``fixed``: float products of the merge in contraction order.
    """
    partial_specs = accumulator_specs(combiner, mesh, DATA_AXIS)
    merged_specs = accumulator_specs(combiner, mesh)
    if combiner.additive and not ordered:

        def local_psum(partials, operands):
            del operands
            return jax.tree.map(lambda x: x[0], jax.lax.psum(partials, DATA_AXIS))

        return jax.jit(
            jax.shard_map(local_psum, mesh=mesh, in_specs=(partial_specs, operand_specs(combiner, mesh)),
                          out_specs=merged_specs)
        )

    if combiner.partition(mesh) is not None:  # split over model, not a sum: each device folds its own block

        def fold_own_block(partials, operands):
            everywhere = jax.lax.all_gather(partials, DATA_AXIS, tiled=True)
            with jax.default_matmul_precision(precision):
                bound = combiner.bind(operands)
                return tree_fold(pinned(combiner, bound.merge) if fixed else bound.merge, shards_of(everywhere))

        return jax.jit(jax.shard_map(fold_own_block, mesh=mesh, in_specs=(partial_specs, operand_specs(combiner, mesh)),
                                     out_specs=merged_specs, check_vma=False))

    def gather_and_fold(partials, operands):
        everywhere = jax.lax.with_sharding_constraint(partials, named(mesh, accumulator_specs(combiner, mesh, None)))
        with jax.default_matmul_precision(precision):
            bound = combiner.bind(operands)
            return tree_fold(pinned(combiner, bound.merge) if fixed else bound.merge, shards_of(everywhere))

    return jax.jit(gather_and_fold, out_shardings=named(mesh, merged_specs))


#: The :meth:`Combiner.merge_collectives` kinds exact in any order (a ``"sum_exact"`` of integers).
EXACT_COLLECTIVES = ("sum_exact", "min", "max")
#: Normalised :class:`~.wide.Wide` partials summed without carrying at most (their lower limbs fit int32).
WIDE_SUMMANDS = 1 << 15


def collective_parts(combiner: Combiner, like: PyTree) -> list[tuple[str, PyTree]] | None:
    """``combiner.merge_collectives()`` as ``(kind, part of like)`` pairs, or None when it has none."""
    kinds = combiner.merge_collectives()
    if kinds is None:
        return None
    pairs = []
    jax.tree.map(lambda kind, part: pairs.append((kind, part)), kinds, like, is_leaf=lambda x: isinstance(x, str))
    return pairs


@cached
def compile_collective_merge(combiner: Combiner, mesh: Mesh) -> Callable:
    """``merge(partials, operands) -> acc`` by :meth:`Combiner.merge_collectives`: each leaf reduced
    over the device's own shards, then one ``psum`` / ``pmin`` / ``pmax`` over ``data`` (a
    :class:`~.wide.Wide` sum normalised after); O(state) a device, no all-gather. The result is
    laid out as :func:`compile_merge`'s (split over the axes ``combiner.partition`` names)."""
    partial_specs, merged_specs = accumulator_specs(combiner, mesh, DATA_AXIS), accumulator_specs(combiner, mesh)
    ops = {"min": (jnp.min, jax.lax.pmin), "max": (jnp.max, jax.lax.pmax)}

    def reduce(kind, part):
        local, across = ops.get(kind, (jnp.sum, jax.lax.psum))

        def one(node):
            merged = jax.tree.map(lambda x: across(local(x, axis=0).astype(x.dtype), DATA_AXIS), node)
            return wide.normalize(merged) if isinstance(node, wide.Wide) else merged

        return jax.tree.map(one, part, is_leaf=lambda x: isinstance(x, wide.Wide))

    def local_collectives(partials, operands):
        del operands
        return jax.tree.map(reduce, combiner.merge_collectives(), partials, is_leaf=lambda x: isinstance(x, str))

    return jax.jit(jax.shard_map(local_collectives, mesh=mesh, in_specs=(partial_specs, operand_specs(combiner, mesh)),
                                 out_specs=merged_specs))


def power_of_two_or_alone(per_member: int, members: int) -> bool:
    """Whether ``members`` holding ``per_member`` consecutive shards each, each folding its own
    first, then pairing up in :func:`tree_strides` rounds, merge in :func:`tree_fold`'s tree."""
    return members == 1 or per_member & (per_member - 1) == 0


@functools.cache
def process_leaders(mesh: Mesh) -> Mesh | None:
    """One device of each process, in the order of the ``data`` rows they hold, as a 1-D mesh
    on ``data``; None when some ``data`` row has devices of two processes."""
    axis = mesh.axis_names.index(DATA_AXIS)
    rows = np.moveaxis(mesh.devices, axis, 0).reshape(mesh.shape[DATA_AXIS], -1)
    if any(len({d.process_index for d in row}) > 1 for row in rows):
        return None
    firsts = [row[0] for i, row in enumerate(rows) if i == 0 or rows[i - 1][0].process_index != row[0].process_index]
    if len({d.process_index for d in firsts}) != len(firsts):
        return None
    return Mesh(np.array(firsts), (DATA_AXIS,))


def leader_index(mesh: Mesh) -> int:
    """This process's place among :func:`process_leaders`."""
    return [d.process_index for d in process_leaders(mesh).devices.flat].index(jax.process_index())


_index = jax.jit(lambda tree, i: jax.tree.map(lambda x: x[i], tree))
_lead = jax.jit(lambda tree: jax.tree.map(lambda x: x[None], tree))


def own_blocks(partials: PyTree) -> list[PyTree]:
    """This process's blocks of the stacked ``partials`` (one per ``data`` row it holds), in shard
    order, each on a device that holds it."""
    leaves, treedef = jax.tree.flatten(partials)
    devices = dict(sorted({s.index[0].start or 0: s.device for s in leaves[0].addressable_shards}.items()))
    on = [{s.device: s.data for s in x.addressable_shards} for x in leaves]
    return [treedef.unflatten([by_device[d] for by_device in on]) for d in devices.values()]


def states_of(block: PyTree, device: jax.Device | None = None) -> Iterator[PyTree]:
    """The shards of a stacked ``block``, one at a time, in order, on its device (or ``device``)."""
    for j in range(jax.tree.leaves(block)[0].shape[0]):
        state = _index(block, j)
        yield state if device is None else jax.device_put(state, device)


def global_state(state: PyTree, leaders: Mesh) -> PyTree:
    """The processes' states (one each, on its leader) as one array on ``leaders``, lead axis ``data``."""
    sharding = NamedSharding(leaders, P(DATA_AXIS))
    return jax.tree.map(lambda x: jax.make_array_from_single_device_arrays(
        (leaders.size, *x.shape[1:]), sharding, [x]), _lead(state))


def local_state(states: PyTree) -> PyTree:
    """This process's state of ``states`` (:func:`global_state`'s layout), on its leader."""
    return _index(jax.tree.map(lambda x: x.addressable_data(0), states), 0)


def process_tree_fold(combiner: Combiner, mesh: Mesh, partials: PyTree, host_operands: PyTree,
                      precision: str, fixed: bool) -> PyTree:
    """The stacked ``partials`` (some shards a device, leading axis over ``mesh``'s ``data``)
    merged in :func:`tree_fold`'s tree, one state on each process's leader device (:meth:`Program.merge`'s
    process tree; also :func:`sharded_scan.relayout.relayout`'s fold of a checkpoint's partials).

    The process's shards fold on its leader device in :func:`tree_fold`'s tree, taken one at a time
    from the devices that hold them (at most log2 of them held), by a pairwise merge compiled once:
    a jitted program compiles again for each device it runs on (measured: a `LinearRegression` d=96
    merge, about 3-6 s of compile a device, against milliseconds of merging saved by folding on every
    device at once). Then the processes run the device tree's rounds, one device each."""
    leaders = process_leaders(mesh)
    me, count = leader_index(mesh), leaders.size
    device = leaders.devices.flat[me]
    merge = compile_pair_merge(combiner, precision, fixed)
    operands = jax.device_put(host_operands, device)
    state = tree_fold(lambda a, b: merge(a, b, operands),
                      (s for block in own_blocks(partials) for s in states_of(block, device)))
    for stride in tree_strides(count):
        partner = local_state(compile_exchange(combiner, leaders, stride)(global_state(state, leaders)))
        if receives(stride, count)(me):
            state = merge(state, partner, operands)
    if count == 1:
        return state
    broadcast = compile_broadcast(combiner, leaders)(global_state(state, leaders))
    return jax.tree.map(lambda x: x.addressable_data(0), broadcast)


def place(host: PyTree, shardings: PyTree) -> PyTree:
    """Global jax.Arrays from host arrays every process holds whole (any process count)."""
    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(np.shape(x), s, lambda idx, x=x: np.asarray(x)[idx]), host, shardings
    )


def per_leaf(mesh: Mesh, specs: PyTree, tree: PyTree) -> PyTree:
    """One ``NamedSharding`` on ``mesh`` per leaf of ``tree``, from ``specs``, a pytree prefix of it
    of PartitionSpecs."""
    prefix = named(mesh, specs)
    return jax.tree.map(
        lambda s, sub: jax.tree.map(lambda _: s, sub), prefix, tree, is_leaf=lambda x: isinstance(x, NamedSharding)
    )


def leaf_shardings(combiner: Combiner, mesh: Mesh, like: PyTree) -> PyTree:
    """One ``NamedSharding`` per leaf of the stacked partials ``like``."""
    return per_leaf(mesh, accumulator_specs(combiner, mesh, DATA_AXIS), like)


def mesh_axes(mesh: Mesh) -> dict[str, int]:
    """The mesh's axes other than ``data``: what :meth:`Combiner.for_mesh` resolves by."""
    return {name: int(size) for name, size in dict(mesh.shape).items() if name != DATA_AXIS}


class MergeRoute(enum.StrEnum):
    """How :meth:`Program.merge` merges the shards' partials (:attr:`Program.merge_route` decides)."""

    PSUM = "psum"                  # one psum over data (a sum without logical_shards)
    COLLECTIVE = "collective"      # one psum/pmin/pmax a leaf (compile_collective_merge)
    DEVICE_TREE = "device_tree"    # own shards by levels, log2(data) ppermute rounds (compile_tree_merge)
    GATHER_FOLD = "gather_fold"    # all-gathered over data, folded in one SPMD program (compile_merge)
    PROCESS_TREE = "process_tree"  # a pair merge for one device, each process its own, then rounds
    LOCAL_FOLD = "local_fold"      # all-gathered, each process folds every shard on one device


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """Everything a run of one job on one mesh needs; see the module docstring.

    Attributes:
      combiner: the combiner with the run's policies, resolved for ``mesh``: what every
        program runs and ``finalize`` finishes.
      job: the same before the mesh resolved it: what the fingerprint names.
      spec: one row of the data (pytree of ``jax.ShapeDtypeStruct``).
      mesh: the devices.
      layout: how rows map to steps, shards, devices and processes.
      options: the run's options.
      fingerprint: what names the job in a checkpoint.
    """

    combiner: Combiner
    job: Combiner
    spec: PyTree
    mesh: Mesh
    layout: Layout
    options: RunOptions
    fingerprint: dict[str, Any]

    @functools.cached_property
    def host_operands(self) -> PyTree:
        return jax.tree.map(np.asarray, self.combiner.operands(self.spec))

    @functools.cached_property
    def operand_shardings(self) -> PyTree:
        """One ``NamedSharding`` per leaf of the operands: replicated, or split as
        ``combiner.operand_partition`` says (:func:`operand_specs`)."""
        return per_leaf(self.mesh, operand_specs(self.combiner, self.mesh), self.host_operands)

    @functools.cached_property
    def operands(self) -> PyTree:
        """The combiner's operands on the devices, as the step and merge programs take them (each
        device its block where they split over ``model``); :attr:`host_operands` are the whole ones,
        which the merges of two states on one device take."""
        return place(self.host_operands, self.operand_shardings)

    @functools.cached_property
    def like(self) -> PyTree:
        """The partials' shapes, dtypes and shardings (``jax.ShapeDtypeStruct`` leaves)."""
        shapes = jax.eval_shape(lambda: stacked(self.combiner, self.spec, self.layout.num_shards))
        shardings = leaf_shardings(self.combiner, self.mesh, shapes)
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)

    @property
    def shape_meta(self) -> dict[str, Any]:
        """How the partials are laid out, for a checkpoint: shard count and non-``data`` axes."""
        return {"shards": self.layout.num_shards, "axes": mesh_axes(self.mesh)}

    def init(self) -> PyTree:
        """Identity partials, one accumulator per logical shard."""
        return compile_init(self.combiner, self.spec, self.mesh, self.layout.num_shards)()

    def step(self, partials: PyTree, batch: PyTree, num_valid: int) -> PyTree:
        """Folds one step's rows (``num_valid`` of them real) into ``partials`` (donated)."""
        compiled = compile_step(
            self.combiner, self.mesh, self.layout.step_shape, self.options.precision, self.fixed_products
        )
        return compiled(partials, batch, np.int32(num_valid), self.operands)

    def merge(self, partials: PyTree) -> PyTree:
        """Every shard's partial merged into one accumulator, on every device (or split over
        the axes ``combiner.partition`` names), by :attr:`merge_route`."""
        route = self.merge_route
        if route is MergeRoute.COLLECTIVE:
            return compile_collective_merge(self.combiner, self.mesh)(partials, self.operands)
        if route is MergeRoute.DEVICE_TREE:
            merge = compile_tree_merge(self.combiner, self.mesh, self.options.precision, self.fixed_products)
            return merge(partials, self.operands)
        if route is MergeRoute.PROCESS_TREE:
            return process_tree_fold(self.combiner, self.mesh, partials, self.host_operands, self.options.precision,
                                     self.fixed_products)
        if route is MergeRoute.LOCAL_FOLD:
            gathered = compile_gather(self.combiner, self.mesh)(partials)
            local = jax.tree.map(lambda x: x.addressable_data(0), gathered)
            merge = compile_pair_merge(self.combiner, self.options.precision, self.fixed_products)
            operands = jax.device_put(self.host_operands, jax.tree.leaves(local)[0].device)
            return tree_fold(lambda a, b: merge(a, b, operands), shards_of(local))
        ordered = route is MergeRoute.GATHER_FOLD
        merge = compile_merge(self.combiner, self.mesh, ordered, self.options.precision, self.fixed_products)
        return merge(partials, self.operands)

    @functools.cached_property
    def merge_route(self) -> MergeRoute:
        """How :meth:`merge` merges the shards' partials (:class:`MergeRoute`), decided once:

        - a sum without ``logical_shards``: one ``psum`` (:attr:`MergeRoute.PSUM`);
        - a merge that names its leafwise order-free reductions (:meth:`Combiner.merge_collectives`):
          one collective a leaf, O(state) a device (:attr:`MergeRoute.COLLECTIVE`); under
          ``logical_shards`` only when each is exact in any order (integers, minima, maxima), so
          bitwise the fixed tree's, and a :class:`~.wide.Wide` sum of at most :data:`WIDE_SUMMANDS` shards
          (its limbs would overflow unnormalised);
        - a sum under ``logical_shards`` (additions round alike batched or not, in any program) and a
          state split over ``model`` (each device merges its own block): the device tree
          (:func:`compile_tree_merge`, :attr:`MergeRoute.DEVICE_TREE`) when each device holds a power
          of two of the shards or there is one device, else the partials gathered over ``data`` and
          folded by one SPMD program (:attr:`MergeRoute.GATHER_FOLD`);
        - any other merge, of a state whole on each device: each pair merged by one program compiled
          once for one device (XLA optimizes an SPMD program for 8 devices differently from one for 1:
          other fusions, other roundings, so a merge inside one is not bitwise the same on every split;
          and a fold traced ``shards - 1`` times in one program compiled longer with every device).
          The process tree (:func:`process_tree_fold`, :attr:`MergeRoute.PROCESS_TREE`) where every
          ``data`` row's devices are in one process and, under ``logical_shards``, each process holds
          a power of two of the shards or there is one process (then it is :func:`tree_fold`'s tree
          over the shards); else every process folds the all-gathered partials on one of its devices
          (:attr:`MergeRoute.LOCAL_FOLD`).
        """
        combiner, ordered = self.combiner, self.options.logical_shards is not None
        if combiner.additive and not ordered:
            return MergeRoute.PSUM
        if not combiner.additive and self._collectives_apply():
            return MergeRoute.COLLECTIVE
        if combiner.additive or combiner.partition(self.mesh) is not None:
            tree = power_of_two_or_alone(self.layout.shards_per_device, self.layout.data_size)
            return MergeRoute.DEVICE_TREE if tree else MergeRoute.GATHER_FOLD
        leaders = process_leaders(self.mesh)
        if leaders is not None and (
                not ordered or power_of_two_or_alone(self.layout.num_shards // leaders.size, leaders.size)):
            return MergeRoute.PROCESS_TREE
        return MergeRoute.LOCAL_FOLD

    def _collectives_apply(self) -> bool:
        """Whether the combiner's :meth:`Combiner.merge_collectives` can merge this program's partials
        (:attr:`merge_route`'s second case); a kind it does not know is a usage error."""
        parts = collective_parts(self.combiner, self.like)
        if parts is None:
            return False
        exact_only = self.options.logical_shards is not None
        for kind, part in parts:
            if kind not in (*EXACT_COLLECTIVES, "sum"):
                raise UsageError(f"{type(self.combiner).__name__}.merge_collectives names {kind!r}; each part is "
                                 "one of 'sum_exact', 'sum', 'min' or 'max'.")
            nodes = jax.tree.leaves(part, is_leaf=lambda x: isinstance(x, wide.Wide))
            if kind == "sum_exact" and self.layout.num_shards > WIDE_SUMMANDS and any(
                    isinstance(x, wide.Wide) for x in nodes):
                return False
            exact = kind != "sum" and all(kind != "sum_exact" or jnp.issubdtype(x.dtype, jnp.integer)
                                          for x in jax.tree.leaves(part))
            if exact_only and not exact:
                return False
        return True

    @property
    def fixed_products(self) -> bool:
        """Whether float products sum in contraction order (:mod:`sharded_scan.fixed_order`).

        Where ``logical_shards`` promises bitwise results on CPU: XLA:CPU's matmul library
        picks its summation order by the process's thread pool, the CPU's caches and the
        output's width. TPUs and GPUs (deterministic mode) run one order per program.
        """
        return self.options.logical_shards is not None and self.mesh.devices.flat[0].platform == "cpu"

    def lower_step(self) -> jax.stages.Lowered:
        """The step lowered for this program's shapes (``.compile().as_text()`` shows its HLO)."""
        rows, sharding = self.layout.rows_per_step, data_sharding(self.mesh)
        batch = jax.tree.map(lambda s: jax.ShapeDtypeStruct((rows, *s.shape), s.dtype, sharding=sharding), self.spec)
        compiled = compile_step(
            self.combiner, self.mesh, self.layout.step_shape, self.options.precision, self.fixed_products
        )
        return compiled.lower(self.like, batch, np.int32(0), self.operands)

    def lower_merge(self) -> jax.stages.Lowered:
        """The merge lowered for this program's partials (by :attr:`merge_route`: the pairwise merge of
        the process tree or a local fold, whose all-gather is :meth:`lower_gather`; else the one program)."""
        route = self.merge_route
        if route is MergeRoute.COLLECTIVE:
            return compile_collective_merge(self.combiner, self.mesh).lower(self.like, self.operands)
        if route is MergeRoute.DEVICE_TREE:
            merge = compile_tree_merge(self.combiner, self.mesh, self.options.precision, self.fixed_products)
            return merge.lower(self.like, self.operands)
        if route in (MergeRoute.PROCESS_TREE, MergeRoute.LOCAL_FOLD):
            one = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), self.like)
            merge = compile_pair_merge(self.combiner, self.options.precision, self.fixed_products)
            return merge.lower(one, one, self.host_operands)
        merge = compile_merge(self.combiner, self.mesh, route is MergeRoute.GATHER_FOLD, self.options.precision,
                              self.fixed_products)
        return merge.lower(self.like, self.operands)

    def lower_gather(self) -> jax.stages.Lowered:
        """The all-gather of the partials that a merge by :attr:`MergeRoute.LOCAL_FOLD` starts with."""
        return compile_gather(self.combiner, self.mesh).lower(self.like)

    def finalize(self, merged: PyTree) -> Any:
        """The result from the merged accumulator (host numpy).

        Host BLAS/LAPACK runs on one thread here: the matrices are small, and OpenBLAS's
        threads next to XLA's idle CPU clients made a 258 x 258 SVD take 0.8 s instead of 0.01 s.
        """
        with threadpoolctl.threadpool_limits(1, user_api="blas"):
            return self.combiner.finalize(merged)


DETERMINISTIC_GPU_FLAG = "--xla_gpu_deterministic_ops=true"


@functools.cache
def warn_if_not_reproducible(platform: str, xla_flags: str) -> None:
    """Logs once when ``logical_shards`` cannot promise bitwise results on ``platform``.

    XLA's GPU reductions and scatters may use atomics, whose order varies from run to
    run, unless XLA runs in its deterministic mode. CPU and TPU need nothing.
    """
    if platform in ("gpu", "cuda", "rocm") and DETERMINISTIC_GPU_FLAG not in xla_flags:
        _log.warning(
            "logical_shards makes results bitwise reproducible on GPUs only with XLA_FLAGS=%s set before JAX "
            "starts (XLA's GPU reductions may otherwise use atomics); without it they agree to float rounding.",
            DETERMINISTIC_GPU_FLAG,
        )


def build_program(combiner: Combiner, source: Source, options: RunOptions) -> Program:
    """Checks and resolves the job ``combiner`` over ``source`` with ``options``; no compute yet.

    64-bit data is resolved under :func:`~sharded_scan.dtypes.x64_scope` (its accumulators,
    fingerprint and memory estimate in 64 bits), as :func:`~sharded_scan.engine.run_program` runs it.

    Raises:
      UsageError: a bad combiner, data, mesh or option.
    """
    compile_cache.use(options.compilation_cache)  # process-wide, before anything compiles
    with x64_scope(source.spec):
        return _build_program(combiner, source, options)


def _build_program(combiner: Combiner, source: Source, options: RunOptions) -> Program:
    if not isinstance(combiner, Combiner):
        raise UsageError(f"combiner must be a sharded_scan Combiner, got {type(combiner).__name__}.")
    job = apply_policies(combiner, nan_policy=options.nan_policy, compensated=options.compensated)
    if source.num_rows == 0:
        raise UsageError("the data has zero rows; there is nothing to reduce.")
    empty = [f"{np.dtype(s.dtype).name}{list(s.shape)}" for s in jax.tree.leaves(source.spec) if 0 in s.shape]
    if empty:
        raise UsageError(f"the data's rows hold no values (rows of {', '.join(empty)}); there is nothing to reduce "
                         "per row: check the data's columns.")
    check_string_ids(innermost(job), source)
    job = on_string_ids(job, source)
    job.check_spec(source.spec)
    if isinstance(source, ArraySource):  # in memory: bad values (keys, weights) are one line before compute
        job.check_rows(source.read(0, source.num_rows))
    check_placeable(source.spec)
    mesh = make_mesh(options.mesh)
    chunking = resolve_chunking(source.spec, options.microbatch, options.steps_per_call, source.num_rows,
                                options.logical_shards or mesh.shape[DATA_AXIS])
    layout = make_layout(source.num_rows, mesh, *chunking, options.logical_shards)
    if options.logical_shards is not None:
        warn_if_not_reproducible(mesh.devices.flat[0].platform, os.environ.get("XLA_FLAGS", ""))
    program = Program(
        combiner=job.for_mesh(mesh),
        job=job,
        spec=source.spec,
        mesh=mesh,
        layout=layout,
        options=options,
        fingerprint=job_fingerprint(job, source, layout.microbatch),  # the micro-batch the programs run
    )
    if program.fixed_products:
        check_pinned(program)
    check_fits(program)
    return program


def check_string_ids(combiner: Combiner, source: Source) -> None:
    """One line when string columns, read as hash ids, would reach a combiner that reduces numbers."""
    strings = source.string_columns
    if strings and not combiner.takes_string_ids:
        raise UsageError(
            f"the string column(s) {', '.join(map(repr, strings))} are read as stable int64 ids, not as numbers: only "
            f"combiners that count values take them (TopK, DistinctCount), and {type(combiner).__name__} reduces "
            "numbers; leave them out of columns=, or encode them as numbers first."
        )


def on_string_ids(job: Combiner, source: Source) -> Combiner:
    """``job``, its innermost combiner's ``for_string_ids()`` where the source reads string columns as ids
    (``DistinctCount(datasketches=True)`` then hashes each id as DataSketches hashes its string)."""
    if not source.string_columns or not hasattr(innermost(job), "for_string_ids"):
        return job
    if isinstance(job, Wrapper):
        return job.rewrap(on_string_ids(job.inner, source))
    return job.for_string_ids()


def program_for_spec(combiner: Combiner, spec: PyTree, num_rows: int, options: RunOptions | None = None) -> Program:
    """The program for ``num_rows`` rows of ``spec``, without data (for benchmarks and HLO checks)."""
    zeros = jax.tree.map(lambda s: np.broadcast_to(np.zeros((), s.dtype), (num_rows, *s.shape)), spec)
    return build_program(combiner, ArraySource(zeros), options or RunOptions())


def to_host(tree: PyTree) -> PyTree:
    """Copies a device pytree to host numpy (works on every process).

    A replicated leaf is read from a local copy; a leaf split over devices is gathered
    (across processes too, when some shards live elsewhere).
    """

    def fetch(x):
        if not isinstance(x, jax.Array):
            return np.asarray(x)
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        if x.is_fully_addressable:
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(fetch, tree)
