"""A job resolved once: the combiner as every program runs it, its layout, fingerprint and programs.

A :class:`Program` is what :func:`~sharded_scan.program.build_program` makes of a job, checked: the
run's policies wrap the combiner, the mesh resolves it (:meth:`Combiner.for_mesh`), the layout cuts
the rows into steps, the fingerprint names the job. Its programs are compiled on first use
(memoized, :func:`~sharded_scan.compile_cache.cached`, so a rerun of the same job compiles nothing):

- ``init() -> partials``: one identity accumulator per logical shard, with a leading
  shard axis sharded over ``data`` (and over the axes ``combiner.partition`` names);
- ``step(partials, batch, num_valid) -> partials``: each logical shard folds its block
  of the step's rows as ``steps_per_call`` micro-batches with ``lax.scan``; no
  collective; the partials are donated;
- ``merge(partials) -> acc``: by the route :func:`~sharded_scan.merging.choose_merge` picks once
  (:attr:`Program.merger`): a ``psum`` for additive combiners (without ``logical_shards``), one
  collective a leaf for the order-free reductions a combiner names (:meth:`Combiner.merge_collectives`),
  else a fixed tree (:func:`~sharded_scan.merging.tree_fold`'s): each device, or each process, folds
  its own shards, then log2 rounds of ``ppermute`` and ``combiner.merge``.

Every program traces under ``jax.default_matmul_precision(options.precision)`` and takes
the combiner's operands (:meth:`Combiner.operands`) as an argument, so new parameter
values reuse the compiled programs.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import threadpoolctl
from jax.extend.core import Literal
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from sharded_scan import codegen, compile_cache, executables
from sharded_scan.combiners.base import (
    FEW_MICROBATCHES,
    Combiner,
    folding_few_microbatches,
    reads_few_microbatches,
)
from sharded_scan.compile_cache import cached
from sharded_scan.layout import Layout, data_sharding, row_values
from sharded_scan.merging import Merge, MergeRoute, choose_merge, compile_gather, pinned
from sharded_scan.mesh import DATA_AXIS
from sharded_scan.options import RunOptions
from sharded_scan.sharding import (
    accumulator_specs,
    leaf_shardings,
    mesh_axes,
    named,
    operand_specs,
    per_leaf,
    place,
    stacked,
)

PyTree = Any
_log = logging.getLogger(__name__)
# The scope of the step's scans over micro-batches: the memory estimate finds their bodies (one
# micro-batch's mask and add) in the step's trace by it.
MICROBATCH_SCAN = "sharded_scan_microbatches"


# A step whose shards fold fewer rows than this (``microbatch * steps_per_call``) compiles one scan, masked, whatever
# the combiner: its second, constant-mask copy of the scan doubled the compile of the add (Moments: 1.5 CPU-s, not
# 1.2) to save a few selects a row, where a step of so few rows costs its dispatch more than its arithmetic.
TWO_SCANS_FROM_ROWS = 4096


def one_scan(combiner: Combiner, layout: Layout) -> bool:
    """Whether a step of ``layout`` folds every shard with one scan (a mask for its real rows): where
    ``combiner.one_scan_per_step`` asks, or the shards' blocks are small (:data:`TWO_SCANS_FROM_ROWS`)."""
    return bool(combiner.one_scan_per_step) or layout.rows_per_shard < TWO_SCANS_FROM_ROWS


# What an identity (``combiner.init``) is made of, evaluated in numpy by :func:`host_identity`: exact operations.
_HOST_PRIMITIVES = {
    "broadcast_in_dim": lambda x, *_, shape, broadcast_dimensions, **__: np.broadcast_to(
        np.expand_dims(x, tuple(i for i in range(len(shape)) if i not in broadcast_dimensions)), shape),
    "convert_element_type": lambda x, *, new_dtype, **_: np.asarray(x).astype(new_dtype),
    "iota": lambda *, dtype, shape, dimension, **_: np.broadcast_to(np.expand_dims(
        np.arange(shape[dimension], dtype=dtype), tuple(i for i in range(len(shape)) if i != dimension)), shape),
    "eq": lambda x, y: np.equal(x, y),
    "add": lambda x, y: np.add(x, y),
    "concatenate": lambda *xs, dimension: np.concatenate(xs, axis=dimension),
    "reshape": lambda x, *, new_sizes, **_: np.reshape(x, new_sizes),
}


