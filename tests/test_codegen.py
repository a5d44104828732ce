"""XLA's code generation chosen per program on CPU (``sharded_scan.codegen``, the ``codegen`` run option)."""

import jax
import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan import codegen, compiled, executables
from sharded_scan.codegen import FAST_COMPILE, SMALL_JOB_VALUES
from sharded_scan.program import program_for_spec
from tests.helpers import CrashError, assert_usage_error, crash_at

LEGACY, LEVEL = (name for name, _ in FAST_COMPILE)


@pytest.fixture
def no_user_flags(monkeypatch):
    """A process whose XLA_FLAGS names neither flag, as a user's (the suite's names both: tests/conftest.py)."""
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
        assert program(small, 4, **split).step_options == FAST_COMPILE, mesh
        assert program(large, 4, **split).step_options == (), mesh
        assert program(large, 4, codegen="fast_compile", **split).step_options == FAST_COMPILE, mesh
        assert program(small, 4, codegen="optimized", **split).step_options == (), mesh
        assert program(large, 4, **split).merge_options == FAST_COMPILE, mesh  # 8 shards: every merge cheap
    assert program(64, mesh="data:2", logical_shards=128).merge_options == ()  # 127 pair merges: XLA's defaults
    assert codegen.step_options("auto", "tpu", 1) == () and codegen.merge_options("gpu", 1) == ()
    # A flag the process's XLA_FLAGS names is the user's: never overridden, the other one still is.
    for flags, left in (
        ("--xla_backend_optimization_level=3", ((LEGACY, False),)),
        (f"--xla_dump_to=/tmp/x --{LEGACY}", ((LEVEL, 0),)),
        (f"--{LEGACY}=false --{LEVEL}=0", ()),  # the suite's
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


def test_a_small_job_compiled_cheaply_answers_as_numpy_and_every_split_and_resume_bitwise(
        no_user_flags, monkeypatch, tmp_path):
    steps = []  # the compiler options of every step program made
    real = compiled.compile_step
    monkeypatch.setattr(compiled, "compile_step", lambda *a: steps.append(a[-1]) or real(*a))
    x = np.random.default_rng(0).normal(3, 2, size=(601, 3)).astype(np.float32)
    x[5, 1] = np.inf
    kw = dict(logical_shards=4, microbatch=8, steps_per_call=4, nan_policy="omit")
    want = ss.run(ss.Moments(), x, mesh="data:2", **kw)
    options = ss.CheckpointOptions(str(tmp_path), every_steps=1)
    with pytest.raises(CrashError):
        ss.run(ss.Moments(), x, mesh="data:2", checkpoint=options, progress=crash_at(3), **kw)
    got, report = ss.run_with_report(ss.Moments(), x, mesh="data:1", checkpoint=options, **kw)
    assert report.resumed_from_cursor is not None and report.devices == 1
    assert steps and all(s == FAST_COMPILE for s in steps)
    for field in want._fields:
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    f64 = np.where(np.isfinite(x), x, np.nan).astype(np.float64)
    np.testing.assert_allclose(want.mean, np.nanmean(f64, 0), rtol=1e-6)
    np.testing.assert_allclose(want.var, np.nanvar(f64, 0), rtol=1e-5)
    np.testing.assert_array_equal(want.max, np.nanmax(f64, 0))
