"""XLA's code generation chosen per program on CPU (``sharded_scan.codegen``, the ``codegen`` run option)."""

import jax
import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan import codegen, compiled, executables
from sharded_scan.codegen import FAST_COMPILE, SMALL_JOB_VALUES
from sharded_scan.program import program_for_spec
from tests.helpers import XLA_DEFAULTS, CrashError, assert_usage_error, crash_at

LEGACY, LEVEL, SPLIT = (name for name, _ in FAST_COMPILE)
DEFAULTS = XLA_DEFAULTS
assert tuple(name for name, _ in DEFAULTS) == (LEGACY, LEVEL, SPLIT)  # XLA:CPU's own values of the three


@pytest.fixture
def no_user_flags(monkeypatch):
    """A process whose XLA_FLAGS names none of the flags, as a user's (the suite's names all: tests/conftest.py)."""
    monkeypatch.setenv("XLA_FLAGS", "")


def options_of(lowered):
    """The compiler options JAX compiles a lowered program with (as ``jax.jit(compiler_options=)`` gave them)."""
    return tuple(lowered._lowering._compiler_options_kvs or ())


def program(rows, d=1, **options):
    return program_for_spec(ss.Sum(), jax.ShapeDtypeStruct((d,), np.float32), rows, ss.RunOptions(**options))


def test_the_codegen_option_is_checked():
    assert ss.RunOptions().codegen == "auto" and ss.options.config_fields()["codegen"] == ("auto", str)
    assert_usage_error(lambda: ss.RunOptions(codegen="fast"), "codegen must be one of 'auto', 'optimized', "
                       "'fast_compile'; got 'fast'.")


def test_the_choice_is_the_jobs_the_same_on_every_split_and_a_users_flag_wins(no_user_flags, monkeypatch):
    small, large = SMALL_JOB_VALUES // 4 - 1, SMALL_JOB_VALUES // 4  # rows of 4 values
    for mesh in ("data:8", "data:2", "data:1"):  # every split of one job: its rows, values and shards alone
        split = dict(mesh=mesh, logical_shards=8)
        assert program(small, 4, mesh=mesh).step_options == FAST_COMPILE, mesh
        assert program(large, 4, mesh=mesh).step_options == (), mesh
        assert program(large, 4, codegen="fast_compile", mesh=mesh).step_options == FAST_COMPILE, mesh
        assert program(small, 4, codegen="optimized", mesh=mesh).step_options == (), mesh
        assert program(small, 4, **split).step_options == (), mesh  # logical_shards: XLA's defaults at any size
        assert program(large, 4, **split).merge_options == FAST_COMPILE, mesh  # 8 shards: every merge cheap
    assert_usage_error(lambda: ss.RunOptions(codegen="fast_compile", logical_shards=8),
                       "codegen='fast_compile' cannot keep logical_shards' results bitwise on every split")
    assert program(64, mesh="data:2", logical_shards=128).merge_options == ()  # 127 pair merges: XLA's defaults
    assert codegen.step_options("auto", "tpu", 1) == () and codegen.merge_options("gpu", 1) == ()
    # A flag the process's XLA_FLAGS names is the user's: never overridden, the others still are.
    for flags, left in (
        ("--xla_backend_optimization_level=3", ((LEGACY, False), (SPLIT, 1))),
        (f"--xla_dump_to=/tmp/x --{LEGACY}", ((LEVEL, 0), (SPLIT, 1))),
        (f"--{LEGACY}=false --{LEVEL}=0", ((SPLIT, 1),)),
        (f"--{LEGACY}=false --{LEVEL}=0 --{SPLIT}=1", ()),  # the suite's
        ("--xla_backend_optimization_level_x=1", FAST_COMPILE),  # another flag
    ):
        monkeypatch.setenv("XLA_FLAGS", flags)
        assert codegen.cheap("cpu") == left, flags
        assert program(8, mesh="data:1").step_options == left, flags


def test_the_options_reach_the_compile_and_key_the_job_keyed_cache(no_user_flags, monkeypatch):
    monkeypatch.setenv(executables.ENV, "1")
    cheap, optimized = program(100, mesh="data:2"), program(100, mesh="data:2", codegen="optimized")
    assert options_of(cheap.lower_step()) == FAST_COMPILE and options_of(optimized.lower_step()) == ()
    assert options_of(cheap.lower_merge()) == options_of(optimized.lower_merge()) == FAST_COMPILE
    assert None not in (cheap.step_key, optimized.step_key) and cheap.step_key != optimized.step_key


def test_a_small_job_compiled_cheaply_answers_as_numpy_on_every_split_and_resume(no_user_flags, monkeypatch, tmp_path):
    steps = []  # the compiler options of every step program made
    real = compiled.compile_step
    monkeypatch.setattr(compiled, "compile_step", lambda *a: steps.append(a[-1]) or real(*a))
    x = np.random.default_rng(0).normal(3, 2, size=(601, 3)).astype(np.float32)
    x[5, 1] = np.inf
    kw = dict(microbatch=8, steps_per_call=4, nan_policy="omit")
    want = ss.run(ss.Moments(), x, mesh="data:2", **kw)
    options = ss.CheckpointOptions(str(tmp_path), every_steps=1)
    with pytest.raises(CrashError):
        ss.run(ss.Moments(), x, mesh="data:2", checkpoint=options, progress=crash_at(3), **kw)
    got, report = ss.run_with_report(ss.Moments(), x, mesh="data:1", checkpoint=options, **kw)
    assert report.resumed_from_cursor is not None and report.devices == 1
    assert steps and all(s == FAST_COMPILE for s in steps)
    f64 = np.where(np.isfinite(x), x, np.nan).astype(np.float64)
    for result in (want, got):
        np.testing.assert_allclose(result.mean, np.nanmean(f64, 0), rtol=1e-6)
        np.testing.assert_allclose(result.var, np.nanvar(f64, 0), rtol=1e-5)
        np.testing.assert_array_equal(result.max, np.nanmax(f64, 0))


def test_a_small_logical_shards_job_compiles_its_steps_on_xlas_defaults_and_is_bitwise_on_every_split(
        no_user_flags, monkeypatch):
    # The cheap setting rounded a GroupBy(Moments())'s fold by how a device holds its shards (one, or a loop over
    # two: multiply-adds contracted into FMAs otherwise): 2 devices and 1 differed in the last bits of every field.
    # XLA reads XLA_FLAGS once a process (the suite's name the cheap setting), so the library's () compiles here on
    # XLA's defaults given explicitly, as in a user's process.
    steps = []
    real = compiled.compile_step
    monkeypatch.setattr(compiled, "compile_step", lambda *a: steps.append(a[-1]) or real(*a[:-1], a[-1] or DEFAULTS))
    rng = np.random.default_rng(0)
    keys, x = rng.integers(0, 3, 1000).astype(np.int32), (3 + rng.normal(size=(1000, 2))).astype(np.float32)
    kw = dict(logical_shards=2, microbatch=256)
    split, whole = (ss.run(ss.GroupBy(ss.Moments(), 3), (keys, x), mesh=mesh, **kw) for mesh in ("data:2", "data:1"))
    for field in ("mean", "var", "skewness", "kurtosis", "min", "max"):
        np.testing.assert_array_equal(getattr(whole, field), getattr(split, field), err_msg=field)
    assert steps and all(s == () for s in steps)
    np.testing.assert_allclose(whole.mean, [x[keys == k].astype(np.float64).mean(0) for k in range(3)], rtol=1e-6)
