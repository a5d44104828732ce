"""A checkpoint written on another mesh, laid out on this run's: :func:`relayout`.

A checkpoint holds one accumulator per logical shard, as the job was resolved for the
mesh that wrote it (:meth:`Combiner.for_mesh`: e.g. a Gram split by columns over a
``model`` axis). :class:`~sharded_scan.checkpoint.Checkpointer` restores one of the same
shape in place and hands any other here, as host arrays.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh

from sharded_scan.errors import UsageError
from sharded_scan.mesh import DATA_AXIS
from sharded_scan.program import Program, compile_pair_merge, place, shards_of, stacked, tree_fold

PyTree = Any


def relayout(program: Program, leaves: list[np.ndarray], meta: dict[str, Any]) -> PyTree:
    """``program``'s partials from a checkpoint's host ``leaves`` written with another shape (``meta``).

    With the same shard count each shard's accumulator is converted to this mesh's
    resolution of the job on its own (bitwise the state it saved, for a lossless
    conversion). Otherwise the saved shards are merged in :func:`tree_fold`'s tree by
    one pairwise merge program of the combiner as it was resolved for the mesh that wrote
    them (a compile that does not grow with the shard count; a few states on the device at
    once), converted, and laid out as ``[merged, identity, ...]`` over this run's shards.

    Raises:
      UsageError: the leaves are not what this job writes on such a mesh.
    """
    axes = {str(k): int(v) for k, v in meta["axes"].items()}
    saved = program.job.for_mesh(AbstractMesh((1, *axes.values()), (DATA_AXIS, *axes)))
    expect = jax.eval_shape(lambda: stacked(saved, program.spec, int(meta["shards"])))
    want = jax.tree.leaves(expect)
    problem = None if len(leaves) == len(want) else f"{len(leaves)} accumulator leaves there but {len(want)} here"
    for i, (got, leaf) in enumerate(zip(leaves, want, strict=False)):
        if problem is None and (got.shape != leaf.shape or got.dtype != leaf.dtype):
            problem = f"accumulator leaf {i} is {got.dtype.name}{list(got.shape)} there but " \
                      f"{np.dtype(leaf.dtype).name}{list(leaf.shape)} here"
    if problem is not None:
        raise UsageError(f"the checkpoint belongs to a different job: {problem}; "
                         "rerun with the original settings, or use a new checkpoint directory.")
    saved_partials = jax.tree.structure(expect).unflatten(leaves)
    target, spec, shards = program.combiner, program.spec, program.layout.num_shards
    operands = program.host_operands
    if int(meta["shards"]) != shards:  # folded in tree_fold's tree, one compiled merge, a few states at once
        merge = compile_pair_merge(saved, program.options.precision, program.fixed_products)
        saved_partials = tree_fold(lambda a, b: merge(a, b, operands), shards_of(saved_partials))

    def convert(saved_partials, operands):
        here, there = target.bind(operands), saved.bind(operands)
        with jax.default_matmul_precision(program.options.precision):
            if int(meta["shards"]) == shards:  # shard by shard: a logical shard's state stays its own
                return jax.vmap(lambda acc: here.convert(acc, there))(saved_partials)
            return jax.tree.map(
                lambda m, z: jnp.concatenate([m[None], jnp.broadcast_to(z[None], (shards - 1,) + z.shape)]),
                here.convert(saved_partials, there), here.init(spec),
            )

    host = jax.tree.map(np.asarray, jax.jit(convert)(saved_partials, operands))
    return place(host, jax.tree.map(lambda s: s.sharding, program.like))
