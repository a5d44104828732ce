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
- ``merge(partials) -> acc``: one collective: a ``psum`` for additive combiners, else one
  all-gather and a fixed-order tree fold with ``combiner.merge`` (in each process, by a
  pairwise merge compiled for one device, when the accumulator is whole on every device).

Beside it: :mod:`sharded_scan.admission` refuses a job that cannot fit in memory before
anything compiles, and :mod:`sharded_scan.relayout` lays a checkpoint written with another
shard count or another resolution of the job out on this one.

Every program traces under ``jax.default_matmul_precision(options.precision)`` and takes
the combiner's operands (:meth:`Combiner.operands`) as an argument, so new parameter
values reuse the compiled programs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import threadpoolctl
from jax.experimental import multihost_utils
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sharded_scan.admission import check_fits, memory_estimate  # noqa: F401 - memory_estimate: its old home
from sharded_scan.combiners.base import Combiner
from sharded_scan.combiners.pca import PCA
from sharded_scan.combiners.regression import LinearRegression
from sharded_scan.combiners.wrappers import apply_policies, innermost
from sharded_scan.dtypes import check_placeable, x64_scope
from sharded_scan.errors import UsageError
from sharded_scan.fixed_order import fixed_order
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


def named(mesh: Mesh, specs: PyTree) -> PyTree:
    """``NamedSharding``s on ``mesh`` for a pytree (prefix) of PartitionSpecs."""
    return jax.tree.map(lambda p: NamedSharding(mesh, p), specs, is_leaf=lambda x: isinstance(x, P))


def tree_fold(merge: Callable, items: list) -> Any:
    """Merges ``items`` pairwise in a fixed balanced tree (deterministic order)."""
    while len(items) > 1:
        paired = [merge(items[i], items[i + 1]) for i in range(0, len(items) - 1, 2)]
        items = paired + ([items[-1]] if len(items) % 2 else [])
    return items[0]


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
        add = fixed_order(bound.add) if fixed else bound.add
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
    step = jax.shard_map(
        local_step, mesh=mesh, in_specs=(partial_specs, P(DATA_AXIS), P(), P()), out_specs=partial_specs
    )
    return jax.jit(step, donate_argnums=0)


@cached
def compile_gather(combiner: Combiner, mesh: Mesh) -> Callable:
    """``gather(partials) -> partials`` whole on every device: one all-gather over ``data``."""
    return jax.jit(lambda partials: partials, out_shardings=named(mesh, accumulator_specs(combiner, mesh, None)))


@cached
def compile_pair_merge(combiner: Combiner, precision: str, fixed: bool = False) -> Callable:
    """``merge(a, b, operands) -> acc`` of two accumulators, jitted for one device (``fixed``:
    float products in contraction order)."""

    def merge(a, b, operands):
        with jax.default_matmul_precision(precision):
            bound = combiner.bind(operands)
            return (fixed_order(bound.merge) if fixed else bound.merge)(a, b)

    return jax.jit(merge)


@cached
def compile_merge(combiner: Combiner, mesh: Mesh, ordered: bool, precision: str, fixed: bool = False) -> Callable:
    """``merge(partials, operands) -> acc``: one collective over ``data``.

    Additive combiners are merged by one ``psum`` unless ``ordered``; otherwise the
    partials are all-gathered once and folded with ``combiner.merge`` in a fixed tree,
    which makes the result independent of the device count. The result is on every
    device, or split over the axes ``combiner.partition`` names (a wide accumulator is
    summed over ``data`` only, never gathered whole on one device). ``fixed``: float
    products of the merge in contraction order.
    """
    partial_specs = accumulator_specs(combiner, mesh, DATA_AXIS)
    merged_specs = accumulator_specs(combiner, mesh)
    if combiner.additive and not ordered:

        def local_psum(partials, operands):
            del operands
            return jax.tree.map(lambda x: x[0], jax.lax.psum(partials, DATA_AXIS))

        return jax.jit(
            jax.shard_map(local_psum, mesh=mesh, in_specs=(partial_specs, P()), out_specs=merged_specs)
        )

    def gather_and_fold(partials, operands):
        everywhere = jax.lax.with_sharding_constraint(partials, named(mesh, accumulator_specs(combiner, mesh, None)))
        with jax.default_matmul_precision(precision):
            bound = combiner.bind(operands)
            return tree_fold(fixed_order(bound.merge) if fixed else bound.merge, shards_of(everywhere))

    return jax.jit(gather_and_fold, out_shardings=named(mesh, merged_specs))


def place(host: PyTree, shardings: PyTree) -> PyTree:
    """Global jax.Arrays from host arrays every process holds whole (any process count)."""
    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(np.shape(x), s, lambda idx, x=x: np.asarray(x)[idx]), host, shardings
    )


def leaf_shardings(combiner: Combiner, mesh: Mesh, like: PyTree) -> PyTree:
    """One ``NamedSharding`` per leaf of the stacked partials ``like``."""
    prefix = named(mesh, accumulator_specs(combiner, mesh, DATA_AXIS))
    return jax.tree.map(
        lambda s, sub: jax.tree.map(lambda _: s, sub), prefix, like, is_leaf=lambda x: isinstance(x, NamedSharding)
    )


