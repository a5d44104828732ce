"""The merge: every shard's partial merged into one accumulator, by one of six routes chosen once.

:func:`choose_merge` picks the route of a program's merge (:class:`MergeRoute`) and returns its
object, a :class:`Merge`, which runs the merge, lowers it and states the bytes a device holds for
it; the program runs it, admission reads its bytes. The routes: one ``psum`` (:class:`Psum`), one
collective a leaf (:class:`Collective`), or :func:`tree_fold`'s fixed tree: each device's shards by
levels, then log2 rounds of ``ppermute`` (:class:`DeviceTree`), each process's shards on its first
device, then the processes' rounds (:class:`ProcessTree`, also the fold of a checkpoint's partials in
:func:`sharded_scan.relayout.relayout`), or every partial gathered and folded (:class:`GatherFold`,
:class:`LocalFold`).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sharded_scan import codegen
from sharded_scan.combiners import wide
from sharded_scan.combiners.base import MANY_SHARDS, Combiner, merging_many_shards
from sharded_scan.combiners.wrappers.policies import innermost
from sharded_scan.compile_cache import cached
from sharded_scan.errors import UsageError
from sharded_scan.fixed_order import fixed_order
from sharded_scan.layout import Layout
from sharded_scan.mesh import DATA_AXIS
from sharded_scan.sharding import accumulator_specs, named, operand_specs, shards_of

PyTree = Any


def pinned(combiner: Combiner, fn: Callable) -> Callable:
    """``fn`` (the combiner's ``add`` or ``merge``) under :func:`~sharded_scan.fixed_order.fixed_order`,
    its refusal naming the user's combiner."""
    return fixed_order(fn, who=type(innermost(combiner)).__name__)


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


@cached
def compile_gather(combiner: Combiner, mesh: Mesh, compiler_options: codegen.Options = ()) -> Callable:
    """``gather(partials) -> partials`` whole on every device: one all-gather over ``data``. Every merge program's
    ``compiler_options``: :func:`~sharded_scan.codegen.merge_options`."""
    return jax.jit(lambda partials: partials, out_shardings=named(mesh, accumulator_specs(combiner, mesh, None)),
                   compiler_options=codegen.jit_options(compiler_options))


def pair_merge(combiner: Combiner, precision: str, fixed: bool, many: bool = False) -> Callable:
    """``merge(a, b, operands) -> acc`` of two accumulators, traced at ``precision`` (``fixed``:
    float products with fixed roundings; ``many``: it folds a job of many shards,
    :func:`~.combiners.base.merges_many_shards`): the body of every merge program but the ``psum``."""

    def merge(a, b, operands):
        with jax.default_matmul_precision(precision), merging_many_shards(many):
            bound = combiner.bind(operands)
            return (pinned(combiner, bound.merge) if fixed else bound.merge)(a, b)

    return merge


def compile_pair_merge(combiner: Combiner, precision: str, fixed: bool = False,
                       compiler_options: codegen.Options = (), shards: int = 0) -> Callable:
    """``merge(a, b, operands) -> acc`` of two accumulators, jitted for one device (``fixed``:
    float products with fixed roundings; ``shards``: how many shards it folds, 0 where not known: one program
    below :data:`~.combiners.base.MANY_SHARDS`, one from it)."""
    return _compile_pair_merge(combiner, precision, fixed, compiler_options, shards >= MANY_SHARDS)


@cached
def _compile_pair_merge(combiner: Combiner, precision: str, fixed: bool, compiler_options: codegen.Options,
                        many: bool) -> Callable:
    return jax.jit(pair_merge(combiner, precision, fixed, many), compiler_options=codegen.jit_options(compiler_options))


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
def compile_exchange(combiner: Combiner, mesh: Mesh, stride: int, compiler_options: codegen.Options = ()) -> Callable:
    """``exchange(states) -> partners``: :func:`exchanged` on ``mesh``'s ``data`` axis, one state a member."""
    specs, size = accumulator_specs(combiner, mesh, DATA_AXIS), mesh.shape[DATA_AXIS]
    return jax.jit(jax.shard_map(lambda s: exchanged(s, stride, size), mesh=mesh, in_specs=specs, out_specs=specs),
                   compiler_options=codegen.jit_options(compiler_options))


@cached
def compile_broadcast(combiner: Combiner, mesh: Mesh, compiler_options: codegen.Options = ()) -> Callable:
    """``broadcast(states) -> acc``: :func:`broadcast_first` on ``mesh``, laid out as a merge's result."""
    specs, size = accumulator_specs(combiner, mesh, DATA_AXIS), mesh.shape[DATA_AXIS]
    return jax.jit(jax.shard_map(lambda s: broadcast_first(s, size), mesh=mesh, in_specs=specs,
                                 out_specs=accumulator_specs(combiner, mesh), check_vma=False),  # all alike now
                   compiler_options=codegen.jit_options(compiler_options))


@cached
def compile_tree_merge(combiner: Combiner, mesh: Mesh, precision: str, fixed: bool = False,
                       compiler_options: codegen.Options = ()) -> Callable:
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
                                 out_specs=accumulator_specs(combiner, mesh), check_vma=False),
                   compiler_options=codegen.jit_options(compiler_options))


