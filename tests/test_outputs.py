"""Issue 43, item 3: result.csv reads as a table a person understands, and `sharded-scan show WORKDIR` prints one.

The results are built from pandas/numpy (nothing compiles): the header checks, and one finished workdir for the
module (a Describe of pandas' numbers written as run_in_workdir writes a job's files) that `show` reads.
"""

import io
import json
import sys

import numpy as np
import pandas as pd
import pytest

import sharded_scan as ss
from launch import main as launch_main
from launch.outputs import CSV, result_files, result_table
from launch.show import main as show_main
from launch.show import show_text
from sharded_scan.combiners.linalg.regression import LinearRegressionResult
from sharded_scan.combiners.sketches.quantiles_result import QuantilesResult
from sharded_scan.combiners.statistics.comoments import CovarianceResult
from sharded_scan.combiners.statistics.correlation import CorrelationResult
from sharded_scan.combiners.statistics.describe import DescribeResult
from sharded_scan.errors import UsageError
from sharded_scan.workdir import SUMMARY, named_arrays, write_outputs
from tests.helpers import assert_usage_error

NAMES = ["a", "=b\r", "c\x00", "d", "e"]  # a formula-like name with a CR, a trailing NUL: kept apart everywhere


@pytest.fixture(scope="module")
def frame():
    rng = np.random.default_rng(43)
    x = rng.normal(size=(40, 5)) * [1.0, 10.0, 0.1, 1.0, 3.0]
    x[[3, 7], 0], x[11, 2] = np.nan, np.nan
    return pd.DataFrame(x, columns=NAMES)


@pytest.fixture(scope="module")
def finished(frame, tmp_path_factory):
    """A finished Describe workdir, written as run_in_workdir writes one (result.npz, the launcher's outputs, then
    summary.json with their digests), of pandas' own describe(): nothing to compile. ``(workdir, result)``."""
    workdir = tmp_path_factory.mktemp("show") / "describe"
    want, qs = frame.describe().T, np.array([0.25, 0.5, 0.75])
    result = DescribeResult(want["count"].to_numpy(np.int64), frame.isna().sum().to_numpy(np.int64),
                            *(want[f].to_numpy() for f in ("mean", "std", "min", "max")),
                            want[["25%", "50%", "75%"]].to_numpy(), qs, np.zeros(len(NAMES)), np.int64(1),
                            np.array(NAMES, dtype=object))
    summary = {"rows": len(frame), "config": {"combiner": {"name": "Describe"}}}
    write_outputs(str(workdir), result, summary, "nothing", result_files(ss.Describe()))
    return workdir, result


def csv_of(result) -> pd.DataFrame:
    text = result_table(named_arrays(result))
    return pd.read_csv(io.StringIO(text), keep_default_na=False, na_values=["nan"], dtype={"column": str})


def unguarded(names):
    return [f"'{n}" if n[0] in "=+-@\t\r" else n for n in names]


def test_describe_csv_is_one_row_per_column_headed_q25_q50_and_reads_back_exactly(finished, frame):
    workdir, result = finished
    table = pd.read_csv(workdir / CSV, keep_default_na=False, na_values=["nan"], dtype={"column": str})
    assert table.columns.tolist() == ["column", "count", "nan_count", "mean", "std", "min", "max", "q25", "q50",
                                      "q75", "rank_error", "passes"]
    assert table["column"].tolist() == unguarded(NAMES)
    want = frame.describe().T  # pandas' own numbers, one row per column
    np.testing.assert_array_equal(table["count"], want["count"])
    for got, theirs in (("mean", "mean"), ("std", "std"), ("min", "min"), ("q25", "25%"), ("q50", "50%"),
                        ("q75", "75%"), ("max", "max")):
        np.testing.assert_allclose(table[got], want[theirs], rtol=0, err_msg=got)  # repr: exactly
    np.testing.assert_array_equal(table["q50"], result.percentiles[:, 1])  # as result.npz holds them, to the bit
    assert table["passes"].tolist() == [1] * 5  # a field of one value: on every row