_blas: tuple[int, threadpoolctl.ThreadpoolController] | None = None  # (modules loaded, their BLAS) when found


def one_blas_thread() -> Any:
    """A context in which the host's BLAS libraries run one thread (``threadpoolctl``), found once and again only
    after a module was imported since (a new library comes with one): finding them scans every loaded library,
    about 2.5 ms, which ``threadpool_limits`` does on every call (a run's finalize: 5% of a 50 ms job)."""
    global _blas
    if _blas is None or _blas[0] != len(sys.modules):
        _blas = (len(sys.modules), threadpoolctl.ThreadpoolController())
    return _blas[1].limit(limits=1, user_api="blas")


def host_identity(combiner: Combiner, spec: PyTree) -> PyTree | None:
    """``combiner.init(spec)`` as host numpy, without compiling: its jaxpr evaluated in numpy (read-only
    arrays, not kept: a grouped state may be large), or None where it holds an operation other than the exact
    ones numpy evaluates here, or a weak-typed value. Run eagerly, each ``jax.numpy`` call of an init compiles a
    program of its own (about 26 for ``Moments``); jitted, the init is one program a job (about 0.1 CPU-s)."""
    closed, shapes = jax.make_jaxpr(lambda: combiner.init(spec), return_shape=True)()
    try:
        values = _evaluate_on_host(closed.jaxpr, closed.consts)
    except Exception:  # noqa: BLE001 - another operation, or a value numpy does not hold (a PRNG key): jitted
        return None
    if any(v.aval.weak_type for v in closed.jaxpr.outvars):
        return None
    for x in values:
        x.flags.writeable = False
    return jax.tree.unflatten(jax.tree.structure(shapes), values)


def _evaluate_on_host(jaxpr: Any, consts: list, args: list = ()) -> list[np.ndarray]:
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, (np.asarray(c) for c in consts), strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(v):
        return np.asarray(v.val, v.aval.dtype) if isinstance(v, Literal) else env[v]

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        args = [read(v) for v in eqn.invars]
        if name in ("pjit", "jit", "closed_call"):
            inner = eqn.params["jaxpr"]
            outs = _evaluate_on_host(inner.jaxpr, inner.consts, args)
        elif name in _HOST_PRIMITIVES:
            outs = [_HOST_PRIMITIVES[name](*args, **eqn.params)]
        else:
            raise KeyError(name)  # not a primitive numpy evaluates here: jitted
        for v, x in zip(eqn.outvars, outs, strict=True):
            x = np.asarray(x)
            if x.shape != v.aval.shape:
                raise KeyError(name)  # not a primitive numpy evaluates here: jitted
            env[v] = x.astype(v.aval.dtype, copy=False)
    return [np.array(read(v), order="C") for v in jaxpr.outvars]


@cached
def compile_init(combiner: Combiner, spec: PyTree, mesh: Mesh, num_shards: int,
                 compiler_options: codegen.Options = ()) -> Callable:
    """The jitted maker of ``num_shards`` identity accumulators, laid out on ``mesh`` (``compiler_options``:
    :mod:`~sharded_scan.codegen`'s)."""
    return jax.jit(
        lambda: stacked(combiner, spec, num_shards),
        out_shardings=named(mesh, accumulator_specs(combiner, mesh, DATA_AXIS)),
        compiler_options=codegen.jit_options(compiler_options),
    )


