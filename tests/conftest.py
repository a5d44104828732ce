"""Eight simulated CPU devices for every test in this process; one compilation cache for the run."""

import compileall
import contextlib
import os
import shutil
import tempfile

# One persistent compilation cache for the whole test run: both workers and every process
# they start (launcher runs, multi-process jobs) reuse each other's compiled programs
# instead of compiling the same quick configs again. Set before JAX reads its options;
# tests that count compilations count cache hits too (tests/test_program.py).
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID") or str(os.getpid())
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ  # xdist workers inherit the controller's
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"sharded_scan_tests_{_RUN}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Tests patch the library's code and constants at run time, which the job-keyed cache of steps cannot see
# (sharded_scan/executables.py): off in the suite and the processes it starts; tests/test_executables.py turns it on.
os.environ.setdefault("SHARDED_SCAN_EXECUTABLE_CACHE", "0")
# XLA:CPU compiles the suite's programs with its legacy emitters and without LLVM's optimizations: 35-50% less
# compile CPU than its defaults, and compiling is most of the suite's time. What the tests check does not depend
# on the code generator: results within their bounds either way, and logical_shards' bits compared within one
# setting (across splits bitwise only on XLA's defaults, which tests/test_codegen.py gives one test explicitly);
# tests/test_reproducible.py checks the defaults users get in a process of its own. Run with XLA_FLAGS set (even
# empty) for your own flags.
# And each program's code in one LLVM module rather than split into parts compiled on threads: the same code (the
# same bits), 15-20% less compile CPU (tests/test_statistics.py: 11.7 -> 9.7 CPU-s), no gain in wall on 2 cores.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=0 "
                      "--xla_cpu_parallel_codegen_split_count=1")

import jax  # noqa: E402 - after the cache settings above
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from tests import collector, forks  # noqa: E402

collector.fewer_collections()

jax.config.update("jax_num_cpu_devices", 8)

# Property-based tests: a fixed seed and a few examples in the default run (every run the same cases,
# seconds a module); HYPOTHESIS_PROFILE=long searches deeper with fresh random cases (DESIGN.md).
_SLOW_EXAMPLES = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("default", derandomize=True, max_examples=12, deadline=None,
                          suppress_health_check=_SLOW_EXAMPLES, print_blob=True)
settings.register_profile("long", max_examples=400, deadline=None, suppress_health_check=_SLOW_EXAMPLES,
                          print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


# The longest modules first: under `-n 2` the other worker runs the rest beside them (a -n 2 run's
# --durations: test_docs' chains and test_exact_counts' x64 subprocess come right after test_reproducible).
LONGEST_FIRST = (
    "tests/test_reproducible.py", "tests/test_docs.py", "tests/test_exact_counts.py", "tests/test_certified.py",
    "tests/test_faults.py", "tests/test_dead_peer.py",
)


def pytest_sessionstart(session):
    # The processes tests start (launcher runs, multi-process jobs, docs blocks) import this checkout
    # afresh: where PYTHONDONTWRITEBYTECODE is set, as in CI images, each compiled its sources again
    # (0.4-0.5 s of CPU a process, over a hundred processes a run). Their bytecode, once, up front.
    if not hasattr(session.config, "workerinput"):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        for package in ("sharded_scan", "launch", "configs", "tests", "bench"):
            compileall.compile_dir(os.path.join(root, package), quiet=1)


def pytest_sessionfinish(session):
    forks.close_shared()  # this process's fork server (tests/forks.py), which the modules' processes shared
    if _OWN_CACHE and not hasattr(session.config, "workerinput"):  # the run's controller: the cache is done
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


# The slow tier: modules of many processes, launcher runs or generated cases, and those whose compiled programs
# cost more than about 20 s of CPU (SHARDED_SCAN_TEST_CPU, below, measures them). `pytest -m "not slow"` leaves
# them out for the edit-test loop (the engine's and the build's modules stay in it); README's test command and CI
# run every tier.
SLOW = (
    "tests/test_reproducible.py", "tests/test_docs.py", "tests/test_exact_counts.py", "tests/test_certified.py",
    "tests/test_faults.py", "tests/test_dead_peer.py", "tests/test_multihost.py", "tests/test_local.py",
    "tests/test_sigterm.py", "tests/test_properties.py", "tests/test_properties_sketches.py",
    "tests/test_float_extremes.py", "tests/test_statistics.py", "tests/test_quantiles.py", "tests/test_describe.py",
    "tests/test_regression.py", "tests/test_wide_model.py", "tests/test_columns.py", "tests/test_launch.py",
    "tests/test_keys64.py", "tests/test_compact_checkpoint.py", "tests/test_sketches_keyed_weighted.py",
    "tests/test_grouped.py", "tests/test_cli_explains.py", "tests/test_cli_config.py", "tests/test_topk.py",
    "tests/test_no_silent_wrong.py", "tests/test_dtypes.py", "tests/test_nan_omit.py",
    "tests/test_correlation_and_forms.py", "tests/test_results.py", "tests/test_resume.py", "tests/test_histogram.py",
    "tests/test_launch_recipes.py", "tests/test_tabular.py", "tests/test_datasketches.py",
)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a module of many processes, launcher runs, generated cases or programs")
    # pytest's unraisable-exception plugin runs five full collections of the cycle collector as a session ends, to
    # report objects whose finalizers raised: 0.6 s of CPU each over a test process's heap (JAX's caches of
    # programs, every module), 3-8 s a worker at the end of a run. Each test's unraisable exceptions are still
    # reported after it; a finalizer that raises only when the last cycles are collected goes to stderr instead.
    with contextlib.suppress(ImportError):
        from _pytest.unraisableexception import gc_collect_iterations_key

        config.stash[gc_collect_iterations_key] = 0


def pytest_collection_modifyitems(items):
    for item in items:
        if item.nodeid.split("::")[0] in SLOW:
            item.add_marker(pytest.mark.slow)

    def rank(item):
        path = item.nodeid.split("::")[0]
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the rest keep their order


# SHARDED_SCAN_TEST_CPU=FILE appends each test's CPU seconds (this process, the processes it waited for and the
# shared fork server's children it waited for: tests/forks.py) and wall seconds to FILE: what a test costs, whatever
# else the machine is doing (bench/README.md, the suite).
_CPU_LOG = os.environ.get("SHARDED_SCAN_TEST_CPU")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _CPU_LOG:
        yield
        return
    import resource
    import time

    def cpu():
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + forks.forked_cpu()

    cpu0, wall0 = cpu(), time.perf_counter()
    yield
    with open(_CPU_LOG, "a") as log:
        log.write(f"{cpu() - cpu0:.2f}\t{time.perf_counter() - wall0:.2f}\t{item.nodeid}\n")
