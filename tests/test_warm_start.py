"""Warm starts: the compilation_cache option, and a second process loading its programs from the cache."""

import logging
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


@pytest.fixture(scope="module")
def cold_and_warm(tmp_path_factory):
    """A job run twice through its own compilation cache: ``(x, (result, summary) cold, the same warm, the done:
    lines logged, each run's compile_cache.compile_seconds())``."""
    tmp_path = tmp_path_factory.mktemp("warm")
    x = np.arange(600, dtype=np.float32).reshape(200, 3)
    cache = tmp_path / "cache"
    before = jax.config.jax_compilation_cache_dir  # tests/conftest.py's, restored after
    lines, log = Lines(), logging.getLogger("sharded_scan.workdir")
    level = log.level
    log.addHandler(lines), log.setLevel(logging.INFO)
    try:
        run = dict(compilation_cache=str(cache), checkpoint=None, mesh="data:2", microbatch=16)
        first, second = fresh_sum(), fresh_sum()  # made before: jnp.zeros compiles too
        spent = [compile_cache.compile_seconds()]  # every run's tracing and compiling, by JAX's events
        cold = ss.run_in_workdir(first, x, tmp_path / "a", **run)
        spent.append(compile_cache.compile_seconds())
        assert compile_cache.in_use() == str(cache) and os.listdir(cache)  # filled
        warm = ss.run_in_workdir(second, x, tmp_path / "b", **run)
        spent.append(compile_cache.compile_seconds())

        assert compile_cache.use(None) is None and compile_cache.in_use() is None  # off, process-wide
    finally:
        log.removeHandler(lines), log.setLevel(level)
        compile_cache.use(before)
    assert compile_cache.in_use() == before
    done = [line for line in lines.messages if line.startswith("done: ")]
    return x, cold, warm, done, [spent[1] - spent[0], spent[2] - spent[1]]


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_a_second_run_loads_its_compiled_programs_from_the_cache(cold_and_warm):
    x, (got, cold), (again, warm), *_ = cold_and_warm
    directory = cold["compilation_cache"]["directory"]
    assert cold["compilation_cache"]["programs"] > 0 and cold["compilation_cache"]["from_cache"] == 0
    assert not cold["compiled_from_cache"] and cold["first_step_seconds"] > 0
    assert warm["compilation_cache"] == {"directory": directory, "programs": warm["compilation_cache"]["programs"],
                                         "from_cache": warm["compilation_cache"]["programs"]}
    assert warm["compiled_from_cache"] and warm["first_step_seconds"] > 0
    np.testing.assert_array_equal(again, x.sum(0))
    np.testing.assert_array_equal(got, again)


def test_the_done_line_tells_compiling_from_reading_and_computing(cold_and_warm):
    # Issue 43: "done: 10000 rows in 1.75 s (642 rows/s) ... first step after 2.33 s": compiling counted as reading,
    # and the first step's time (from before the run) longer than the run. Now each is said apart, and rows/s is
    # over the reading and computing.
    _, (_, cold), (_, warm), done, spent = cold_and_warm
    assert len(done) == 2, done
    for summary, line, compiling in ((cold, done[0], spent[0]), (warm, done[1], spent[1])):
        assert 0 < summary["compile_seconds"] < summary["seconds"]  # tracing, at least, even from the cache
        # Issue 45: a workdir's summary left out the step traced while the program was built (its memory estimate).
        assert summary["compile_seconds"] == pytest.approx(compiling, rel=1e-9)
        assert summary["compute_seconds"] == pytest.approx(summary["seconds"] - summary["compile_seconds"])
        assert summary["rows_per_second"] == pytest.approx(summary["rows_this_run"] / summary["compute_seconds"])
        assert (f"done: 200 rows in {summary['seconds']:.2f} s (compiling {summary['compile_seconds']:.2f} s, "
                f"reading and computing {summary['compute_seconds']:.2f} s: {summary['rows_per_second']:,.0f} rows/s)"
                ) in line, line
        assert "first step" not in line
    assert "0 of " in done[0] and "programs from the compilation cache" in done[1]


def test_a_cache_directory_that_cannot_be_written_is_one_line(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with pytest.raises(UsageError, match="cannot be created or written"):
        ss.run(ss.Sum(), np.ones((4, 2), np.float32), compilation_cache=str(blocked / "cache"))