@cached
def compile_step(combiner: Combiner, mesh: Mesh, layout: Layout, precision: str, fixed: bool = False,
                 few: int = 0, compiler_options: codegen.Options = ()) -> Callable:
    """``step(partials, batch, num_valid, operands) -> partials``, jitted, donating partials.

    ``batch`` holds ``layout.rows_per_step`` rows sharded over ``data``; of them the
    first ``num_valid`` are real. Each logical shard folds its block of rows as
    ``steps_per_call`` micro-batches of ``microbatch`` rows, in order. A shard whose
    block is all real rows takes a branch with a constant all-True mask, which XLA
    folds away (except where :func:`one_scan`: ``combiner.one_scan_per_step``, or small blocks). ``fixed``: every float
    product of ``add`` rounds as the code fixes (:func:`~sharded_scan.fixed_order.fixed_order`). ``few``: a short
    job's step (:attr:`Program.short`: 1 where a shard folds one micro-batch over the job, 2 a few; while it is
    traced, :func:`~sharded_scan.combiners.base.folds_few_microbatches` and ``folds_one_microbatch``).
    ``compiler_options``: XLA's code generation (:func:`~sharded_scan.codegen.step_options`).
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

        with jax.named_scope(MICROBATCH_SCAN):  # what the memory estimate finds in the step's trace
            if one_scan(combiner, layout):
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
        with jax.default_matmul_precision(precision), folding_few_microbatches(few):
            if per_device == 1:
                acc = fold_shard(bound, jax.tree.map(lambda x: x[0], partials), batch, valid[0])
                return jax.tree.map(lambda x: x[None], acc)
            shards = jax.tree.map(lambda x: x.reshape((per_device, rows_per_shard) + x.shape[1:]), batch)
            # One shard after another, each with the same scan as a lone shard would run.
            return jax.lax.map(lambda args: fold_shard(bound, *args), (partials, shards, valid))

    partial_specs = accumulator_specs(combiner, mesh, DATA_AXIS)
    # No collective in a step (axis_index only): check_vma=False traces no pvary casts, a quarter of a small
    # Describe step's 1,304 equations (1,008 without), the HLO the same but for constants' order.
    step = jax.shard_map(local_step, mesh=mesh, out_specs=partial_specs,
                         in_specs=(partial_specs, P(DATA_AXIS), P(), operand_specs(combiner, mesh)), check_vma=False)
    return jax.jit(step, donate_argnums=0, compiler_options=codegen.jit_options(compiler_options))


# Steps compiled or loaded through the job-keyed cache, by key, in this process (a rerun loads nothing again).
_KEYED: collections.OrderedDict[str, jax.stages.Compiled] = collections.OrderedDict()
_KEYED_SIZE = 32
_keyed_lock = threading.Lock()


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
      step_figures: the memory estimate's figures of the step (``admission``'s temporaries), kept beside its
        executable in the job-keyed cache (:mod:`sharded_scan.executables`).
    """

    combiner: Combiner
    job: Combiner
    spec: PyTree
    mesh: Mesh
    layout: Layout
    options: RunOptions
    fingerprint: dict[str, Any]
    step_figures: list[int] = dataclasses.field(default_factory=list, repr=False)

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
        """Identity partials, one accumulator per logical shard: the identity made on the host and placed
        (:func:`host_identity`; nothing to compile), else by a jitted program."""
        host = host_identity(self.combiner, self.spec)
        if host is None:
            return compile_init(self.combiner, self.spec, self.mesh, self.layout.num_shards,
                                codegen.host_options(self.platform))()
        # Each device's block a fresh copy: a CPU device may hold it without copying, and the step donates it.
        return jax.tree.map(lambda x, like: jax.make_array_from_callback(
            like.shape, like.sharding, lambda idx, x=x: np.array(np.broadcast_to(x[None], like.shape)[idx])),
            host, self.like)

    def step(self, partials: PyTree, batch: PyTree, num_valid: int) -> PyTree:
        """Folds one step's rows (``num_valid`` of them real) into ``partials`` (donated)."""
        return self._step(partials, batch, np.int32(num_valid), self.operands)

    @functools.cached_property
    def _step(self) -> Callable:
        """The step's program: where the job has a key (:attr:`step_key`), loaded from the job-keyed cache, else
        compiled from :meth:`trace_step` and kept there; else the jitted step."""
        if self.step_key is None:
            return self._jitted_step
        with _keyed_lock:
            if self.step_key in _KEYED:
                _KEYED.move_to_end(self.step_key)
                return _KEYED[self.step_key]
        entry = self.stored_step
        program = None if entry is None else executables.executable(entry, list(self.mesh.devices.flat))
        if program is None:
            hits = compile_cache.counts().from_cache
            lowered = self.trace_step().lower()
            # Kept by the job (below) where the memory estimate's figures are there to keep: not in JAX's cache too.
            with executables.not_in_jax_cache() if self.step_figures else contextlib.nullcontext():
                program = lowered.compile()
            # Only a step XLA compiled here is kept: one JAX's cache loaded serializes without its kernels on
            # XLA:CPU (the process loading that entry failed at its first step). Another thread's hit meanwhile
            # only keeps nothing.
            compiled_here = compile_cache.counts().from_cache == hits
            if self.step_figures and compiled_here:  # a later process's memory estimate reads them, not a trace
                executables.store(self.step_key, program, tuple(self.step_figures))
        with _keyed_lock:
            _KEYED[self.step_key] = program
            while len(_KEYED) > _KEYED_SIZE:
                _KEYED.popitem(last=False)
        return program

    @property
    def _jitted_step(self) -> Callable:
        return compile_step(self.combiner, self.mesh, self.layout.step_shape, self.options.precision,
                            self.fixed_products, self.short, self.step_options)

    @property
    def platform(self) -> str:
        """The devices' platform (``"cpu"``, ``"tpu"``, ``"gpu"``...)."""
        return self.mesh.devices.flat[0].platform

    @functools.cached_property
    def step_options(self) -> codegen.Options:
        """XLA's code generation for the step (:func:`~sharded_scan.codegen.step_options`): a function of the job
        (its rows, the values of a row, the ``codegen`` option) and the process's ``XLA_FLAGS``, the same on every
        split and resume of it."""
        values = self.layout.num_rows * max(row_values(self.spec), 1)
        return codegen.step_options(self.options.codegen, self.platform, values,
                                    ordered=self.options.logical_shards is not None)

    @functools.cached_property
    def merge_options(self) -> codegen.Options:
        """XLA's code generation for the merges (:func:`~sharded_scan.codegen.merge_options`): by the job's shard
        count (``logical_shards``' where set), the same on every split of it."""
        return codegen.merge_options(self.platform, self.layout.num_shards)

    @functools.cached_property
    def step_key(self) -> str | None:
        """The step's key in the job-keyed cache (:func:`~sharded_scan.executables.key`): the combiner as it runs,
        the step's layout, precision and forms, its arguments' shapes, dtypes and shardings, the mesh and, in it,
        the process's environment; None where that cache is off or the job holds what it cannot spell exactly
        (a user's function or class: :func:`~sharded_scan.executables.canonical`), and the step is traced."""
        if executables.directory() is None:
            return None
        try:
            like, batch, operands = self._step_shapes()
            return executables.key({
                "combiner": executables.canonical(self.combiner),
                "layout": executables.canonical(self.layout.step_shape),
                "precision": executables.canonical(self.options.precision),
                "fixed": self.fixed_products, "short": self.short, "x64": bool(jax.config.jax_enable_x64),
                "logical_shards": self.options.logical_shards,  # the merge route, whose figure the entry keeps
                "compiler_options": executables.canonical(self.step_options),
                "arguments": executables.abstract((like, batch, jax.ShapeDtypeStruct((), np.int32), operands)),
                "mesh": executables.mesh_terms(self.mesh),
            })
        except executables.UnkeyableError as why:
            _log.debug("the step is traced: the job-keyed cache cannot key %s.", why)
            return None

    @functools.cached_property
    def stored_step(self) -> executables.Entry | None:
        """This step's entry in the job-keyed cache, read and checked (not loaded yet); None where there is none."""
        return None if self.step_key is None else executables.load(self.step_key)

    def merge(self, partials: PyTree) -> PyTree:
        """Every shard's partial merged into one accumulator, on every device (or split over
        the axes ``combiner.partition`` names), by :attr:`merger`."""
        return self.merger.run(partials, self.merge_operands)

    @functools.cached_property
    def merger(self) -> Merge:
        """How :meth:`merge` merges the shards' partials: the route's object, decided once
        (:func:`~sharded_scan.merging.choose_merge` says which route when)."""
        return choose_merge(self.combiner, self.mesh, self.layout, self.like, self.options.logical_shards is not None,
                            self.options.precision, self.fixed_products, self.merge_options)

    @property
    def merge_route(self) -> MergeRoute:
        """The route :attr:`merger` takes (:class:`~sharded_scan.merging.MergeRoute`)."""
        return self.merger.route

    @property
    def merge_operands(self) -> PyTree:
        """The operands as :attr:`merger` takes them: whole (:attr:`host_operands`) where it merges pairs
        on one device, else placed as the step takes them (:attr:`operands`)."""
        return self.host_operands if self.merger.whole_operands else self.operands

    @functools.cached_property
    def short(self) -> int:
        """Whether each shard folds fewer than :data:`~sharded_scan.combiners.base.FEW_MICROBATCHES` micro-batches
        over the whole job (a resumed one's too) and the combiner compiles less for it
        (:func:`~sharded_scan.combiners.base.reads_few_microbatches`): 1 where it folds one, 2 more, else 0
        (:func:`compile_step`'s ``few``: a program each)."""
        microbatches = self.layout.num_steps() * self.layout.steps_per_call
        return min(microbatches, 2) if microbatches < FEW_MICROBATCHES and reads_few_microbatches(self.combiner) else 0

    @property
    def fixed_products(self) -> bool:
        """Whether float products round as the code fixes (:mod:`sharded_scan.fixed_order`).

        Where ``logical_shards`` promises bitwise results on CPU: XLA:CPU's matmul library
        picks its summation order by the process's thread pool, the CPU's caches and the
        output's width. TPUs and GPUs (deterministic mode) run one order per program.
        """
        return self.options.logical_shards is not None and self.platform == "cpu"

    def _step_shapes(self) -> tuple[PyTree, PyTree, PyTree]:
        """The step's partials, batch and operands as ``jax.ShapeDtypeStruct`` leaves, with their shardings."""
        rows, sharding = self.layout.rows_per_step, data_sharding(self.mesh)
        batch = jax.tree.map(lambda s: jax.ShapeDtypeStruct((rows, *s.shape), s.dtype, sharding=sharding), self.spec)
        # The operands' shapes only: the memory estimate traces the step before they are placed.
        operands = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
            np.shape(x), jax.dtypes.canonicalize_dtype(np.asarray(x).dtype), sharding=s),
            self.host_operands, self.operand_shardings)
        return self.like, batch, operands

    def trace_step(self) -> jax.stages.Traced:
        """The step traced for this program's shapes; JAX keeps the trace, so the run's first step does
        not trace it again (the memory estimate reads one micro-batch's ``add`` in it: :data:`MICROBATCH_SCAN`)."""
        like, batch, operands = self._step_shapes()
        return self._jitted_step.trace(like, batch, np.int32(0), operands)

    def lower_step(self) -> jax.stages.Lowered:
        """The step lowered for this program's shapes (``.compile().as_text()`` shows its HLO)."""
        return self.trace_step().lower()

    def lower_merge(self) -> jax.stages.Lowered:
        """The merge lowered for this program's partials (by :attr:`merger`: the pairwise merge of
        the process tree or a local fold, whose all-gather is :meth:`lower_gather`; else the one program)."""
        return self.merger.lower(self.like, self.merge_operands)

    def lower_gather(self) -> jax.stages.Lowered:
        """The all-gather of the partials that a merge by :class:`~sharded_scan.merging.LocalFold` starts with."""
        return compile_gather(self.combiner, self.mesh, self.merge_options).lower(self.like)

    def finalize(self, merged: PyTree) -> Any:
        """The result from the merged accumulator (host numpy).

        Host BLAS/LAPACK runs on one thread here: the matrices are small, and OpenBLAS's
        threads next to XLA's idle CPU clients made a 258 x 258 SVD take 0.8 s instead of 0.01 s.
        """
        with one_blas_thread():
            return self.combiner.finalize(merged)
