"""configs/quantiles.py, distinct.py, topk.py (quick runs in test_launch.py), correlation.py: answers, bad kwargs."""

import importlib

import numpy as np
import pytest

import sharded_scan as ss
from launch.config_args import merge_extra, split_args
from launch.data import make_combiner, make_source
from launch.main import run_job
from sharded_scan.workdir import named_arrays
from tests.helpers import assert_usage_error, launcher_error_line


def quick(name):
    return importlib.import_module(f"configs.{name}").get_config("quick")


def test_quick_quantiles_config_gives_numpy_answers():
    config = quick("quantiles")
    source = make_source(config.data)
    got = ss.run(make_combiner(config.combiner), source, mesh="data:4", microbatch=config.microbatch)
    x = source.read(0, source.num_rows).astype(np.float64)  # 1000 rows: nothing compacted, so numpy's answers
    np.testing.assert_allclose(got.quantiles, np.quantile(x, got.qs, axis=0).T, rtol=1e-12)  # linear, the default
    assert sorted(named_arrays(got)) == ["columns", "count", "passes", "qs", "quantiles", "rank_error", "sketch"]


@pytest.mark.parametrize(
    "name, kwargs, words",
    [
        ("quantiles", {"qs": (0.5, 1.5)}, ["qs", "[0, 1]"]),
        ("quantiles", {"qs": (0.5,), "k": 2}, ["k", ">= 16"]),
        ("distinct", {"precision": 30}, ["precision", "[4, 18]"]),
        ("topk", {"k": 5000, "capacity": 4096}, ["capacity", "at least k"]),
        ("topk", {"k": 10, "capcity": 4096}, ["TopK", "capcity"]),
    ],
)
def test_bad_kwargs_are_one_line_before_any_write(tmp_path, name, kwargs, words):
    config = quick(name)
    config.combiner.kwargs = kwargs
    assert_usage_error(lambda: run_job(config, str(tmp_path / "w")), words)
    assert not (tmp_path / "w").exists()


def test_cli_prints_one_line_for_quantiles_outside_0_1(tmp_path, capsys):
    # The launcher's reading of the kwarg (split_args, merge_extra) and its end of a run (exits, cli_wording
    # around run_job) in this process: status 2, one error: line (no launcher process: ~1.8 s of imports)
    workdir = tmp_path / "w"
    _, extra = split_args(["--config.combiner.kwargs.qs=(0.5,2.0)"])
    config = quick("quantiles")
    merge_extra(config, extra)
    line = launcher_error_line(capsys, config, workdir)
    assert "qs" in line and "[0, 1]" in line and "(0.5, 2.0)" in line, line
    assert not workdir.exists()


def test_quick_correlation_config_gives_np_corrcoef():
    config = quick("correlation")
    source = make_source(config.data)
    got = ss.run(make_combiner(config.combiner), source, mesh="data:4", microbatch=config.microbatch)
    x = source.read(0, source.num_rows).astype(np.float64)
    assert got.count == source.num_rows
    np.testing.assert_allclose(got.mean, x.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.corr, np.corrcoef(x, rowvar=False), atol=1e-5)
