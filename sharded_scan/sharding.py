"""How a program's partials and operands lie on a mesh, and how they come back to the host.

The partials are stacked: a leading shard axis over ``data``, one accumulator a logical shard
(:func:`stacked`), each leaf split over the other axes as :meth:`Combiner.partition` names
(:func:`accumulator_specs`); the combiner's operands are whole on every device or split as
:meth:`Combiner.operand_partition` names (:func:`operand_specs`). :func:`place` lays host arrays out
by such shardings, :func:`to_host` brings device arrays back as numpy (on every process).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sharded_scan.combiners.base import Combiner
from sharded_scan.mesh import DATA_AXIS

PyTree = Any


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


def stacked(combiner: Combiner, spec: PyTree, count: int) -> PyTree:
    """``count`` identity accumulators along a new leading shard axis (traceable)."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x[None], (count,) + x.shape), combiner.init(spec))


def shards_of(partials: PyTree) -> list[PyTree]:
    """The per-shard accumulators of stacked ``partials``."""
    count = jax.tree.leaves(partials)[0].shape[0]
    return [jax.tree.map(lambda x, i=i: x[i], partials) for i in range(count)]


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
