"""launch.main: every config's quick variant equals sharded_scan.run; outputs; one-line errors."""

import importlib
import json

import numpy as np
import pandas as pd
import pytest

import sharded_scan as ss
from launch.data import make_combiner, make_source
from launch.main import run_job
from launch.outputs import CSV, result_json, result_table
from sharded_scan import distributed
from sharded_scan.workdir import named_arrays
from tests import cli, forks
from tests.helpers import assert_usage_error, launcher_error_line
from tests.tfrecords import read_scalars

# The module's launcher processes: forks of one process that imported the launcher (tests/forks.py), ~1.1 s of CPU
# less each than a fresh interpreter.
launcher_forks = forks.module_fixture()

CONFIGS = [
    "gram", "covariance", "moments", "pca", "ridge", "linreg", "histogram", "seed_example", "quantiles", "distinct",
    "topk", "custom_combiner",
]


def quick(name):
    return importlib.import_module(f"configs.{name}").get_config("quick")


@pytest.mark.parametrize("name", CONFIGS)
def test_quick_config_through_launcher_equals_library_run(tmp_path, name):
    config = quick(name)
    # 300 of the quick variant's 1000 rows: its programs (microbatch 16, 2 scans a call) over 3 steps of 4 devices,
    # a save after step 2 and a last step mostly padding, as the 8 steps of 1000 rows; each step of TopK's and
    # DistinctCount's tables runs ~0.15 s at the suite's XLA settings, twice here (the launcher, the library)
    config.mesh, config.data.num_rows = "data:4", 300
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


BAD_ARGS = [  # a typo in a --config field: tests/test_cli_config.py (the whole line, nothing written); a value of
    # the wrong type: tests/test_bad_input.py (the field and the value)
    (["--config=configs/nope.py"], ["configs/nope.py"]),
    (["--profile_steps=3:x"], ["--profile_steps", "'3:x'"]),
]
OVERRIDES = ("--config.microbatch=8", "--config.data.features=6", "--config.log_every_seconds=0")


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """Every CLI command of this module, started at once: ``{name: (CompletedProcess, workdir)}``."""
    base = tmp_path_factory.mktemp("cli")
    cases = {
        "overrides": (cli.main_cmd("--config=configs/gram.py:quick", f"--workdir={base / 'ok'}", *OVERRIDES,
                                   "--tensorboard=on", "--profile_steps=2:3"), base / "ok"),
        "missing workdir": (cli.main_cmd("--config=configs/gram.py:quick"), None),
    }
    for i, (args, _) in enumerate(BAD_ARGS):
        workdir = base / f"bad{i}"
        cases[f"bad {i}"] = (cli.main_cmd("--config=configs/gram.py:quick", f"--workdir={workdir}", *args), workdir)
    # the job and the three command lines that end before a job runs, side by side: forks of the module's fork
    # server (tests/forks.py; python -m launch.main itself, a fresh interpreter: tests/test_cli_config.py's
    # own-combiner run, tests/test_storage_faults.py's disk-full run, launch.local's processes)
    procs = cli.run_forked([cmd for cmd, _ in cases.values()])
    return {name: (proc, workdir) for (name, (_, workdir)), proc in zip(cases.items(), procs, strict=True)}


def test_cli_run_with_overrides_writes_result_summary_and_progress(cli_runs):
    proc, workdir = cli_runs["overrides"]
    assert proc.returncode == 0, proc.stderr
    config = quick("gram")
    config.microbatch, config.data.features = 8, 6
    want = ss.run(ss.Gram(), make_source(config.data), mesh="data:4", microbatch=8, steps_per_call=2)
    np.testing.assert_allclose(cli.result(workdir)["result"], want, rtol=1e-6, atol=1e-4)
    summary = json.loads((workdir / "summary.json").read_text())
    for key in ("rows", "seconds", "rows_per_second", "bytes_per_second", "devices", "processes", "mesh",
                "resumed_from_step", "checkpoints_written", "config"):
        assert key in summary, key
    assert summary["config"]["microbatch"] == 8 and summary["mesh"] == {"data": 4} and summary["processes"] == 1
    progress = [line for line in proc.stderr.splitlines() if "step " in line and "rows/s" in line and "ETA" in line]
    assert progress and "/" in progress[-1]
    scalars = read_scalars(str(workdir / "tensorboard"))
    assert [step for step, _ in scalars["progress"]] == list(range(1, summary["steps"] + 1))
    assert scalars["progress"][-1][1] == 1.0 and len(scalars["rows_per_second"]) == summary["steps"] - 1
    assert list((workdir / "profile").glob("plugins/profile/*/*.xplane.pb"))  # steps 2..3 traced