@cached
def compile_psum_merge(combiner: Combiner, mesh: Mesh, compiler_options: codegen.Options = ()) -> Callable:
    """``merge(partials, operands) -> acc`` of an additive combiner: one ``psum`` over ``data``.

    The result is on every device, or split over the axes ``combiner.partition`` names (a wide
    accumulator is summed over ``data`` only, never gathered whole on one device).
    """
    partial_specs = accumulator_specs(combiner, mesh, DATA_AXIS)
    merged_specs = accumulator_specs(combiner, mesh)

    def local_psum(partials, operands):
        del operands
        return jax.tree.map(lambda x: x[0], jax.lax.psum(partials, DATA_AXIS))

    return jax.jit(
        jax.shard_map(local_psum, mesh=mesh, in_specs=(partial_specs, operand_specs(combiner, mesh)),
                      out_specs=merged_specs),
        compiler_options=codegen.jit_options(compiler_options),
    )


@cached
def compile_gather_merge(combiner: Combiner, mesh: Mesh, precision: str, fixed: bool = False,
                         compiler_options: codegen.Options = ()) -> Callable:
    """``merge(partials, operands) -> acc``: one collective over ``data``, then one program's fold.

    The partials are all-gathered once and folded with ``combiner.merge`` in a fixed tree
    (:func:`tree_fold`'s), which makes the result independent of the device count. The result is on
    every device, or split over the axes ``combiner.partition`` names (a wide accumulator is gathered
    and folded block by block, over ``data`` only, never gathered whole on one device). ``fixed``:
    float products of the merge with fixed roundings.
    """
    partial_specs = accumulator_specs(combiner, mesh, DATA_AXIS)
    merged_specs = accumulator_specs(combiner, mesh)
    if combiner.partition(mesh) is not None:  # split over model, not a sum: each device folds its own block

        def fold_own_block(partials, operands):
            everywhere = jax.lax.all_gather(partials, DATA_AXIS, tiled=True)
            with jax.default_matmul_precision(precision):
                bound = combiner.bind(operands)
                return tree_fold(pinned(combiner, bound.merge) if fixed else bound.merge, shards_of(everywhere))

        return jax.jit(jax.shard_map(fold_own_block, mesh=mesh, in_specs=(partial_specs, operand_specs(combiner, mesh)),
                                     out_specs=merged_specs, check_vma=False),
                       compiler_options=codegen.jit_options(compiler_options))

    def gather_and_fold(partials, operands):
        everywhere = jax.lax.with_sharding_constraint(partials, named(mesh, accumulator_specs(combiner, mesh, None)))
        with jax.default_matmul_precision(precision):
            bound = combiner.bind(operands)
            return tree_fold(pinned(combiner, bound.merge) if fixed else bound.merge, shards_of(everywhere))

    return jax.jit(gather_and_fold, out_shardings=named(mesh, merged_specs),
                   compiler_options=codegen.jit_options(compiler_options))


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
def compile_collective_merge(combiner: Combiner, mesh: Mesh, compiler_options: codegen.Options = ()) -> Callable:
    """``merge(partials, operands) -> acc`` by :meth:`Combiner.merge_collectives`: each leaf reduced
    over the device's own shards, then one ``psum`` / ``pmin`` / ``pmax`` over ``data`` (a
    :class:`~.wide.Wide` sum normalised after); O(state) a device, no all-gather. The result is
    laid out as :func:`compile_gather_merge`'s (split over the axes ``combiner.partition`` names)."""
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
                                 out_specs=merged_specs),
                   compiler_options=codegen.jit_options(compiler_options))


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
    """The shards of a stacked ``block``, one at a time, in order, on its device (or ``device``).

    Moved to ``device`` from a CPU device through host numpy (a copy in the same memory): a jitted index
    compiles once for every device it runs on (eight programs a job on eight CPU devices)."""
    leaves = jax.tree.leaves(block)
    on_cpu = device is not None and all(d.platform == "cpu" for x in leaves for d in x.devices())
    host = jax.tree.map(np.asarray, block) if on_cpu else None  # once, not once a shard
    for j in range(leaves[0].shape[0]):
        if on_cpu:
            yield jax.device_put(jax.tree.map(lambda x, j=j: x[j], host), device)
            continue
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
                      precision: str, fixed: bool, compiler_options: codegen.Options = ()) -> PyTree:
    """The stacked ``partials`` (some shards a device, leading axis over ``mesh``'s ``data``)
    merged in :func:`tree_fold`'s tree, one state on each process's leader device (:class:`ProcessTree`'s
    process tree; also :func:`sharded_scan.relayout.relayout`'s fold of a checkpoint's partials).

    The process's shards fold on its leader device in :func:`tree_fold`'s tree, taken one at a time
    from the devices that hold them (at most log2 of them held), by a pairwise merge compiled once:
    a jitted program compiles again for each device it runs on (measured: a `LinearRegression` d=96
    merge, about 3-6 s of compile a device, against milliseconds of merging saved by folding on every
    device at once). Then the processes run the device tree's rounds, one device each."""
    leaders = process_leaders(mesh)
    me, count = leader_index(mesh), leaders.size
    device = leaders.devices.flat[me]
    shards = jax.tree.leaves(partials)[0].shape[0]
    merge = compile_pair_merge(combiner, precision, fixed, compiler_options, shards)
    operands = jax.device_put(host_operands, device)
    state = tree_fold(lambda a, b: merge(a, b, operands),
                      (s for block in own_blocks(partials) for s in states_of(block, device)))
    for stride in tree_strides(count):
        exchange = compile_exchange(combiner, leaders, stride, compiler_options)
        partner = local_state(exchange(global_state(state, leaders)))
        if receives(stride, count)(me):
            state = merge(state, partner, operands)
    if count == 1:
        return state
    broadcast = compile_broadcast(combiner, leaders, compiler_options)(global_state(state, leaders))
    return jax.tree.map(lambda x: x.addressable_data(0), broadcast)


