"""launch.main: every config's quick variant equals sharded_scan.run; outputs; one-line errors."""

import importlib
import json

import numpy as np
import pytest

import sharded_scan as ss
from launch.data import make_combiner, make_source
from launch.main import named_arrays, run_job
from sharded_scan import distributed
from tests import cli
from tests.helpers import assert_usage_error

CONFIGS = [
    "gram", "covariance", "moments", "pca", "ridge", "histogram", "seed_example", "quantiles", "distinct", "topk",
]


def quick(name):
    return importlib.import_module(f"configs.{name}").get_config("quick")


@pytest.mark.parametrize("name", CONFIGS)
def test_quick_config_through_launcher_equals_library_run(tmp_path, name):
    cli.needs_synthetic_source()
    config = quick(name)
    config.mesh = "data:4"
    got, record = run_job(config, str(tmp_path))
    want = ss.run(
        make_combiner(config.combiner), make_source(config.data), mesh="data:4", microbatch=config.microbatch,
        steps_per_call=config.steps_per_call,
    )
    cli.assert_same(named_arrays(got), named_arrays(want))
    cli.assert_same(cli.result(tmp_path), named_arrays(want))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == json.loads(json.dumps(record))
    assert summary["rows"] == config.data.num_rows and summary["devices"] == 4
    assert summary["checkpoints_written"] >= 1 and cli.checkpoints(tmp_path)[-1] == config.data.num_rows


def test_cli_run_with_overrides_writes_result_summary_and_progress(tmp_path):
    cli.needs_synthetic_source()
    proc = cli.run(cli.main_cmd(
        "--config=configs/gram.py:quick", f"--workdir={tmp_path}", "--config.microbatch=8",
        "--config.data.features=6", "--config.log_every_seconds=0",
    ))
    assert proc.returncode == 0, proc.stderr
    config = quick("gram")
    config.microbatch, config.data.features = 8, 6
    want = ss.run(ss.Gram(), make_source(config.data), mesh="data:4", microbatch=8, steps_per_call=2)
    np.testing.assert_allclose(cli.result(tmp_path)["result"], want, rtol=1e-6, atol=1e-4)
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("rows", "seconds", "rows_per_second", "bytes_per_second", "devices", "processes", "mesh",
                "resumed_from_step", "checkpoints_written", "config"):
        assert key in summary, key
    assert summary["config"]["microbatch"] == 8 and summary["mesh"] == {"data": 4} and summary["processes"] == 1
    progress = [line for line in proc.stderr.splitlines() if "step " in line and "rows/s" in line and "ETA" in line]
    assert progress and "/" in progress[-1]


def test_named_arrays():
    assert list(named_arrays(np.zeros(2))) == ["result"]
    assert sorted(named_arrays(ss.combiners.SumResult(np.zeros(2), np.int64(3)))) == ["count", "sum"]
    assert sorted(named_arrays({"a": np.zeros(1), "b": {"c": np.ones(1)}})) == ["a", "b.c"]


@pytest.mark.parametrize(
    "args, words",
    [
        (["--config.typo=1"], ["'typo'", "not a field"]),
        (["--config.microbatch=abc"], ["microbatch", "abc"]),
        (["--config=configs/nope.py"], ["configs/nope.py"]),
    ],
)
def test_bad_input_is_one_line_before_any_write(tmp_path, args, words):
    workdir = tmp_path / "w"
    line = cli.one_error_line(cli.run(cli.main_cmd("--config=configs/gram.py:quick", f"--workdir={workdir}", *args)))
    for word in words:
        assert word in line, line
    assert not workdir.exists()


def test_bad_config_values_and_partial_coordinator_flags_are_usage_errors(tmp_path):
    config = quick("gram")
    config.data.kind = "npy"
    assert_usage_error(lambda: run_job(config, str(tmp_path / "w")), ["--config.data.path"])
    config.data.kind = "parquet"
    assert_usage_error(lambda: run_job(config, str(tmp_path / "w")), ["data.kind", "parquet"])
    config = quick("gram")
    config.combiner.name = "Nope"
    assert_usage_error(lambda: run_job(config, str(tmp_path / "w")), ["Nope"])
    config.combiner.name, config.combiner.kwargs = "Histogram", {"bins": 3, "rnage": (0, 1)}
    assert_usage_error(lambda: run_job(config, str(tmp_path / "w")), ["Histogram", "rnage"])
    assert not (tmp_path / "w").exists()
    assert_usage_error(lambda: distributed.initialize(num_processes=2), ["--coordinator_address"])
    assert_usage_error(lambda: distributed.initialize("127.0.0.1:1", 2, 2), ["process_id"])
    assert distributed.initialize() == "single"  # no cluster here


def test_missing_or_unwritable_workdir(tmp_path):
    assert "--workdir" in cli.one_error_line(cli.run(cli.main_cmd("--config=configs/gram.py:quick")))
    blocker = tmp_path / "file"
    blocker.write_text("")
    line = cli.one_error_line(cli.run(cli.main_cmd("--config=configs/gram.py:quick", f"--workdir={blocker}/w")))
    assert str(blocker) in line
