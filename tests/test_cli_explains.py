"""The CLI explains itself: --help lists the job's fields, the shipped configs do what their names say,
alternative arguments work alone, a wrong or missing file is one line, launch.local refuses the flags
it sets; and the result comes out as result.json and result.csv beside result.npz."""

import json

import numpy as np
import pandas as pd
import pytest

import sharded_scan as ss
from configs import linreg, quantiles, ridge
from launch.config_args import merge_extra, split_args
from launch.data import make_combiner, make_source
from launch.help import argument_docs
from launch.main import run_job
from launch.outputs import result_json, result_table
from launch.processes import check_main_args
from sharded_scan.combiners.linalg.pca import PCAResult
from sharded_scan.workdir import named_arrays
from tests import cli
from tests.helpers import assert_usage_error, f64

pytest.importorskip("pyarrow")


@pytest.fixture(scope="module")
def helps(tmp_path_factory):
    """``--help`` without a config, with one (and an override), with a config that does not exist (processes
    forked from one that imported the launcher: tests/cli.py's run_forked); launch.local refusing a flag."""
    cwd = tmp_path_factory.mktemp("help")
    helps = [
        cli.main_cmd("--help"),
        cli.main_cmd("--config=quantiles:quick", "--help", "--config.combiner.kwargs.k=64", "--config.microbatch=8"),
        cli.main_cmd("--help", "--config=ridge"),
        cli.main_cmd("--help", "--config=nope"),
    ]
    local = cli.local_cmd(2, 1, "--config=gram:quick", f"--workdir={cwd}/w", "--jax_num_cpu_devices=8")
    with cli.concurrent.futures.ThreadPoolExecutor(1) as pool:
        refused = pool.submit(cli.run, local)
        return [*cli.run_forked(helps), refused.result()], cwd


def test_help_lists_flags_and_configs_and_exits_0(helps):
    (plain, *_), _ = helps
    assert plain.returncode == 0, plain.stderr
    for words in ("--workdir", "--config", "--list_configs", "--helpfull", "linreg", "quantiles", "ridge"):
        assert words in plain.stdout, words
    assert "--jax_num_cpu_devices" not in plain.stdout.replace("--jax_num_cpu_devices=8,", "")  # JAX's: --helpfull
    assert len(plain.stdout.splitlines()) < 120


def test_help_with_a_config_lists_its_fields_defaults_and_meanings(helps):
    (_, quantile, ridge_help, missing, _), cwd = helps
    assert quantile.returncode == 0, quantile.stderr
    out = quantile.stdout
    for line in ("--config.combiner.kwargs.k=64", "--config.combiner.kwargs.num_buckets=None",
                 "--config.combiner.kwargs.qs=(0.0, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)",
                 "--config.data.kind='synthetic'", "--config.data.columns=''", "--config.data.dtype=''",
                 "--config.microbatch=8", "--config.checkpoint.every_steps=2", "--config.x64=False"):
        assert f"  {line}\n" in out, line
    fields = out[out.index("config fields of --config=quantiles:quick"):]
    meaning = {"num_buckets": "boundaries that cut each column", "kind": "synthetic, npy, npy_shards, zarr, parquet",
               "columns": "comma-separated", "every_steps": "save after this many steps",
               "nan_policy": "rows holding NaN or Inf"}
    for field, words in meaning.items():
        block = fields[fields.index(f".{field}="):][:400]
        assert words in block, (field, block)
    assert "--config.combiner.kwargs.l2=1.0\n      the ridge penalty" in ridge_help.stdout
    assert cli.one_error_line(missing).startswith("error: --config='nope': no such config file")
    assert not list(cwd.iterdir())


def test_argument_docs_read_google_style_sections():
    docs = argument_docs(ss.Quantiles)
    assert docs["k"].startswith("the sketch size") and docs["qs"] == "the quantiles to return, each in '[0, 1]'."
    assert argument_docs(ss.RunOptions)["prefetch"] == "steps read and placed on the devices ahead of use (0: none)."
    assert argument_docs(ss.CheckpointOptions)["keep"] == "how many of the latest checkpoints to keep."


def test_shipped_regression_configs_say_their_penalty():
    assert ridge.get_config().combiner.kwargs.l2 == 1.0 and "l2=1.0" in ridge.__doc__.splitlines()[0]
    assert linreg.get_config().combiner.kwargs.l2 == 0.0
    fit = make_combiner(linreg.get_config().combiner)
    assert fit == ss.LinearRegression(l2=0.0)


def test_num_buckets_alone_replaces_the_configs_qs(monkeypatch):
    config = quantiles.get_config("quick")
    _, extra = split_args(["main", "--config.combiner.kwargs.num_buckets=10"])
    merge_extra(config, extra)
    assert make_combiner(config.combiner) == ss.Quantiles(num_buckets=10, k=8192)
    config = quantiles.get_config("quick")  # both given: the combiner's own one line
    _, extra = split_args(["main", "--config.combiner.kwargs.num_buckets=10", "--config.combiner.kwargs.qs=(0.5,)"])
    merge_extra(config, extra)
    assert_usage_error(lambda: make_combiner(config.combiner), ["exactly one of qs"])