def mesh_axes(mesh: Mesh) -> dict[str, int]:
    """The mesh's axes other than ``data``: what :meth:`Combiner.for_mesh` resolves by."""
    return {name: int(size) for name, size in dict(mesh.shape).items() if name != DATA_AXIS}


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
    def operands(self) -> PyTree:
        """The combiner's operands, replicated on every device."""
        replicated = NamedSharding(self.mesh, P())
        return place(self.host_operands, jax.tree.map(lambda _: replicated, self.host_operands))

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
        """The one collective merge of every shard's partial.

        A combiner whose merge is not a sum and whose accumulator is not split over other
        axes is merged by each process on one of its devices (:meth:`merges_locally`).
        """
        if self.merges_locally:
            gathered = compile_gather(self.combiner, self.mesh)(partials)
            local = jax.tree.map(lambda x: x.addressable_data(0), gathered)
            merge = compile_pair_merge(self.combiner, self.options.precision, self.fixed_products)
            operands = jax.device_put(self.host_operands, jax.tree.leaves(local)[0].device)
            return tree_fold(lambda a, b: merge(a, b, operands), shards_of(local))
        ordered = self.options.logical_shards is not None
        merge = compile_merge(self.combiner, self.mesh, ordered, self.options.precision, self.fixed_products)
        return merge(partials, self.operands)

    @property
    def fixed_products(self) -> bool:
        """Whether float products sum in contraction order (:mod:`sharded_scan.fixed_order`).

        Where ``logical_shards`` promises bitwise results on CPU: XLA:CPU's matmul library
        picks its summation order by the process's thread pool, the CPU's caches and the
        output's width. TPUs and GPUs (deterministic mode) run one order per program.
        """
        return self.options.logical_shards is not None and self.mesh.devices.flat[0].platform == "cpu"

    @property
    def merges_locally(self) -> bool:
        """Whether :meth:`merge` all-gathers the partials and each process folds them on one device.

        For a combiner whose merge is not a sum and whose accumulator is whole on each
        device: its partials are folded in a fixed tree by one program, compiled once for
        one device, called ``shards - 1`` times. In one SPMD program the fold was traced
        ``shards - 1`` times (compile time grew with the device count: a LinearRegression
        merge on 8 devices compiled 7 re-whitening folds), and XLA optimizes a program for
        8 devices differently from one for 1 (other fusions, other roundings), so it was
        not bitwise the same on every split of a ``logical_shards`` job.
        """
        return not self.combiner.additive and self.combiner.partition(self.mesh) is None

    def lower_step(self) -> jax.stages.Lowered:
        """The step lowered for this program's shapes (``.compile().as_text()`` shows its HLO)."""
        rows, sharding = self.layout.rows_per_step, data_sharding(self.mesh)
        batch = jax.tree.map(lambda s: jax.ShapeDtypeStruct((rows, *s.shape), s.dtype, sharding=sharding), self.spec)
        compiled = compile_step(
            self.combiner, self.mesh, self.layout.step_shape, self.options.precision, self.fixed_products
        )
        return compiled.lower(self.like, batch, np.int32(0), self.operands)

    def lower_merge(self) -> jax.stages.Lowered:
        """The merge lowered for this program's partials (the pairwise merge where
        :meth:`merges_locally`; its all-gather is :meth:`lower_gather`)."""
        if self.merges_locally:
            one = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), self.like)
            merge = compile_pair_merge(self.combiner, self.options.precision, self.fixed_products)
            return merge.lower(one, one, self.host_operands)
        ordered = self.options.logical_shards is not None
        merge = compile_merge(self.combiner, self.mesh, ordered, self.options.precision, self.fixed_products)
        return merge.lower(self.like, self.operands)

    def lower_gather(self) -> jax.stages.Lowered:
        """The all-gather of the partials that a merge by :meth:`merges_locally` starts with."""
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
    job.check_spec(source.spec)
    if isinstance(source, ArraySource):  # in memory: bad values (keys, weights) are one line before compute
        job.check_rows(source.read(0, source.num_rows))
    check_placeable(source.spec)
    mesh = make_mesh(options.mesh)
    chunking = resolve_chunking(source.spec, options.microbatch, options.steps_per_call)
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
    check_fits(program)
    return program


def check_string_ids(combiner: Combiner, source: Source) -> None:
    """One line when string columns, read as hash ids, would reach a combiner that reduces numbers."""
    strings = source.string_columns
    if strings and not combiner.takes_string_ids:
        raise UsageError(
            f"the string column(s) {', '.join(map(repr, strings))} are read as stable int32 ids, not as numbers: only "
            f"combiners that count values take them (TopK, DistinctCount), and {type(combiner).__name__} reduces "
            "numbers; leave them out of columns=, or encode them as numbers first."
        )


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