class MergeRoute(enum.StrEnum):
    """The routes of the merge, one :class:`Merge` class each (:func:`choose_merge` decides)."""

    PSUM = "psum"                  # one psum over data (a sum without logical_shards)
    COLLECTIVE = "collective"      # one psum/pmin/pmax a leaf (compile_collective_merge)
    DEVICE_TREE = "device_tree"    # own shards by levels, log2(data) ppermute rounds (compile_tree_merge)
    GATHER_FOLD = "gather_fold"    # all-gathered over data, folded in one SPMD program (compile_gather_merge)
    PROCESS_TREE = "process_tree"  # a pair merge for one device, each process its own, then rounds
    LOCAL_FOLD = "local_fold"      # all-gathered, each process folds every shard on one device


@dataclasses.dataclass(frozen=True, eq=False)
class Merge(abc.ABC):
    """One route of a program's merge: every shard's partial merged into one accumulator, on every
    device (or split over the axes ``combiner.partition`` names). One subclass a :class:`MergeRoute`,
    chosen once by :func:`choose_merge`: it runs the merge, lowers it (``.compile().as_text()`` shows
    its HLO) and states the bytes one device holds for it (:func:`~sharded_scan.admission.memory_estimate`'s
    ``merge`` part).

    Attributes:
      combiner: the combiner as the programs run it.
      mesh: the devices.
      layout: how the shards lie on them.
      precision: the matmul precision the merge traces under.
      fixed: float products with fixed roundings (:mod:`sharded_scan.fixed_order`).
      compiler_options: XLA's code generation of every program of the route
        (:func:`~sharded_scan.codegen.merge_options`).
    """

    route: ClassVar[MergeRoute]
    #: True where pairs are merged on one device by a program compiled for one device: the operands
    #: whole, as the host holds them; else placed on the mesh, as the step takes them.
    whole_operands: ClassVar[bool] = False

    combiner: Combiner
    mesh: Mesh
    layout: Layout
    precision: str
    fixed: bool
    compiler_options: codegen.Options = ()

    @abc.abstractmethod
    def run(self, partials: PyTree, operands: PyTree) -> PyTree:
        """The stacked ``partials`` merged (``operands``: the combiner's, whole or placed: :attr:`whole_operands`)."""

    @abc.abstractmethod
    def lower(self, like: PyTree, operands: PyTree) -> jax.stages.Lowered:
        """The merge lowered for partials shaped ``like`` (for a pairwise route: the merge of two states)."""

    @abc.abstractmethod
    def peak_bytes(self, per_shard: int, merge: int) -> int:
        """Bytes one device holds for the merge: the states it keeps, ``per_shard`` bytes each, and
        what merging two of them makes beside them (``merge``)."""


