"""The options of a run, written out once: :class:`RunOptions`.

``sharded_scan.run(combiner, data, **options)``, ``run_with_report`` and the launcher
all build a :class:`RunOptions`; the job configs carry its plain-value fields
(:func:`config_fields`) with the same defaults, so the list of options and their
defaults exist only here. Every option is checked here, once, when the options are made;
what reads them later (the layout, the policies, the watchdog) takes them as checked. ``None``
for ``microbatch`` / ``steps_per_call`` means the measured default (:mod:`sharded_scan.layout`),
resolved once into the :class:`~sharded_scan.layout.Layout` that the compiled programs and the
job's fingerprint both read.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from typing import Any

import numpy as np

from sharded_scan import codegen as codegens
from sharded_scan import compile_cache
from sharded_scan.errors import UsageError
from sharded_scan.progress import check_progress
from sharded_scan.watchdog import check_timeout

NAN_POLICIES = ("propagate", "omit", "omit_rows", "raise")
# What ``jax.default_matmul_precision`` takes: "highest" is true float32 (or float64)
# products on every platform; the others allow bf16 passes (TPU) or TF32 (GPU).
PRECISIONS = ("highest", "high", "default", "float32", "tensorfloat32", "bfloat16")

_CONFIG = "config"  # field metadata: the field is a plain value a job config carries, of this type


def _plain(default: Any, kind: type) -> Any:
    return dataclasses.field(default=default, metadata={_CONFIG: kind})


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How :func:`sharded_scan.run` runs a reduction.

    Attributes:
      mesh: a ``Mesh`` or a spec such as ``"data:8"``, ``"data:4,model:2"``; None puts
        every device on ``data``.
      microbatch: rows per device per scan iteration; None: about 4 MiB of rows, or more where the
        combiner's ``microbatch_values`` asks (TopK: 16 values a monitored slot; 65536 rows of one column)
        (:func:`sharded_scan.layout.default_microbatch`).
      steps_per_call: micro-batches each logical shard folds per compiled call; None:
        :func:`sharded_scan.layout.default_steps_per_call`.
      prefetch: steps read and placed on the devices ahead of use (0: none).
      logical_shards: a fixed number of independent accumulators (a multiple of the
        ``data`` axis size), folded and merged in a fixed order, so the result is
        bitwise identical on every device count dividing it. None: one per device,
        merged by ``psum`` when additive.
      nan_policy: rows holding NaN or Inf: ``"propagate"`` (numpy's behaviour), ``"omit"`` (each
        such value skipped where it stands, as pandas' ``skipna``: per column for per-column statistics, per
        pair of columns for ``Covariance``/``Correlation``, the row for whole-row ones such as
        ``LinearRegression``), ``"omit_rows"`` (every row holding one skipped, in every statistic)
        or ``"raise"`` (stop at the first such step).
      compensated: Kahan-compensated float accumulation for additive combiners.
      precision: the matmul precision of every step and merge
        (``jax.default_matmul_precision``): ``"highest"`` (true float32 products, the
        default) or a faster, less exact one such as ``"tensorfloat32"`` (GPU) or
        ``"bfloat16"`` / ``"default"`` (TPU's one-pass bf16).
      checkpoint: None, a directory, :class:`sharded_scan.CheckpointOptions` or a
        :class:`sharded_scan.checkpoint.Checkpointer`: resume from the latest
        checkpoint there, save periodically and at the end, and on SIGTERM save and
        raise :class:`sharded_scan.Preempted`.
      progress: ``"auto"`` (None, the default): once a run has gone on for 3 seconds, a tqdm
        bar over rows on process 0 when stderr is a terminal (a line every 5 seconds without
        tqdm), nothing otherwise; False: nothing; True: a tqdm bar from the start
        (``pip install tqdm``); a callable: called with a :class:`sharded_scan.Progress` after
        every step (and no bar); a list of callables and/or True calls each
        (:func:`sharded_scan.progress.combine` chains callbacks and closes them).
      step_timeout: seconds; when no step finishes for that long, print one line and
        end the process with status 3 (a stuck process or peer). None: no watchdog.
      compilation_cache: where compiled programs are kept for the next process (JAX's
        persistent compilation cache, process-wide, set before the run compiles): "auto"
        (the directory the process gave JAX, else ``$XDG_CACHE_HOME/sharded_scan/jax``), a
        directory, or None / "" for none (:mod:`sharded_scan.compile_cache`); a job's step is also kept
        there by the job, so the next process neither traces nor compiles it
        (:mod:`sharded_scan.executables`).
      codegen: how XLA compiles the step on CPU: ``"auto"`` (the default) with its legacy emitters and
        without LLVM's optimizations where the job is small (fewer than 2^21 values: rows x values a row),
        which compiles several times faster and runs slower, else (and under ``logical_shards``) XLA's
        defaults; ``"optimized"``: XLA's defaults; ``"fast_compile"``: the cheap setting whatever the size
        (refused under ``logical_shards``: not bitwise on every split). The same for every split and resume of
        one job; a flag ``XLA_FLAGS`` names wins (:mod:`sharded_scan.codegen`).
    """

    mesh: Any = _plain(None, str)
    microbatch: int | None = _plain(None, int)
    steps_per_call: int | None = _plain(None, int)
    prefetch: int = _plain(2, int)
    logical_shards: int | None = _plain(None, int)
    nan_policy: str = _plain("propagate", str)
    compensated: bool = _plain(True, bool)
    precision: str = _plain("highest", str)
    checkpoint: Any = None
    progress: Callable[[Any], None] | bool | str | tuple | None = None
    step_timeout: float | None = None
    compilation_cache: str | None = _plain(compile_cache.AUTO, str)
    codegen: str = _plain(codegens.AUTO, str)

    def __post_init__(self):
        for name in ("microbatch", "steps_per_call", "logical_shards"):
            value = getattr(self, name)
            if value is not None:
                check_positive_int(name, value)
        prefetch = self.prefetch
        if isinstance(prefetch, bool) or not isinstance(prefetch, (int, np.integer)) or prefetch < 0:
            raise UsageError(f"prefetch must be a non-negative integer, got {prefetch!r}.")
        if self.nan_policy not in NAN_POLICIES:
            raise UsageError(f"nan_policy must be one of {', '.join(NAN_POLICIES)}; got {self.nan_policy!r}.")
        if not isinstance(self.compensated, (bool, np.bool_)):
            raise UsageError(f"compensated must be True or False, got {self.compensated!r}.")
        if self.precision not in PRECISIONS:
            raise UsageError(f"precision must be one of {', '.join(PRECISIONS)}; got {self.precision!r}.")
        object.__setattr__(self, "progress", check_progress(self.progress))  # frozen: set once, checked
        object.__setattr__(self, "step_timeout", check_timeout(self.step_timeout))
        object.__setattr__(self, "compilation_cache", compile_cache.check_setting(self.compilation_cache))
        codegens.check_codegen(self.codegen)
        codegens.check_ordered(self.codegen, self.logical_shards)

    @classmethod
    def make(cls, options: RunOptions | None = None, **overrides: Any) -> RunOptions:
        """``options`` (default: all defaults) with ``overrides`` replaced.

        Raises:
          UsageError: an override names no option (with the closest name), or a value is bad.
        """
        if options is not None and not isinstance(options, RunOptions):
            raise UsageError(f"options must be a RunOptions, got {type(options).__name__}.")
        names = [f.name for f in dataclasses.fields(cls)]
        for key in overrides:
            if key not in names:
                near = difflib.get_close_matches(key, names, n=1)
                hint = f"did you mean {near[0]!r}? " if near else ""
                raise UsageError(f"{key!r} is not a run option; {hint}the options are: {', '.join(names)}.")
        return dataclasses.replace(options or cls(), **overrides)


def config_fields() -> dict[str, tuple[Any, type]]:
    """``{name: (default, type)}`` of the options a job config carries as plain values."""
    return {f.name: (f.default, f.metadata[_CONFIG]) for f in dataclasses.fields(RunOptions) if _CONFIG in f.metadata}


def check_positive_int(name: str, value: Any) -> None:
    """Raises a one-line UsageError unless ``value`` is a positive integer."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise UsageError(f"{name} must be a positive integer, got {value!r}.")
