"""A checkpoint's partials laid out on this run's mesh (:func:`relayout`), and what a compact save
writes (:func:`compact`).

A per-shard checkpoint holds one accumulator per logical shard, as the job was resolved for
the mesh that wrote it (:meth:`Combiner.for_mesh`: e.g. a Gram split by columns over a
``model`` axis); a compact one (:attr:`~sharded_scan.checkpoint.CheckpointOptions.compact`)
one merged state, each leaf flat and split over the devices that wrote it.
:class:`~sharded_scan.checkpoint.Checkpointer` restores a per-shard checkpoint of the same
shape in place and hands any other here, unread
(:class:`~sharded_scan.checkpoint.SavedPartials`): the saved shards are read sharded over this
run's ``data`` axis (each process reads only its devices' share) and folded on each process's
leader device by the run's own process tree (:func:`~sharded_scan.merging.process_tree_fold`), or, where that
tree is not :func:`~sharded_scan.merging.tree_fold`'s over the saved shards, read whole and
folded on one device.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sharded_scan.checkpoint import SavedPartials
from sharded_scan.combiners.base import Combiner
from sharded_scan.combiners.column_split import round_up
from sharded_scan.compile_cache import cached
from sharded_scan.compiled import Program
from sharded_scan.errors import UsageError
from sharded_scan.merging import (
    MergeRoute,
    compile_pair_merge,
    power_of_two_or_alone,
    process_leaders,
    process_tree_fold,
    tree_fold,
)
from sharded_scan.mesh import DATA_AXIS, MODEL_AXIS
from sharded_scan.sharding import accumulator_specs, leaf_shardings, mesh_axes, shards_of, stacked

PyTree = Any


def compact(program: Program, partials: PyTree) -> tuple[list[jax.Array], dict[str, Any]]:
    """What a compact save writes: ``partials`` merged by :meth:`Program.merge` (the run's own tree),
    each leaf flattened, padded with zeros to a multiple of the mesh's N devices and split over
    all of them (each device holds, and orbax writes, 1/N of one state), and the checkpoint's
    ``shape`` (``{"shards": 1, "axes": ..., "compact": N}``). Where that merge is a ``psum``
    (:func:`scatters`) the partials are reduce-scattered straight into that layout
    (:func:`compile_scatter_sum`; a leaf split over ``model``: its blocks, then their pieces moved):
    half the bytes of the ``psum`` over ``data`` moved (a whole leaf on a ``model`` mesh: 1/M of that; a
    split leaf: at most its piece more), 1/N of the state held."""
    mesh = program.mesh
    if scatters(program):
        leaves = compile_scatter_sum(program.combiner, mesh)(partials)
    else:
        leaves = merged_and_split(program, partials)
    return leaves, compact_shape(mesh)


def compact_shape(mesh: Mesh) -> dict[str, Any]:
    """A compact checkpoint's ``shape``: one state, its leaves split over ``mesh``'s N devices."""
    return {"shards": 1, "axes": mesh_axes(mesh), "compact": mesh.size}


def merged_and_split(program: Program, partials: PyTree) -> list[jax.Array]:
    """:func:`compact`'s leaves the long way: ``partials`` merged by :meth:`Program.merge` (every
    device holding the whole state, or its block of a split one), then each leaf flattened, padded
    and split over every device."""
    mesh = program.mesh
    spread = NamedSharding(mesh, P(mesh.axis_names))
    return [_flat(leaf, round_up(leaf.size, mesh.size), spread) for leaf in jax.tree.leaves(program.merge(partials))]


def scatters(program: Program) -> bool:
    """Whether a compact save reduce-scatters the partials: where :meth:`Program.merge` is one
    ``psum`` (an additive combiner without ``logical_shards``, whose tree fixes the order) and each
    leaf is whole on a device or split along one axis over ``model`` only (:func:`split_axis`; a
    block's flat pieces are then moved to the devices whose pieces they are)."""
    combiner, mesh = program.combiner, program.mesh
    if program.merge_route is not MergeRoute.PSUM:
        return False
    if combiner.partition(mesh) is None:
        return True
    if set(mesh.axis_names) != {DATA_AXIS, MODEL_AXIS}:
        return False
    axes = [(split_axis(leaf.sharding.spec), leaf.size // leaf.shape[0]) for leaf in jax.tree.leaves(program.like)]
    return all(axis is None or (axis is not False and size < SPLIT_LEAF_LIMIT) for axis, size in axes)


#: A leaf split over ``model`` reduce-scatters when it has fewer elements than this (the moves' int32 indices).
SPLIT_LEAF_LIMIT = 1 << 30


def split_axis(spec: P) -> int | None | bool:
    """The axis of an accumulator leaf (stacked: its first axis the shards, over ``data``) that
    ``spec`` splits over ``model``, counted without the shard axis; None where the leaf is whole on
    a device (split over ``data`` only); False where it is split otherwise (another axis, or two)."""
    entries = [(e,) if isinstance(e, str) else tuple(e or ()) for e in tuple(spec)[1:]]
    split = [i for i, e in enumerate(entries) if e]
    if not split:
        return None
    return split[0] if len(split) == 1 and entries[split[0]] == (MODEL_AXIS,) else False


@cached
def compile_scatter_sum(combiner: Combiner, mesh: Mesh) -> Callable[[PyTree], list[jax.Array]]:
    """``scatter(partials) -> leaves``: a sum's partials (one shard a device) summed over ``data`` by
    one ``psum_scatter`` a leaf into :func:`compact`'s layout: each leaf flat, padded to a multiple of
    the N devices, device ``i`` (row-major over the mesh's axes) holding the ``i``-th of its N pieces.
    A leaf whole on each device has the pieces of the devices at its place on the axes besides ``data``
    reduce-scattered over ``data`` straight into them (:func:`_own_piece`: 1/M of the leaf); a
    leaf split over ``model`` (each device its block) has its block reduce-scattered over ``data``,
    then each device's share moved to the devices whose pieces it falls in (:func:`_block_pieces`)."""
    names = mesh.axis_names

    def scatter(partials):
        leaves = jax.tree.leaves(partials)
        specs = [s.spec for s in jax.tree.leaves(leaf_shardings(combiner, mesh, partials))]
        return [_own_piece(x, mesh) if split_axis(spec) is None else _block_pieces(x[0], split_axis(spec), mesh)
                for x, spec in zip(leaves, specs, strict=True)]

    specs = accumulator_specs(combiner, mesh, DATA_AXIS)
    return jax.jit(jax.shard_map(scatter, mesh=mesh, in_specs=(specs,), out_specs=P(names)))


def _own_piece(x: jax.Array, mesh: Mesh) -> jax.Array:
    """This device's piece of a leaf whole on each device (``x``: this device's shard, ``[1, *leaf]``).

    The flat padded leaf's ``N`` pieces, row-major over the mesh's axes, are a ``[*sizes, piece]``
    array; the devices beside this one on ``data`` (its place on every other axis) own the ``D``
    pieces at that place on the other axes: that slice alone (``1/(N/D)`` of the leaf) is
    reduce-scattered over ``data``, so each device receives only its own piece's sum."""
    names, sizes = mesh.axis_names, tuple(mesh.devices.shape)
    flat = jnp.pad(x[0].reshape(-1), (0, round_up(x[0].size, mesh.size) - x[0].size))
    data_at, others = names.index(DATA_AXIS), tuple(n for n in names if n != DATA_AXIS)
    pieces = jnp.moveaxis(flat.reshape(*sizes, -1), data_at, 0).reshape(sizes[data_at], -1, flat.size // mesh.size)
    share = pieces[:, jax.lax.axis_index(others) if others else 0]  # [D, piece]: this place's pieces, by data
    return jax.lax.psum_scatter(share, DATA_AXIS, scatter_dimension=0)


def _block_pieces(block: jax.Array, axis: int, mesh: Mesh) -> jax.Array:
    """This device's piece of a leaf split along ``axis`` over ``model`` (``block``: this device's block
    of its shard): the block summed over ``data`` by one ``psum_scatter`` (device ``(k, m)``, ``k`` on
    ``data``, gets run ``k`` of the ``D`` equal runs of block ``m``'s flat sum), then each run's
    elements moved to the devices whose pieces of the whole leaf's flat order they are
    (:func:`block_moves`: a ``ppermute`` a round; a run's share of a piece is contiguous in both)."""
    moves = block_moves(tuple(block.shape), axis, tuple(mesh.devices.shape), mesh.axis_names)
    names = mesh.axis_names
    flat = block.reshape(-1)
    run = jax.lax.psum_scatter(jnp.pad(flat, (0, moves.runs * moves.run - flat.size)), DATA_AXIS,
                               scatter_dimension=0, tiled=True)
    me = jax.lax.axis_index(names)
    run = jnp.pad(run, (0, max(width for width, *_ in moves.rounds)))
    sent, where = [], []
    for width, pairs, send_at, first, block_of, count in moves.rounds:
        part = jax.lax.dynamic_slice_in_dim(run, jnp.asarray(send_at)[me], width)
        sent.append(part if pairs is None else jax.lax.ppermute(part, names, pairs))
        b = jnp.asarray(first)[me] + jnp.arange(width, dtype=jnp.int32)  # block flat indices received
        m = jnp.asarray(block_of)[me]
        row = b // moves.width - jnp.asarray(moves.first_row)[me]  # rows after the piece's first
        at = row * moves.row + m * moves.width + b % moves.width - jnp.asarray(moves.offset)[me]
        pad = moves.piece + jnp.arange(width, dtype=jnp.int32)  # past the piece: dropped
        where.append(jnp.where(jnp.arange(width) < jnp.asarray(count)[me], at, pad))
    piece = jnp.zeros((moves.piece,), block.dtype)
    return piece.at[jnp.concatenate(where)].set(jnp.concatenate(sent), mode="drop", unique_indices=True)


class BlockMoves(NamedTuple):
    """Where the runs of a split leaf's block go (:func:`block_moves`), per device (mesh-linear index)."""

    width: int  # elements of a block row (the split axis's block width times the axes after it)
    row: int  # elements of a row of the whole leaf (``model`` blocks of ``width``)
    piece: int  # elements of a device's piece of the whole leaf (flat, padded to the devices)
    run: int  # elements of a run (a block's flat sum, padded, over the ``data`` devices)
    runs: int  # the ``data`` size
    first_row: np.ndarray  # [N]: the whole leaf's row of each device's piece's first element
    offset: np.ndarray  # [N]: that element's place in its row
    rounds: list  # (width, ppermute pairs or None (a device's own), send_at[N], first[N], block_of[N], count[N])


@functools.lru_cache(maxsize=64)
def block_moves(shape: tuple[int, ...], axis: int, grid: tuple[int, ...], names: tuple[str, ...]) -> BlockMoves:
    """The moves of :func:`_block_pieces`: a block of ``shape`` (split ``axis`` over ``model``) on a
    mesh of ``grid`` devices (axes ``names``). The whole leaf, row-major, is rows of ``M`` blocks' rows of
    ``width``: element ``b`` of block ``m``'s flat order sits at ``(b // width) * row + m * width +
    b % width``, increasing in ``b``, so a run's share of a piece is one contiguous slice of each.
    Each device's shares to the others are grouped into rounds, each a permutation (no device sends,
    or receives, twice a round), the largest shares first: one ``ppermute`` a round, as wide as its
    largest share."""
    data_at, model_at = names.index(DATA_AXIS), names.index(MODEL_AXIS)
    n_dev, d_size, m_size = math.prod(grid), grid[data_at], grid[model_at]
    pre, width = math.prod(shape[:axis]), math.prod(shape[axis:])
    row, total = m_size * width, math.prod(shape[:axis]) * m_size * width
    piece, size = round_up(total, n_dev) // n_dev, pre * width
    run = round_up(size, d_size) // d_size
    coords = [np.unravel_index(i, grid) for i in range(n_dev)]

    def before(t: int, m: int) -> int:  # block m's elements before the whole leaf's flat index t
        rows, rest = divmod(min(t, total), row)
        return min(rows * width + min(max(rest - m * width, 0), width), size)

    def where(b: int, m: int) -> int:  # the whole leaf's flat index of block m's element b
        return (b // width) * row + m * width + b % width

    shares = []  # (count, source, target, first block index, block)
    for source, at in enumerate(coords):
        k, m = int(at[data_at]), int(at[model_at])
        lo, hi = k * run, min((k + 1) * run, size)
        if lo >= hi:
            continue
        for target in range(where(lo, m) // piece, where(hi - 1, m) // piece + 1):
            a, b = max(lo, before(target * piece, m)), min(hi, before((target + 1) * piece, m))
            if a < b:
                shares.append((b - a, source, target, a, m))
    own = [s for s in shares if s[1] == s[2]]
    rounds_of: list[list] = [own]
    busy: list[tuple[set, set]] = []
    for share in sorted((s for s in shares if s[1] != s[2]), key=lambda s: (-s[0], s[1], s[2])):
        r = next((i for i, (senders, targets) in enumerate(busy) if share[1] not in senders
                  and share[2] not in targets), None)
        if r is None:
            busy.append((set(), set()))
            rounds_of.append([])
            r = len(busy) - 1
        busy[r][0].add(share[1])
        busy[r][1].add(share[2])
        rounds_of[r + 1].append(share)
    rounds = []
    for i, group in enumerate(rounds_of):
        if not group:
            continue
        send_at, first, block_of, count = (np.zeros(n_dev, np.int32) for _ in range(4))
        for c, source, target, a, m in group:
            send_at[source] = a - int(coords[source][data_at]) * run
            first[target], block_of[target], count[target] = a, m, c
        pairs = None if i == 0 else tuple((s[1], s[2]) for s in group)
        rounds.append((max(s[0] for s in group), pairs, send_at, first, block_of, count))
    starts = [i * piece for i in range(n_dev)]
    return BlockMoves(width, row, piece, run, d_size, np.array([t // row for t in starts], np.int32),
                      np.array([t % row for t in starts], np.int32), rounds)


_pad = jax.jit(lambda x, size: jnp.pad(x.reshape(-1), (0, size - x.size)), static_argnums=1)


def _flat(x: jax.Array, size: int, sharding: NamedSharding) -> jax.Array:
    """``x`` flattened and padded to ``size``, laid out as ``sharding``: from a copy on each process
    (a merge's result on one device, or replicated) each device takes its share; a leaf split
    over the mesh is resharded."""
    if x.is_fully_replicated:
        return from_local(_pad(x.addressable_data(0), size), sharding)
    return jax.device_put(_pad(x, size), sharding)


def from_local(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """A global array laid out as ``sharding`` from ``x``, its whole value on a device of this
    process (every process the same value): each of this process's devices gets its share."""
    index = sharding.addressable_devices_indices_map(x.shape)
    return jax.make_array_from_single_device_arrays(
        x.shape, sharding, [jax.device_put(x[i], d) for d, i in index.items()])


def relayout(program: Program, saved: SavedPartials, meta: dict[str, Any]) -> PyTree:
    """``program``'s partials from a checkpoint written with another shape (``meta``), or compact.

    A compact checkpoint's state is read split over this mesh, converted to this mesh's
    resolution of the job and laid out as ``[state, identity, ...]``. With the same shard
    count each shard's accumulator is read on its device and converted there (bitwise the
    state it saved, for a lossless conversion). Otherwise the saved shards are merged in
    :func:`tree_fold`'s tree by one pairwise merge program of the combiner as it was resolved
    for the mesh that wrote them (a compile that does not grow with the shard count), converted,
    and laid out as ``[merged, identity, ...]``: read over this run's ``data`` axis, each process
    folding its devices' shards on its leader and the processes pairing up (:func:`process_tree_fold`) where that is the
    same tree, else read whole on every process and folded on one device; the result is bitwise
    the same either way.

    Raises:
      UsageError: the stored leaves are not what this job writes on such a mesh.
    """
    axes = {str(k): int(v) for k, v in meta["axes"].items()}
    there = program.job.for_mesh(AbstractMesh((1, *axes.values()), (DATA_AXIS, *axes)))
    count, pieces = int(meta["shards"]), int(meta.get("compact") or 0)
    expect = jax.eval_shape(lambda: stacked(there, program.spec, count))
    want = [jax.ShapeDtypeStruct((round_up(math.prod(s.shape), pieces),), s.dtype) if pieces else s
            for s in jax.tree.leaves(expect)]
    _check_leaves(saved.shapes, want)
    mesh, treedef = program.mesh, jax.tree.structure(expect)
    by_data = [NamedSharding(mesh, P(DATA_AXIS))] * len(want)
    if pieces:
        every = [NamedSharding(mesh, P(mesh.axis_names) if s.shape[0] % mesh.size == 0 else P()) for s in want]
        shapes = [s.shape[1:] for s in jax.tree.leaves(expect)]
        return first_shard(program, there, saved.read(every), lambda flats: treedef.unflatten(
            [f[: math.prod(shape)].reshape(shape) for f, shape in zip(flats, shapes, strict=True)]))
    if count == program.layout.num_shards:  # shard by shard: a logical shard's state stays its own
        return converted(program, there, treedef.unflatten(saved.read(by_data)))
    if folds_on_devices(program, there, count):
        partials = treedef.unflatten(saved.read(by_data))
        state = process_tree_fold(there, mesh, partials, program.host_operands, program.options.precision,
                                  program.fixed_products, program.merge_options)
    else:
        merge = compile_pair_merge(there, program.options.precision, program.fixed_products, program.merge_options,
                                   count)
        operands = program.host_operands
        state = tree_fold(lambda a, b: merge(a, b, operands), shards_of(treedef.unflatten(saved.read())))
        state = jax.tree.map(jnp.asarray, state)  # one host shard when there was one
    replicated = NamedSharding(mesh, P())
    return first_shard(program, there, jax.tree.map(lambda x: from_local(x, replicated), state), lambda s: s)


def _check_leaves(stored: list[jax.ShapeDtypeStruct], want: list[jax.ShapeDtypeStruct]) -> None:
    problem = None if len(stored) == len(want) else f"{len(stored)} accumulator leaves there but {len(want)} here"
    for i, (got, leaf) in enumerate(zip(stored, want, strict=False)):
        if problem is None and (got.shape != leaf.shape or got.dtype != leaf.dtype):
            problem = f"accumulator leaf {i} is {np.dtype(got.dtype).name}{list(got.shape)} there but " \
                      f"{np.dtype(leaf.dtype).name}{list(leaf.shape)} here"
    if problem is not None:
        raise UsageError(f"the checkpoint belongs to a different job: {problem}; rerun with the original settings "
                         "and sharded_scan version, or use a new checkpoint directory.")


def folds_on_devices(program: Program, there: Combiner, count: int) -> bool:
    """Whether ``count`` saved shards, read over this run's ``data`` axis, fold in :func:`tree_fold`'s
    tree by :func:`process_tree_fold`: a whole number of them a device, a power of two a process
    (or one process), each ``data`` row's devices in one process, states whole on a device."""
    leaders = process_leaders(program.mesh)
    return (count % program.layout.data_size == 0 and leaders is not None and there.partition(leaders) is None
            and power_of_two_or_alone(count // leaders.size, leaders.size))


def _shardings(program: Program) -> PyTree:
    return jax.tree.map(lambda s: s.sharding, program.like)


def converted(program: Program, there: Combiner, partials: PyTree) -> PyTree:
    """Each of ``partials``' shards converted from ``there``'s resolution to this program's, on its devices."""

    def convert(partials, operands):
        here, source = program.combiner.bind(operands), there.bind(operands)
        with jax.default_matmul_precision(program.options.precision):
            return jax.vmap(lambda acc: here.convert(acc, source))(partials)

    return jax.jit(convert, out_shardings=_shardings(program))(partials, program.operands)


def first_shard(program: Program, there: Combiner, inputs: Any, unpack: Callable[[Any], PyTree]) -> PyTree:
    """``[state, identity, ...]`` over this program's shards, where ``unpack(inputs)`` is one state of
    ``there``'s resolution of the job, converted to this program's (``inputs`` global on its mesh)."""
    shards = program.layout.num_shards

    def lay_out(inputs, operands):
        here = program.combiner.bind(operands)
        with jax.default_matmul_precision(program.options.precision):  # a select, not a concatenate: SPMD splits it
            return jax.tree.map(
                lambda m, z: jnp.where((jnp.arange(shards) == 0).reshape((shards,) + (1,) * m.ndim), m[None], z[None]),
                here.convert(unpack(inputs), there.bind(operands)), here.init(program.spec),
            )

    return jax.jit(lay_out, out_shardings=_shardings(program))(inputs, program.operands)