class OneProgram(Merge):
    """A route whose merge is one program over the mesh, taking the partials where they lie."""

    @abc.abstractmethod
    def program(self) -> Callable:
        """``merge(partials, operands) -> acc``, compiled (memoized)."""

    def run(self, partials: PyTree, operands: PyTree) -> PyTree:
        return self.program()(partials, operands)

    def lower(self, like: PyTree, operands: PyTree) -> jax.stages.Lowered:
        return self.program().lower(like, operands)


class InPlace(OneProgram):
    """A route of collectives over ``data`` that merge the states where they lie: one a device."""

    def peak_bytes(self, per_shard: int, merge: int) -> int:
        return per_shard


class Psum(InPlace):
    """A sum without ``logical_shards``: one ``psum`` (:func:`compile_psum_merge`)."""

    route = MergeRoute.PSUM

    def program(self) -> Callable:
        return compile_psum_merge(self.combiner, self.mesh, self.compiler_options)


class Collective(InPlace):
    """One ``psum`` / ``pmin`` / ``pmax`` a leaf (:func:`compile_collective_merge`)."""

    route = MergeRoute.COLLECTIVE

    def program(self) -> Callable:
        return compile_collective_merge(self.combiner, self.mesh, self.compiler_options)


class DeviceTree(OneProgram):
    """Each device's own shards by levels, then the devices' rounds (:func:`compile_tree_merge`)."""

    route = MergeRoute.DEVICE_TREE

    def program(self) -> Callable:
        return compile_tree_merge(self.combiner, self.mesh, self.precision, self.fixed, self.compiler_options)

    def peak_bytes(self, per_shard: int, merge: int) -> int:
        # A device's own shards by levels (its first merges half of them at once), then a partner's a round.
        own = self.layout.shards_per_device
        return per_shard * (own + 2) + merge * (own // 2 or 1)


class GatherFold(OneProgram):
    """All-gathered over ``data``, folded in one SPMD program (:func:`compile_gather_merge`)."""

    route = MergeRoute.GATHER_FOLD

    def program(self) -> Callable:
        return compile_gather_merge(self.combiner, self.mesh, self.precision, self.fixed, self.compiler_options)

    def peak_bytes(self, per_shard: int, merge: int) -> int:
        return per_shard * self.layout.num_shards + merge  # every shard's partial, merged two at a time


class Pairwise(Merge):
    """A route that merges pairs on one device, by one program compiled for one device (:func:`compile_pair_merge`)."""

    whole_operands = True

    def pair(self) -> Callable:
        """``merge(a, b, operands) -> acc`` of two states, compiled (memoized)."""
        return compile_pair_merge(self.combiner, self.precision, self.fixed, self.compiler_options,
                                  self.layout.num_shards)

    def lower(self, like: PyTree, operands: PyTree) -> jax.stages.Lowered:
        one = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), like)
        return self.pair().lower(one, one, operands)


class ProcessTree(Pairwise):
    """Each process folds its shards on its first device, then the processes' rounds (:func:`process_tree_fold`)."""

    route = MergeRoute.PROCESS_TREE

    def run(self, partials: PyTree, operands: PyTree) -> PyTree:
        return process_tree_fold(self.combiner, self.mesh, partials, operands, self.precision, self.fixed,
                                 self.compiler_options)

    def peak_bytes(self, per_shard: int, merge: int) -> int:
        # On a process's first device: tree_fold's stack of its own shards, one taken in, a partner's.
        own = (self.layout.local_blocks[1] - self.layout.local_blocks[0]) * self.layout.shards_per_device
        return per_shard * (own.bit_length() + 2) + merge