def test_missing_and_wrong_format_files_are_one_line(tmp_path):
    frame = pd.DataFrame({"a": np.arange(8.0), "b": np.arange(8.0) ** 2})
    frame.to_parquet(tmp_path / "f.parquet")
    frame.to_csv(tmp_path / "f.csv", index=False)
    np.save(tmp_path / "f.npy", frame.to_numpy())
    data = quantiles.get_config("quick").data
    for kind, name, words in [
        ("parquet", "none.parquet", ["no such file or directory"]),
        ("csv", "none/f.csv", ["no such file or directory"]),
        ("csv", "f.parquet", ["is a Parquet file, not CSV", "--config.data.kind=parquet"]),
        ("csv", "f.npy", ["is a .npy file, not CSV", "--config.data.kind=npy"]),
        ("parquet", "f.csv", ["is text (a CSV file?), not Parquet", "--config.data.kind=csv"]),
    ]:
        data.kind, data.path = kind, str(tmp_path / name)
        assert_usage_error(lambda: make_source(data), [str(tmp_path / name), *words])
    data.kind, data.path, data.dtype = "parquet", str(tmp_path / "f.parquet"), "float32"
    np.testing.assert_array_equal(make_source(data).read(0, 8), frame.to_numpy(np.float32))


def test_launch_local_refuses_the_flags_it_sets(helps):
    (*_, local), cwd = helps
    assert "--devices_per_process=N" in cli.one_error_line(local)
    for arg in ("--jax_platforms=gpu", "--process_id=1", "-num_processes=3", "--coordinator_address=h:1"):
        assert_usage_error(lambda a=arg: check_main_args(["--config=gram", a]), [arg, "launch.local sets"])
    check_main_args(["--config=gram", "--workdir=/w", "--config.num_processes_note=1"])


def test_result_json_and_csv_hold_the_result(tmp_path):
    config = quantiles.get_config("quick")
    config.combiner.kwargs = {"qs": (0.0, 0.5, 1.0), "method": "lower"}  # 300 rows: the sketch holds them all
    # the job test_launch runs of this config (qs, method: finalize's; its rows): its compiled programs
    config.mesh, config.data.num_rows = "data:4", 300
    run_job(config, str(tmp_path))
    x = make_source(config.data).read(0, config.data.num_rows)
    want = np.quantile(x, [0.0, 0.5, 1.0], axis=0, method="lower").T
    got = json.loads((tmp_path / "result.json").read_text())
    assert sorted(got) == sorted(set(cli.result(tmp_path)) - {"sketch"})  # the sketch's records: result.npz only
    np.testing.assert_array_equal(got["quantiles"], want)
    assert got["count"] == 300 and got["columns"] == list(range(config.data.features))
    table = pd.read_csv(tmp_path / "result.csv")
    assert list(table.columns) == ["column", "q0", "q50", "q100", "count", "rank_error", "passes"]  # issue 43
    np.testing.assert_array_equal(table.iloc[:, 1:4].to_numpy(), want)


def test_result_table_is_one_row_per_column_and_json_has_no_nan():
    x = np.array([[1.0, np.nan], [3.0, np.inf], [5.0, 2.0]], np.float32)
    frame = pd.DataFrame(x, columns=["a", "b"])
    arrays = named_arrays(ss.run(ss.Moments(), frame, microbatch=2))
    table = pd.read_csv(__import__("io").StringIO(result_table(arrays)))
    assert list(table.columns) == ["column", "mean", "var", "min", "max", "skewness", "kurtosis", "nan_count", "zeros",
                                   "norm_l1", "norm_l2", "count"]
    assert table["count"].tolist() == [3, 3]  # a field of one value: on every row
    assert table["column"].tolist() == ["a", "b"]
    np.testing.assert_allclose(table["mean"], [3.0, np.nan]), np.testing.assert_allclose(table["max"], [5.0, np.nan])
    got = json.loads(result_json(arrays))
    assert got["columns"] == ["a", "b"] and got["mean"] == [3.0, None] and got["count"] == 3
    # k == d: a PCAResult as PCA(3) returns it, of numpy's SVD (result_table reads the fields, not how they were
    # computed: no program to compile for it), and a Gram's result, its one (d, d) array.
    z = np.random.default_rng(0).normal(size=(64, 3))
    _, singular, axes = np.linalg.svd(z - z.mean(0), full_matrices=False)
    variance = singular**2 / (len(z) - 1)
    pca = named_arrays(PCAResult(axes, variance, variance / variance.sum(), z.mean(0), singular, np.arange(3)))
    assert result_table(pca).splitlines()[0] == '"column","mean"'  # components are not per column, even at k == d
    assert result_table(named_arrays(f64(x[:, :1]).T @ f64(x[:, :1]))) is None
