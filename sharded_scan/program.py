"""A job checked and resolved once, before any compute: :func:`build_program` makes its :class:`Program`.

:func:`build_program` checks the combiner, the data and the options, wraps the combiner in the
run's policies, resolves it for the mesh (:meth:`Combiner.for_mesh`), cuts the rows into steps
(:func:`~sharded_scan.layout.make_layout`), names the job (its fingerprint) and refuses a job that
cannot fit in memory (:func:`~sharded_scan.admission.check_fits`), all before anything compiles. The
:class:`~sharded_scan.compiled.Program` it returns holds the job's programs.

Beside it: :mod:`sharded_scan.merging` merges the shards' partials, by one route chosen once;
:mod:`sharded_scan.sharding` lays the partials and operands out on the mesh;
:mod:`sharded_scan.relayout` lays a checkpoint written with another shard count or another
resolution of the job out on this one.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sharded_scan import compile_cache
from sharded_scan.admission import check_fits
from sharded_scan.combiners.base import Combiner, rows_spec
from sharded_scan.combiners.wrappers.policies import Wrapper, apply_policies, innermost
from sharded_scan.compiled import Program
from sharded_scan.dtypes import check_placeable, x64_scope
from sharded_scan.errors import UsageError
from sharded_scan.fixed_order import refusal, unpinned
from sharded_scan.identity import job_fingerprint
from sharded_scan.layout import make_layout, resolve_chunking
from sharded_scan.mesh import DATA_AXIS, make_mesh
from sharded_scan.options import RunOptions
from sharded_scan.sources import ArraySource, Source

PyTree = Any
_log = logging.getLogger(__name__)


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
                                options.logical_shards or mesh.shape[DATA_AXIS], job.microbatch_values)
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


def check_pinned(program: Program) -> None:
    """Where ``fixed_products``: one line before any compute when the job's ``add`` or ``merge`` holds a
    float sum :mod:`~sharded_scan.fixed_order` cannot fix the order of (the programs would refuse it
    only as they are traced, the merge's after the last step)."""
    names = unpinned_parts(program.job, program.spec, program.layout.microbatch, program.options.precision)
    if names:
        raise UsageError(refusal(type(innermost(program.job)).__name__, list(names)))


@compile_cache.cached
def unpinned_parts(job: Combiner, spec: Any, rows: int, precision: str) -> tuple[str, ...]:
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