def test_named_arrays():
    assert list(named_arrays(np.zeros(2))) == ["result"]
    assert sorted(named_arrays(ss.combiners.SumResult(np.zeros(2), np.int64(3)))) == ["count", "sum"]
    assert sorted(named_arrays({"a": np.zeros(1), "b": {"c": np.ones(1)}})) == ["a", "b.c"]
    pair = (ss.combiners.SumResult(np.zeros(2), np.int64(3)), [np.ones(1)])  # e.g. Describe of (X, y)
    assert sorted(named_arrays(pair)) == ["0.count", "0.sum", "1.0"]


@pytest.mark.parametrize("case", range(len(BAD_ARGS)), ids=[" ".join(args) for args, _ in BAD_ARGS])
def test_bad_input_is_one_line_before_any_write(cli_runs, case):
    proc, workdir = cli_runs[f"bad {case}"]
    line = cli.one_error_line(proc)
    for word in BAD_ARGS[case][1]:
        assert word in line, line
    assert not workdir.exists()


def test_bad_config_values_and_partial_coordinator_flags_are_usage_errors(tmp_path):
    config = quick("gram")
    config.data.kind = "npy"
    assert_usage_error(lambda: run_job(config, str(tmp_path / "w")), ["--config.data.path"])
    config.data.kind = "feather"
    assert_usage_error(lambda: run_job(config, str(tmp_path / "w")), ["data.kind", "feather", "parquet, csv"])
    config = quick("gram")
    config.combiner.name = "Nope"
    assert_usage_error(lambda: run_job(config, str(tmp_path / "w")), ["Nope"])
    config.combiner.name, config.combiner.kwargs = "Histogram", {"bins": 3, "rnage": (0, 1)}
    assert_usage_error(lambda: run_job(config, str(tmp_path / "w")), ["Histogram", "rnage"])
    assert not (tmp_path / "w").exists()
    assert_usage_error(lambda: distributed.initialize(num_processes=2), ["--coordinator_address"])
    assert_usage_error(lambda: distributed.initialize("127.0.0.1:1", 2, 2), ["process_id"])
    assert distributed.initialize() == "single"  # no cluster here


def test_missing_or_unwritable_workdir(cli_runs, tmp_path, capsys):
    assert "--workdir" in cli.one_error_line(cli_runs["missing workdir"][0])
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert str(blocker) in launcher_error_line(capsys, quick("gram"), blocker / "w")


def test_progress_of_a_one_step_job_says_no_nan(caplog):
    # A job of one step (README's first command) logged "nan rows/s  ETA ?".
    from launch.logs import ProgressLog
    from sharded_scan.engine import Progress

    log = ProgressLog(every_seconds=0.0)
    with caplog.at_level("INFO"):
        log(Progress(1, 1, 1000, 1000, 2.0))
        two = ProgressLog(every_seconds=0.0)
        two(Progress(1, 3, 100, 300, 2.0))
        two(Progress(2, 3, 200, 300, 3.0))
    lines = [r.getMessage() for r in caplog.records if "step " in r.getMessage()]
    assert len(lines) == 3 and not any("nan" in line for line in lines), lines
    assert "ETA 00:00:00" in lines[0] and "100 rows/s  ETA 00:00:01" in lines[2], lines


def reject(constant):
    raise ValueError(f"not strict JSON: {constant}")


def test_csv_cells_a_spreadsheet_would_run_are_text_and_read_back_with_pandas(tmp_path):
    """Issue 42: a column named =HYPERLINK(...) was result.csv's first cell, which a spreadsheet runs."""
    names = ['=HYPERLINK("http://evil","x")', "+1", "-2", "@SUM(A1)", "\tt", "\rr", "plain", "a=b"]
    mean = np.array([-1.5, -np.inf, np.inf, np.nan, 0.0, -2.0, 1e-310, 2.5])
    count = np.array([-3, 0, 1, 2, 3, 4, 5, 6])
    values = np.array([[f"-{j}", "=1+1"] for j in range(8)])  # text cells of a (d, 2) field (TopK's strings)
    result = {"mean": mean, "count": count, "values": values, "columns": np.array(names)}
    (tmp_path / CSV).write_text(result_table(result))
    assert (tmp_path / CSV).read_text().splitlines()[1].startswith('"\'=HYPERLINK(""http://evil""')
    back = pd.read_csv(tmp_path / CSV)
    text = [f"'{n}" if n[0] in "=+-@\t\r" else n for n in names]
    assert back.columns.tolist() == ["column", "mean", "count", "values[0]", "values[1]"]
    assert back["column"].tolist() == text
    np.testing.assert_array_equal(back["mean"].to_numpy(), mean)  # negative numbers stay numbers
    np.testing.assert_array_equal(back["count"].to_numpy(), count)
    assert back["values[0]"].tolist() == [f"'-{j}" for j in range(8)] and set(back["values[1]"]) == {"'=1+1"}
    spelt = json.loads(result_json(result), parse_constant=reject)  # JSON: the names as they are, strict
    assert spelt["columns"] == names and spelt["mean"][:4] == [-1.5, "-inf", "inf", None]
