"""JAX's persistent compilation cache for runs: a warm start compiles nothing it compiled before.

``RunOptions(compilation_cache=...)`` (the launcher's ``--config.compilation_cache``) says where
the compiled programs of every job are kept, so the next process that runs a job of the same
shapes loads them from disk instead of compiling them:

- ``"auto"`` (the default): the directory the process already gave JAX
  (``JAX_COMPILATION_CACHE_DIR``, ``jax.config.update("jax_compilation_cache_dir", ...)``), its
  thresholds as set there; else :func:`user_cache_dir`, ``$XDG_CACHE_HOME/sharded_scan/jax``
  (``~/.cache/sharded_scan/jax``), shared by every job of the user, or nothing where that
  directory cannot be written;
- a directory (local, or a URL such as ``gs://bucket/cache``): that one;
- ``None`` or ``""``: no persistent cache.

JAX's cache is process-wide and read when a program is first compiled: :func:`use` sets
it before a run compiles anything (and resets JAX's cache object when the setting changes), so
the last run's setting holds for every ``jax.jit`` of the process from then on. Where
sharded_scan picks the directory itself, every program is cached, also those compiling in
under a second (``jax_persistent_cache_min_compile_time_secs=0``, unless the environment sets
``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS``). :func:`counts` tells how many programs were
looked up in the cache and how many came from it, :func:`compile_seconds` how long compiling took
(JAX's ``jax.monitoring`` events). Like JAX's
own, the cache is trusted: anyone who can write the directory can run code in your jobs.

Within a process :func:`cached` memoizes the builders of the programs (init, step, merges): a
rerun of the same job traces and compiles nothing.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.experimental.compilation_cache import compilation_cache

from sharded_scan.errors import UsageError

AUTO = "auto"
_MIN_COMPILE_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
_REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"
_HITS = "/jax/compilation_cache/cache_hits"
_log = logging.getLogger(__name__)
_lock = threading.Lock()
_applying = threading.Lock()
_counts = {_REQUESTS: 0, _HITS: 0}
_turned_off = False  # the cache is off because a run said so (a later "auto" turns it back on)


class CacheCounts(NamedTuple):
    """Programs compiled through the persistent cache so far in this process."""

    looked_up: int   # compiles that asked the cache first
    from_cache: int  # of those, loaded from it (not compiled)


# JAX's durations of tracing, lowering and compiling a program (the last also loading it from the persistent cache).
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
_compile_seconds = [0.0]


def _count(event: str, **kwargs: Any) -> None:
    if event in _counts:
        with _lock:
            _counts[event] += 1


def _time(event: str, seconds: float, **kwargs: Any) -> None:
    if event in COMPILE_EVENTS:
        with _lock:
            _compile_seconds[0] += seconds


jax.monitoring.register_event_listener(_count)
jax.monitoring.register_event_duration_secs_listener(_time)


def compile_seconds() -> float:
    """Seconds this process has spent tracing, lowering and compiling programs (or loading them from the
    persistent cache) so far, by JAX's ``jax.monitoring`` durations, in every thread (subtract two for a run's)."""
    with _lock:
        return _compile_seconds[0]


def counts() -> CacheCounts:
    """The process's :class:`CacheCounts` so far (subtract two to count a run's)."""
    with _lock:
        return CacheCounts(_counts[_REQUESTS], _counts[_HITS])


def note_loaded() -> None:
    """Counts a program loaded from the job-keyed cache (:mod:`sharded_scan.executables`) as one looked up in
    the cache and loaded from it: it compiled nothing."""
    with _lock:
        _counts[_REQUESTS] += 1
        _counts[_HITS] += 1


def in_use() -> str | None:
    """The directory of the process's persistent compilation cache; None when it has none."""
    return jax.config.jax_compilation_cache_dir if jax.config.jax_enable_compilation_cache else None


def user_cache_dir() -> str:
    """``$XDG_CACHE_HOME/sharded_scan/jax``, ``~/.cache/sharded_scan/jax`` without it."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sharded_scan", "jax")


def check_setting(value: Any) -> str | None:
    """The ``compilation_cache`` option checked: ``"auto"``, a directory as a string, or None (off).

    Raises:
      UsageError: not a string, a path or None.
    """
    if value is None or value == "":
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise UsageError(f"compilation_cache must be 'auto', a directory or None (off), got {type(value).__name__}.")
    return value


def _writable(directory: str) -> bool:
    if "://" in directory and not directory.startswith("file://"):
        return True  # a store's own errors are JAX's warnings
    try:
        os.makedirs(directory.removeprefix("file://"), exist_ok=True)
    except OSError:
        return False
    return os.access(directory.removeprefix("file://"), os.W_OK | os.X_OK)


def use(setting: str | None) -> str | None:
    """Points JAX's persistent compilation cache where ``setting`` (checked) says, for the whole process.

    Returns:
      The directory compiled programs are kept in from now on; None when the cache is off.

    Raises:
      UsageError: a directory named explicitly that cannot be created or written.
    """
    global _turned_off
    config = jax.config
    with _applying:
        enabled, directory = config.jax_enable_compilation_cache, config.jax_compilation_cache_dir
        own = setting is not None and (setting != AUTO or directory is None)  # sharded_scan picks the directory
        if setting is None:
            enabled = False
        elif setting != AUTO:
            directory, enabled = setting, True
            if not _writable(directory):
                raise UsageError(f"compilation_cache={setting!r} cannot be created or written; name a writable "
                                 "directory, or None ('' on the command line) for no cache.")
        else:
            enabled = enabled or _turned_off  # on again after a run that turned it off; off if the process said so
            if directory is None:
                directory = user_cache_dir()
                if not _writable(directory):
                    _log.info("no persistent compilation cache: %s cannot be written.", directory)
                    directory, own = None, False
        if (enabled, directory) != (config.jax_enable_compilation_cache, config.jax_compilation_cache_dir):
            config.update("jax_compilation_cache_dir", directory)
            config.update("jax_enable_compilation_cache", enabled)
            compilation_cache.reset_cache()  # JAX reads its setting once: from now on, this one
        if own and _MIN_COMPILE_TIME_ENV not in os.environ:
            config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        _turned_off = setting is None
    return in_use()


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
