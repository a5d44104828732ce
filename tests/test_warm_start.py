"""Warm starts: the compilation_cache option, and a second process loading its programs from the cache."""

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan import compile_cache
from sharded_scan.errors import UsageError


def test_the_compilation_cache_option_is_checked():
    assert ss.RunOptions().compilation_cache == "auto"
    assert ss.RunOptions(compilation_cache=pathlib.Path("/tmp/c")).compilation_cache == "/tmp/c"
    assert ss.RunOptions(compilation_cache="").compilation_cache is None
    with pytest.raises(UsageError, match="compilation_cache must be 'auto', a directory or None"):
        ss.RunOptions(compilation_cache=3)
    assert ss.options.config_fields()["compilation_cache"] == ("auto", str)


def test_the_user_cache_directory_follows_xdg(monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere")
    assert compile_cache.user_cache_dir() == "/somewhere/sharded_scan/jax"


def fresh_sum():
    """A combiner no other run of the process compiled: a new function object, so the engine's
    memoized programs (keyed on the combiner) miss and compile, looking in the persistent cache."""

    def body(acc, rows):
        return acc + rows.sum(0)

    return ss.from_fn(body, jnp.zeros(3, jnp.float32))


def test_a_second_run_loads_its_compiled_programs_from_the_cache(tmp_path):
    x = np.arange(600, dtype=np.float32).reshape(200, 3)
    cache = tmp_path / "cache"
    before = jax.config.jax_compilation_cache_dir  # tests/conftest.py's, restored after
    try:
        run = dict(compilation_cache=str(cache), checkpoint=None, mesh="data:2", microbatch=16)
        got, cold = ss.run_in_workdir(fresh_sum(), x, tmp_path / "a", **run)
        assert compile_cache.in_use() == str(cache) and os.listdir(cache)  # filled
        assert cold["compilation_cache"]["programs"] > 0 and cold["compilation_cache"]["from_cache"] == 0
        assert not cold["compiled_from_cache"] and cold["first_step_seconds"] > 0

        again, warm = ss.run_in_workdir(fresh_sum(), x, tmp_path / "b", **run)
        assert warm["compilation_cache"] == {"directory": str(cache), "programs": warm["compilation_cache"]["programs"],
                                             "from_cache": warm["compilation_cache"]["programs"]}
        assert warm["compiled_from_cache"] and warm["first_step_seconds"] > 0
        np.testing.assert_array_equal(again, x.sum(0))
        np.testing.assert_array_equal(got, again)

        assert compile_cache.use(None) is None and compile_cache.in_use() is None  # off, process-wide
    finally:
        compile_cache.use(before)
    assert compile_cache.in_use() == before


def test_a_cache_directory_that_cannot_be_written_is_one_line(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with pytest.raises(UsageError, match="cannot be created or written"):
        ss.run(ss.Sum(), np.ones((4, 2), np.float32), compilation_cache=str(blocked / "cache"))
