"""XLA's code generation chosen per program on CPU: the run's ``codegen`` option.

XLA:CPU compiles a program with its fusion emitters and LLVM's optimizations by default: code that runs fast, but
compiling is most of a small job's time (a 200,000 x 8 ``Describe``: 1.95 CPU-s of compile for 0.14 of steps).
Its legacy emitters without LLVM's optimizations (:data:`FAST_COMPILE`, what the test suite compiles with) compile
in a quarter to a half of that, and their code runs slower (there: 0.45 and 0.37). So each program compiles under
the setting that costs the job less, passed per compile (``jax.jit(compiler_options=)``, in the key of JAX's
persistent cache and of the job-keyed one, :mod:`sharded_scan.executables`):

- the step (:func:`step_options`): ``codegen="auto"`` (the default) compiles it cheaply where the job is small,
  fewer than :data:`SMALL_JOB_VALUES` values (rows x values a row, known before compile), and not under
  ``logical_shards``; ``"optimized"``: XLA's defaults whatever the size; ``"fast_compile"``: cheaply whatever the
  size, refused under ``logical_shards``;
- the merges (:func:`merge_options`): cheaply where the job has at most :data:`CHEAP_MERGE_SHARDS` shards (a pair
  merge runs ``shards - 1`` times, each slower at O0), else XLA's defaults;
- the identity's program (:func:`host_options`): cheaply (it runs once).

Each choice is a function of the job alone (its rows, its row's values, its shard count: ``logical_shards`` where
set), never of a cache or of the split, so every device and process split of a job, and its resume, compiles each
program under one setting. Under ``logical_shards`` the step is XLA's defaults': the cheap setting contracts a
step's multiply-adds into FMAs by how a device holds its shards (one, or a loop over several), so its bits differed
between splits (``GroupBy(Moments())``, 2 devices against 1); the merges run one program on every split. Only on
CPU: other platforms keep XLA's defaults. A flag the process's ``XLA_FLAGS`` names is the user's and never
overridden.
"""

from __future__ import annotations

import os
import re
from typing import Any

from sharded_scan.errors import UsageError

AUTO, OPTIMIZED, FAST = "auto", "optimized", "fast_compile"
CODEGENS = (AUTO, OPTIMIZED, FAST)
#: XLA:CPU's legacy emitters without LLVM's optimizations, the program's code in one LLVM module (not cut into parts
#: compiled on threads, which cost more CPU than they spread: the same code, so the same bits): what a cheap program
#: compiles with.
FAST_COMPILE: tuple[tuple[str, Any], ...] = (("xla_cpu_use_fusion_emitters", False),
                                             ("xla_backend_optimization_level", 0),
                                             ("xla_cpu_parallel_codegen_split_count", 1))
#: A job of fewer values (rows x values a row) compiles its step cheaply under ``codegen="auto"``. The break-even
#: (compile CPU saved over run CPU lost, bench/README.md "A small job in a fresh process") measured 3.3·10^6 values
#: for ``TopK`` (sorts and hashes run slowest at O0), 10.5·10^6 for ``Describe``, 12·10^6 for ``Quantiles``, 34·10^6
#: for ``Moments`` and more than 10^8 for ``Covariance`` and ``LinearRegression``: below the least of them.
SMALL_JOB_VALUES = 1 << 21
#: A job of at most this many shards compiles its merges cheaply: ``LinearRegression``'s pair merge at d=256 saves
#: 2-5 CPU-s of compile and runs 11-40 ms slower a pair (break-even about 120 pairs).
CHEAP_MERGE_SHARDS = 64

Options = tuple[tuple[str, Any], ...]


def check_codegen(value: Any) -> str:
    """The ``codegen`` option checked.

    Raises:
      UsageError: not one of :data:`CODEGENS`.
    """
    if not isinstance(value, str) or value not in CODEGENS:
        raise UsageError(f"codegen must be one of {', '.join(map(repr, CODEGENS))}; got {value!r}.")
    return value


def user_names(flag: str, xla_flags: str | None = None) -> bool:
    """Whether ``xla_flags`` (default: the process's ``XLA_FLAGS``) names ``flag``, with or without a value."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    return re.search(rf"(^|\s)--?{re.escape(flag)}(=|\s|$)", flags) is not None


def cheap(platform: str) -> Options:
    """:data:`FAST_COMPILE` on CPU, less the flags the user's ``XLA_FLAGS`` names; nothing elsewhere."""
    if platform != "cpu":
        return ()
    return tuple((name, value) for name, value in FAST_COMPILE if not user_names(name))


def step_options(codegen: str, platform: str, values: int, ordered: bool = False) -> Options:
    """The step's compiler options for a job of ``values`` values (rows x values a row) under ``codegen``;
    ``ordered``: under ``logical_shards``, whose steps compile on XLA's defaults (:func:`check_ordered`)."""
    if codegen == OPTIMIZED or (codegen == AUTO and (ordered or values >= SMALL_JOB_VALUES)):
        return ()
    return cheap(platform)


def check_ordered(codegen: str, logical_shards: int | None) -> None:
    """Refuses ``codegen="fast_compile"`` under ``logical_shards``: the legacy emitters at O0 contract a step's
    multiply-adds by how a device's shards are laid out (one shard or a loop over several), so a
    ``GroupBy(Moments())`` differed in its last bits between 2 devices and 1; XLA's defaults keep the bits."""
    if codegen == FAST and logical_shards is not None:
        raise UsageError("codegen='fast_compile' cannot keep logical_shards' results bitwise on every split (the "
                         "cheap code generation rounds by how the devices hold the shards); leave codegen unset "
                         "('auto' compiles a logical_shards job's steps on XLA's defaults) or drop logical_shards.")


def merge_options(platform: str, shards: int) -> Options:
    """The merges' compiler options for a job of ``shards`` shards (logical ones where set)."""
    return cheap(platform) if shards <= CHEAP_MERGE_SHARDS else ()


def host_options(platform: str) -> Options:
    """The compiler options of a program run once a job (the identity's)."""
    return cheap(platform)


def jit_options(options: Options) -> dict[str, Any] | None:
    """``options`` as ``jax.jit``'s ``compiler_options`` (None: XLA's defaults)."""
    return dict(options) or None