class LocalFold(Pairwise):
    """All-gathered (:func:`compile_gather`); each process folds every shard on one of its devices."""

    route = MergeRoute.LOCAL_FOLD

    def run(self, partials: PyTree, operands: PyTree) -> PyTree:
        gathered = compile_gather(self.combiner, self.mesh, self.compiler_options)(partials)
        local = jax.tree.map(lambda x: x.addressable_data(0), gathered)
        merge = self.pair()
        operands = jax.device_put(operands, jax.tree.leaves(local)[0].device)
        return tree_fold(lambda a, b: merge(a, b, operands), shards_of(local))

    def peak_bytes(self, per_shard: int, merge: int) -> int:
        return per_shard * self.layout.num_shards + merge  # every shard's partial, merged two at a time


def choose_merge(combiner: Combiner, mesh: Mesh, layout: Layout, like: PyTree, ordered: bool, precision: str,
                 fixed: bool, compiler_options: codegen.Options = ()) -> Merge:
    """How a program merges its shards' partials (``like``: their shapes; ``ordered``: under
    ``logical_shards``; ``compiler_options``: XLA's code generation of its programs), decided once:

    - a sum without ``logical_shards``: one ``psum`` (:class:`Psum`);
    - a merge that names its leafwise order-free reductions (:meth:`Combiner.merge_collectives`):
      one collective a leaf, O(state) a device (:class:`Collective`); under ``logical_shards`` only
      when each is exact in any order (integers, minima, maxima), so bitwise the fixed tree's, and a
      :class:`~.wide.Wide` sum of at most :data:`WIDE_SUMMANDS` shards (its limbs would overflow
      unnormalised);
    - a sum under ``logical_shards`` (additions round alike batched or not, in any program) and a
      state split over ``model`` (each device merges its own block): the device tree
      (:class:`DeviceTree`) when each device holds a power of two of the shards or there is one
      device, else the partials gathered over ``data`` and folded by one SPMD program
      (:class:`GatherFold`);
    - any other merge, of a state whole on each device: each pair merged by one program compiled
      once for one device (XLA optimizes an SPMD program for 8 devices differently from one for 1:
      other fusions, other roundings, so a merge inside one is not bitwise the same on every split;
      and a fold traced ``shards - 1`` times in one program compiled longer with every device).
      The process tree (:class:`ProcessTree`) where every ``data`` row's devices are in one process
      and, under ``logical_shards``, each process holds a power of two of the shards or there is one
      process (then it is :func:`tree_fold`'s tree over the shards); else every process folds the
      all-gathered partials on one of its devices (:class:`LocalFold`).
    """
    if combiner.additive and not ordered:
        route = Psum
    elif not combiner.additive and collectives_apply(combiner, like, layout.num_shards, ordered):
        route = Collective
    elif combiner.additive or combiner.partition(mesh) is not None:
        route = DeviceTree if power_of_two_or_alone(layout.shards_per_device, layout.data_size) else GatherFold
    else:
        leaders = process_leaders(mesh)
        tree = leaders is not None and (
            not ordered or power_of_two_or_alone(layout.num_shards // leaders.size, leaders.size))
        route = ProcessTree if tree else LocalFold
    return route(combiner, mesh, layout, precision, fixed, compiler_options)


def collectives_apply(combiner: Combiner, like: PyTree, num_shards: int, exact_only: bool) -> bool:
    """Whether the combiner's :meth:`Combiner.merge_collectives` can merge ``num_shards`` partials shaped
    ``like`` (:func:`choose_merge`'s second case; ``exact_only``: under ``logical_shards``); a kind it does
    not know is a usage error."""
    parts = collective_parts(combiner, like)
    if parts is None:
        return False
    for kind, part in parts:
        if kind not in (*EXACT_COLLECTIVES, "sum"):
            raise UsageError(f"{type(combiner).__name__}.merge_collectives names {kind!r}; each part is "
                             "one of 'sum_exact', 'sum', 'min' or 'max'.")
        nodes = jax.tree.leaves(part, is_leaf=lambda x: isinstance(x, wide.Wide))
        if kind == "sum_exact" and num_shards > WIDE_SUMMANDS and any(isinstance(x, wide.Wide) for x in nodes):
            return False
        exact = kind != "sum" and all(kind != "sum_exact" or jnp.issubdtype(x.dtype, jnp.integer)
                                      for x in jax.tree.leaves(part))
        if exact_only and not exact:
            return False
    return True