def test_quantiles_correlation_covariance_and_regression_headers_are_names_a_user_knows(frame):
    frame = frame.iloc[:, :3]
    x = frame.to_numpy()
    qs = np.array([0.0, 0.25, 0.5, 0.999, 1.0])
    quantiles = QuantilesResult(np.nanquantile(x, qs, axis=0).T, qs, np.int64(40), np.float64(0.0), np.int64(1),
                                None, np.array(NAMES[:3], dtype=object))
    table = csv_of(quantiles)
    assert table.columns.tolist() == ["column", "q0", "q25", "q50", "q99.9", "q100", "count", "rank_error", "passes"]
    np.testing.assert_array_equal(table.iloc[:, 1:6].to_numpy(), quantiles.quantiles)
    assert table["count"].tolist() == [40] * 3

    corr = frame.corr()  # the matrix's columns are the other column's name, as df.corr() prints it
    table = csv_of(CorrelationResult(np.int64(37), frame.mean().to_numpy(), corr.to_numpy(),
                                     np.array(NAMES[:3], dtype=object)))
    assert table.columns.tolist() == ["column", "mean", *unguarded(NAMES[:3]), "count"]
    np.testing.assert_array_equal(table.iloc[:, 2:5].to_numpy(), corr.to_numpy())
    assert table["count"].tolist() == [37] * 3
    clash = CovarianceResult(np.int64(3), np.zeros(2), np.eye(2), np.array(["mean", "b"], dtype=object))
    assert csv_of(clash).columns.tolist() == ["column", "mean", "cov[0]", "cov[1]", "count"]  # a name taken: f[j]

    fit = LinearRegressionResult(np.array([1.5, -2.0]), np.float64(0.25), np.int64(2), np.float64(3.0),
                                 np.float64(0.9), np.float64(0.5), np.array([0.1, 0.2]), np.float64(0.05),
                                 np.array(["x1", "x2"], dtype=object))
    table = csv_of(fit)
    assert table.columns.tolist() == ["column", "coef", "stderr", "intercept", "rank", "cond", "r2", "residual_std",
                                      "intercept_stderr"]
    assert table["coef"].tolist() == [1.5, -2.0] and table["stderr"].tolist() == [0.1, 0.2]
    assert table["r2"].tolist() == [0.9, 0.9] and table["intercept"].tolist() == [0.25, 0.25]
    two = fit._replace(coef=np.array([[1.5, -2.0], [3.0, 4.0]]), coef_stderr=np.full((2, 2), 0.1),
                       intercept=np.array([0.25, 0.5]), r2=np.array([0.9, 0.8]), residual_std=np.ones(2),
                       intercept_stderr=np.ones(2))  # two targets, t == d: coef is (t, d), never read as (d, m)
    table = csv_of(two)
    assert table.columns.tolist()[:5] == ["column", "coef[0]", "coef[1]", "stderr[0]", "stderr[1]"]
    assert table["coef[1]"].tolist() == [3.0, 4.0] and table["r2[1]"].tolist() == [0.8, 0.8]


def test_show_prints_the_finished_result_as_a_table(finished, frame, capsys):
    workdir, result = finished
    text = show_text(str(workdir), width=200)
    lines = text.splitlines()
    assert lines[0] == f"{workdir}: Describe of 40 rows"
    header = lines[2].split()
    assert header == ["count", "nan_count", "mean", "std", "min", "max", "q25", "q50", "q75", "rank_error"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[3:8]}
    assert list(rows) == ["a", "=b\\r", "c\\x00", "d", "e"]  # control characters escaped, never sent to the terminal
    assert rows["a"][:2] == ["38", "2"] and float(rows["a"][2]) == pytest.approx(frame["a"].mean(), rel=1e-5)
    assert "qs:" in lines and lines[-1].split() == ["passes", "1"]
    narrow = show_text(str(workdir), width=60).splitlines()  # wrapped in blocks, each within the width
    assert max(map(len, narrow[1:])) <= 60 and sum(line.split()[:1] == ["a"] for line in narrow) >= 2

    by_key = {"result": {"count": np.array([2, 1]), "mean": np.array([[1.5, -2.0], [np.nan, 4.0]]),
                         "columns": np.array(["u", "v"], dtype=object)},
              "rows": np.array([2, 1]), "keys": np.array(["x", "y"], dtype=object)}  # a GroupBy(Moments) result's
    write_outputs(str(workdir.parent / "grouped"), by_key, {"rows": 3}, "nothing")
    grouped = show_text(str(workdir.parent / "grouped"), width=80).splitlines()
    at = grouped.index("key y (1 rows), count 1:")  # each key's table, its fields of one value in its heading
    assert [line.split() for line in grouped[at + 1: at + 4]] == [["mean"], ["u", "NaN"], ["v", "4"]]

    sys_argv = sys.argv
    try:  # the console script: sharded-scan show WORKDIR
        sys.argv = ["sharded-scan", "show", str(workdir)]
        with pytest.raises(SystemExit) as exit_:
            launch_main.cli()
    finally:
        sys.argv = sys_argv
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith(f"{workdir}: Describe of 40 rows")


def test_show_of_a_workdir_without_a_finished_result_is_one_line(finished, tmp_path, capsys):
    (tmp_path / "running" / "checkpoints").mkdir(parents=True)
    (tmp_path / "empty").mkdir()
    assert_usage_error(lambda: show_text(str(tmp_path / "empty")), ["holds no finished result", "no summary.json"])
    assert_usage_error(lambda: show_text(str(tmp_path / "running")), ["has not finished", "rerun"])
    assert_usage_error(lambda: show_text(str(tmp_path / "none")), ["is not a directory"])
    workdir, _ = finished
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / SUMMARY).write_text((workdir / SUMMARY).read_text())
    (damaged / "result.npz").write_bytes(b"not it")
    assert_usage_error(lambda: show_text(str(damaged)), ["result.npz is missing or not the file", "rerun"])
    (damaged / SUMMARY).write_text("{")
    assert_usage_error(lambda: show_text(str(damaged)), ["summary.json cannot be read"])
    for argv in ([str(tmp_path / "empty")], [], ["a", "b"]):
        assert show_main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: "), err
    assert json.loads((workdir / SUMMARY).read_text())["rows"] == 40  # the finished one untouched
    with pytest.raises(UsageError):
        show_text(str(tmp_path / "empty"))
